/* The library's entry points that Python (kernels/cpu/__init__.py) and decoder.c call, each documented where it is
 * defined, and the formats they take: packed weights (enum hp_weight_format, laid out in panels.h and gguf_pack.c)
 * and K/V pools (enum hp_kv_format). */
#ifndef HARPOON_OPS_H
#define HARPOON_OPS_H
#include <stdint.h>

/* Formats of packed linear weights: fp32 panels (hp_pack_weight), int8 panels with per-column scales (approximate,
 * for the screened LM head), Q4, Q8, Q5, Q6M, Q4K, Q5K, Q6K and BF16 panels (the same fp32 values in fewer bytes;
 * kernels/cpu/blocks.py), and BF16C panels (the BF16 layout, computed in bfloat16: the activations rounded to
 * bfloat16 too, the products summed in fp32 as avx512_bf16's dot product sums them; a bfloat16 model's weights). */
enum hp_weight_format {
    HP_F32 = 0, HP_I8 = 1, HP_Q4 = 2, HP_BF16 = 3, HP_Q8 = 4, HP_BF16C = 5, HP_Q5 = 6, HP_Q6M = 8, HP_Q4K = 9,
    HP_Q5K = 10, HP_Q6K = 11, HP_BF16A = 12, HP_Q4A = 13, HP_Q6A = 14, HP_Q8A = 15, HP_Q4S = 16, HP_Q6S = 17,
    HP_Q8S = 18, HP_Q4KS = 19, HP_Q6KS = 20
};
/* BF16A panels: the BF16C layout with HP_BF16A_WIDTH columns a panel, two whole AMX tiles of weights (a 24-column
 * BF16C panel is a tile and a half: its second tile op runs half empty). Only AMX tiles compute them (amx.c). */
#define HP_BF16A_WIDTH 32

/* The bodies that can compute BF16C products (HP_BF16_BODY_AT): the portable FMAs, avx512_bf16's dot product (the
 * same bits), AMX tiles (amx.c: their own bits; weights whose K is a multiple of 32, others keep the dot product). */
enum hp_bf16_dot { HP_BF16_FMA = 0, HP_BF16_DPBF16 = 1, HP_BF16_AMX = 2 };
/* Bytes of one tile (16 columns x 32 inputs) of the widened panels, which hold a GGUF file's blocks for AMX (amx.c;
 * gguf_pack.c packs them): Q4A d and m of its 16 columns (fp32), then 16 rows of 16 bytes of nibbles; Q6A d of
 * inputs 0-15 and of 16-31, the low nibbles, then 8 x 16 bytes of high bits; Q8A d, then 16 rows of 32 bytes. */
#define HP_Q4A_TILE_BYTES (16 * 4 * 2 + 16 * 16)
#define HP_Q6A_TILE_BYTES (HP_Q4A_TILE_BYTES + 8 * 16)
#define HP_Q8A_TILE_BYTES (16 * 4 + 16 * 32)
/* Q4S, Q6S and Q8S panels: the bytes of Q4A, Q6A and Q8A panels, multiplied in fp32 (amx.c). Q4KS and Q6KS panels:
 * Q4S's and Q6S's products of a Q4_K or Q6_K weight from its own scales, in about the file's bytes (0.58 and 0.82 a
 * weight, Q4S and Q6S 0.75 and 1): per 32 columns and 256 inputs (a super-block), a header for each of its two
 * tiles (the 16 columns' d as the file's fp16, then Q4KS: their dmin too, and their eight 6-bit scales [8][16] and
 * mins [8][16] as bytes; Q6KS: their sixteen int8 scales [16][16]), then per 32 inputs each tile's q: 256 bytes of
 * low four bits, then (Q6KS) 128 bytes of high two bits, in the order hp_ksplit_low_at and hp_ksplit_high_at give. */
/* Where a Q4KS or Q6KS tile's header keeps its fields (bytes from its start, each field 16 columns wide), where its
 * bytes end, and where a Q6KS tile's high bits follow its nibbles. */
#define HP_Q4KS_DMIN_AT (16 * 2)
#define HP_Q4KS_SCALES_AT (HP_Q4KS_DMIN_AT + 16 * 2)
#define HP_Q4KS_MINS_AT (HP_Q4KS_SCALES_AT + 8 * 16)
#define HP_Q4KS_HEAD_BYTES (HP_Q4KS_MINS_AT + 8 * 16)
#define HP_Q6KS_SCALES_AT (16 * 2)
#define HP_Q6KS_HEAD_BYTES (HP_Q6KS_SCALES_AT + 16 * 16)
#define HP_Q6KS_HIGH_AT (16 * 16)
static inline int hp_ksplit_format(int format) { return format == HP_Q4KS || format == HP_Q6KS; }
static inline int hp_split_format(int format) {
    return format == HP_Q4S || format == HP_Q6S || format == HP_Q8S || hp_ksplit_format(format);
}
/* A Q4KS or Q6KS tile's header, its q for 32 inputs, and a super-block of both tiles. */
static inline int hp_ksplit_head_bytes(int format) {
    return format == HP_Q4KS ? HP_Q4KS_HEAD_BYTES : HP_Q6KS_HEAD_BYTES;
}
static inline int hp_ksplit_tile_bytes(int format) { return format == HP_Q4KS ? 16 * 16 : HP_Q6KS_HIGH_AT + 8 * 16; }
static inline int64_t hp_ksplit_super_bytes(int format) {
    return 2 * hp_ksplit_head_bytes(format) + 8 * 2 * hp_ksplit_tile_bytes(format);
}
/* Where a Q4KS or Q6KS tile keeps the value of its row r (a pair of inputs, k = 2 r + e) at position pos (2 c + e,
 * column c): its low four bits at bit 4 (r % 4) of the 16-bit word at byte hp_ksplit_low_at, a Q6KS value's high
 * two bits at bit 2 (r % 4) of the byte at HP_Q6KS_HIGH_AT + hp_ksplit_high_at. Why: four rows of a tile take one
 * 64-byte load (and Q6KS 32 bytes more), and each row's 32 values come out of it by a shift and a look-up of 16-bit
 * words (amx.c's widen_ksplit), where Q4A's layout took three shuffles a row. */
static inline int hp_ksplit_low_at(int r, int pos) { return 64 * (r / 4) + 2 * pos; }
static inline int hp_ksplit_high_at(int r, int pos) { return 32 * (r / 4) + pos; }
/* A tile's bytes of a widened format, or of the split format of the same bytes. */
static inline int64_t hp_widened_tile_bytes(int format) {
    return format == HP_Q6A || format == HP_Q6S   ? HP_Q6A_TILE_BYTES
           : format == HP_Q8A || format == HP_Q8S ? HP_Q8A_TILE_BYTES
                                                  : HP_Q4A_TILE_BYTES;
}

/* The word that names a product (hp_linear_packed's and hp_argmax_packed's first argument, the decoder's *_format
 * fields): the weights' format (bits 0-7, enum hp_weight_format); HP_Q8X, the activations rounded to int8 (a block
 * format, where the CPU has u8 x s8 dot products: hp_q8x_available); and the body that computes it, which start-up
 * chose for this machine (kernels/cpu/bodies.py). A body field of 0 is this build's default. The choice travels with
 * every call: no state of the process says how a product runs, so two engines in one process may differ. */
#define HP_Q8X 256
#define HP_FORMAT_BITS 255
#define HP_BF16_BODY_AT 9      /* 2 bits: 1 + enum hp_bf16_dot */
#define HP_F32_BODY_AT 11      /* 2 bits: 1 + enum hp_f32_body, from MRF + 1 rows on */
#define HP_Q8X_DOT_AT 13       /* 2 bits: 1 + enum hp_q8x_dot */
#define HP_Q8X_TILE_ROWS_AT 16 /* 8 bits: from how many rows AMX tiles take the int8 products (0: never) */
enum hp_f32_body { HP_F32_PANELS = 0, HP_F32_PAIRS = 1 };
enum hp_q8x_dot { HP_Q8X_VNNI = 0, HP_Q8X_MADDUBS = 1 };
int hp_q8x_available(void);
/* Whether AMX tiles can take the int8-activation products (arch/x86/amx_int8.c). */
int hp_q8x_tiles_available(void);

void hp_linear(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy, int M,
               int N, int K);
void hp_linear_packed(int format, const float *x, int64_t ldx, const void *packed, const float *bias, float *y,
                      int64_t ldy, int M, int N, int K);
void hp_linear_i8(const float *x, int64_t ldx, const signed char *packed, const float *scales, float *y, int64_t ldy,
                  int M, int N, int K);
/* Element types of the K/V pools: fp32 (exact, the default), bfloat16 (half the bytes to read per position;
 * each value rounded to nearest even on the way in, widened back to fp32 on the way out), or int8 (a quarter of the
 * bytes, and a float32 scale after each head's D values: kernels/kv_int8.py says how they are rounded). */
enum hp_kv_format { HP_KV_F32 = 0, HP_KV_BF16 = 1, HP_KV_I8 = 2 };

/* Bytes of one KV head's row of one position in a pool of kv_format: D values, and for int8 the row's scale after
 * them (a float32: the row is d q, d = max |x| / 127). */
static inline int64_t kv_head_bytes(int D, int kv_format) {
    return kv_format == HP_KV_I8 ? D + (int64_t)sizeof(float) : (int64_t)D * (kv_format == HP_KV_BF16 ? 2 : 4);
}

void hp_paged_decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                               const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, float *out,
                               int64_t out_stride, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                               int block_size, float scale, int kv_format);
void hp_rms_norm(const float *x, int64_t ldx, const float *w, float *out, int M, int D, float eps);
void hp_add_rms_norm(const float *x, float *residual, const float *w, float *out, int M, int D, float eps);
void hp_rotary(float *x, int64_t ldx, const int64_t *positions, const float *cos_cache, const float *sin_cache,
               int T, int num_heads, int head_dim);
void hp_silu_mul(const float *gate_up, float *out, int M, int I);
void hp_store_kv(const float *k, int64_t ldk, const float *v, int64_t ldv, void *k_cache, void *v_cache,
                 const int64_t *slots, int T, int num_kv_heads, int head_dim, int kv_format);

#endif
