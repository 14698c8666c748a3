/* The panels of packed weights as the products read them: their geometry (NR columns a panel, KC inputs a slice),
 * the byte layout of each block format, and how a vector of weights is widened to floats from each (the lanes).
 * Every file that reads panels (linear*.c, lookups.c, lm_head.c, arch/x86/amx_int8.c) includes this; kernels/cpu/
 * blocks.py and gguf_pack.c write the same layouts. */
#ifndef HARPOON_PANELS_H
#define HARPOON_PANELS_H
#include <stdint.h>
#include <unistd.h>

#include "arch/simd.h"
#include "ops.h"
#include "vec.h"

/* Weights of a linear layer, packed once at load time: w [N, K] becomes panels [ceil(N / NR), K, NR], so the
 * micro-kernel reads NR output columns of one k as contiguous vectors, and a whole panel streams sequentially. */
#ifndef NV
#define NV 3 /* vectors of 8 columns per panel: 24 columns; with MR = 4 rows, 12 accumulators + 3 + 1 registers */
#endif
#ifndef MR
#define MR 4
#endif
#define NR (8 * NV)
/* Rows the register micro-kernel (micro_kernel: block, int8 and BF16 panels widened in registers, fp32 activations)
 * takes at once: MR, or 8 where AVX-512 gives 32 vector registers (24 accumulators). Each output is the same FMA
 * chain either way, so the bits do not change. Why: past these rows a block panel is widened into an fp32 slice
 * first, a fixed ~8.7 ms a step of the default model's products. With 8 rows in registers a step's Q4 products took
 * 10.0 ms at 5 rows against 16.9, 12.3 at 7 against 19.5, 14.6 at 8 against 21.0, and the default server gave 12%
 * more tokens at 8 clients (AMD EPYC Zen 4, python -m loadtest.lab.kernel_ab HEAD~1 HEAD --format q4,q8; not yet
 * measured on a Xeon: -DMRF=4 builds the old split, docs/benchmarks.md). */
#ifndef MRF
#define MRF (HP_VREGS == 32 && NV == 3 ? 8 : MR)
#endif
/* Whether fp32 slices from MRF + 1 rows on go through 16-lane FMAs, one panel or two at a time
 * (arch/x86/f32_avx512.c), the same bits as micro_kernel's. */
#define HP_F32_WIDE (HP_AVX512 && NV == 3)

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "int8 panels keep four weights in the bytes of a 32-bit lane, low byte first"
#endif

/* Weight kk (0..3) of each lane of an int8 panel vector, as floats: shifted to the top byte, then arithmetically back
 * down, which sign-extends it. NOTE: GCC 12 widens an 8-byte vector to eight ints one element at a time, so the
 * int8 layout (see hp_linear_i8) puts four consecutive k of one column in each 32-bit lane instead. */
static inline v8f int8_lane(v8i w, int kk) { return __builtin_convertvector((w << (24 - 8 * kk)) >> 24, v8f); }

/* The formats of packed weights (HP_F32 ... in ops.h); one body of the micro-kernel is compiled for each. */
enum {
    F32_PANELS = HP_F32, I8_PANELS = HP_I8, Q4_PANELS = HP_Q4, BF16_PANELS = HP_BF16, Q8_PANELS = HP_Q8,
    Q5_PANELS = HP_Q5, Q6M_PANELS = HP_Q6M, Q4K_PANELS = HP_Q4K, Q5K_PANELS = HP_Q5K, Q6K_PANELS = HP_Q6K
};

/* Q4 panels hold weights that are exactly d q + m with q in 0..15 and d, m per 32 consecutive k of a column (GGUF's
 * Q4_1 blocks, as the default SmolLM2 weights are, or Q4_0 or Q4_K; d of at most 17 significant bits): for each 32 k
 * of a panel, d [NR] and m [NR] as floats, then the nibbles as [4][NV][8] 32-bit lanes, lane l of vector v holding
 * column 8 v + l at eight consecutive k, k (mod 8) in bits 4k..4k+3. 0.75 bytes a weight instead of 4. */
#define Q4_GROUP 32
#define Q4_BLOCK_BYTES (2 * NR * 4 + Q4_GROUP * NR / 2)

/* Q8 panels hold weights that are exactly d q with q in -127..127 and d per 32 consecutive k of a column (GGUF's
 * Q8_0 or Q5_0 blocks, as the default SmolLM2 embedding, which is also its LM head): for each 32 k of a panel, d [NR]
 * as floats, then the bytes in the int8 panel layout (four consecutive k of one column per 32-bit lane). 1.125 bytes
 * a weight instead of 4. */
#define Q8_GROUP 32
#define Q8_BLOCK_BYTES (NR * 4 + Q8_GROUP * NR)
_Static_assert(Q4_GROUP == Q8_GROUP, "micro_kernel walks the blocks of both formats in one loop");

/* Q5 and Q6M panels are Q8 panels with more vectors of NR floats before the bytes of each 32 k. Q5: d, m; d q + m
 * with q in 0..31 and d, m per 32 k (GGUF's Q5_1, or Q4_K beside Q5_K rows in a fused projection; d q exact, one
 * rounding in the add, as Q4), 1.25 bytes a weight. Q6M: d for k 0..15, d for k 16..31, then m likewise; d q + m
 * with q a byte: any block type, for a fused projection whose rows come in types no narrower format holds together
 * (Q4_K beside Q6_K, whose d times its int8 sub-scale has at most 18 significant bits, so d q is exact), 1.5 bytes
 * a weight. */
static inline int block_scales(int format) {
    return format == Q8_PANELS ? 1 : format == Q6M_PANELS ? 4 : 2;
}
/* Bytes of one 32-k block of a Q4, Q8, Q5 or Q6M panel. */
static inline int block_bytes(int format) {
    return block_scales(format) * NR * 4 + (format == Q4_PANELS ? Q4_GROUP / 2 : Q8_GROUP) * NR;
}

/* Q4K, Q5K and Q6K panels keep GGUF's K-quant scales as the file has them, per 256 k of a panel (a super-block):
 * Q4K and Q5K: d [NR] and dmin [NR] as the file's fp16, then its 12 bytes of 6-bit scales and mins of the eight
 * 32-k groups as [3][NR] 32-bit lanes (lane c of word i: column c, byte j: byte 4 i + j; k4_scale_min unpacks
 * them), then the weights of each 32 k as a Q4 block's nibbles (Q4K) or a Q8 block's bytes (Q5K). The kernel forms
 * d sc and -(dmin min) as gguf-py does (exact products), so the values are Q4's and Q5's in the file's 0.5625 bytes
 * a weight (Q4K; Q5K 1.06 as bytes) instead of 0.75 and 1.25. Q6K: d [NR] as floats, the int8 scales of the sixteen
 * 16-k halves as [4][NR] lanes, then per 32 k the file's six bits as it has them: q + 32 (0..63) in a Q4 block's
 * nibbles for its low four bits, then two words a column for the high two (Q6_HIGH), 0.83 bytes a weight (1.08 as
 * bytes). K % 256 == 0.
 * NOTE: the sub-scales sit four to a 32-bit lane, as int8 panels' weights do, because GCC 12 widens an 8-byte
 * vector one element at a time (a 65% slower 1-row product when they were [8][NR] bytes). Q4K's header held d and
 * dmin as floats and the scales unpacked, 24 bytes a column against the file's 16: 5% more bytes for a one-row
 * product, which reads every byte from memory, to read. */
#define KSB 256
static inline int kquant(int format) { return format == Q4K_PANELS || format == Q5K_PANELS || format == Q6K_PANELS; }
static inline int ksb_header(int format) { return (format == Q6K_PANELS ? 4 + 16 : 4 + 12) * NR; }
/* Bytes of one 32-k group's weights in a K-quant panel, and of its whole super-block. */
static inline int ksb_group_bytes(int format) {
    return (format == Q4K_PANELS ? 16 : format == Q6K_PANELS ? 24 : 32) * NR;
}
static inline int ksb_bytes(int format) { return ksb_header(format) + KSB / Q8_GROUP * ksb_group_bytes(format); }

/* Scale j (0..7) of the eight 6-bit ones in 12 packed bytes, as ggml's get_scale_min_k4 takes scale j (words a = 0,
 * c = 2) or min j (a = 1, c = 2) from bytes 4 a .. 4 a + 3 and 8 .. 11 of each lane. */
static inline v8i k4_six_bits(v8i a, v8i c, int j) {
    if (j < 4) return (a >> (8 * j)) & 63;
    return ((c >> (8 * (j - 4))) & 15) | (((a >> (8 * (j - 4) + 6)) & 3) << 4);
}

/* The 32-k block at k (a multiple of 32) of a panel slice in a block format: its scales for the eight columns of
 * vector v, d and m for its first 16 k (d0, m0) and its last 16 (d1, m1: the same where a format has one per 32;
 * m zero where it has none), and where its weights start. */
static inline __attribute__((always_inline)) const v8iu *block_at(const void *panel, int k, int format, int v,
                                                                  v8f *d0, v8f *d1, v8f *m0, v8f *m1) {
    if (kquant(format)) {
        const char *sb = (const char *)panel + (int64_t)(k / KSB) * ksb_bytes(format);
        const int g = k % KSB / Q8_GROUP;
        const char *lanes = sb + 4 * NR + 32 * v; /* this vector's 8 columns */
        if (format == Q6K_PANELS) { /* halves 2 g and 2 g + 1: bytes 2 (g % 2) and 2 (g % 2) + 1 of word g / 2 */
            const float *d = (const float *)sb;
            v8i w = *(const v8iu *)(lanes + g / 2 * NR * 4);
            *d0 = load8(d + 8 * v) * int8_lane(w, 2 * (g % 2));
            *d1 = load8(d + 8 * v) * int8_lane(w, 2 * (g % 2) + 1);
            *m0 = -32.0f * *d0, *m1 = -32.0f * *d1; /* the weights hold q + 32; d (q + 32) - 32 d is exact */
        } else {
            const char *d = sb + 16 * v, *dmin = sb + 2 * NR + 16 * v; /* fp16 */
            const v8i w0 = *(const v8iu *)lanes, w1 = *(const v8iu *)(lanes + NR * 4);
            const v8i w2 = *(const v8iu *)(lanes + 2 * NR * 4);
            *d0 = *d1 = half8(d) * __builtin_convertvector(k4_six_bits(w0, w2, g), v8f);
            *m0 = *m1 = -(half8(dmin) * __builtin_convertvector(k4_six_bits(w1, w2 >> 4, g), v8f));
        }
        return (const v8iu *)(sb + ksb_header(format) + (int64_t)g * ksb_group_bytes(format));
    }
    const float *s = (const float *)((const char *)panel + (int64_t)(k / Q8_GROUP) * block_bytes(format));
    const int halves = format == Q6M_PANELS, with_m = format != Q8_PANELS;
    *d0 = load8(s + 8 * v);
    *d1 = halves ? load8(s + NR + 8 * v) : *d0;
    *m0 = with_m ? load8(s + (halves ? 2 : 1) * NR + 8 * v) : (v8f){0};
    *m1 = halves ? load8(s + 3 * NR + 8 * v) : *m0;
    return (const v8iu *)(s + block_scales(format) * NR);
}

/* Bytes ahead of its weights that a product's first pass over a panel slice prefetches to L1: each 32-k group's
 * bytes (block panels), each pair or four k's (BF16, BF16C, int8 panels). Why: at one row the hardware prefetchers
 * alone left the int8 products' panels at 72% (Q4_K) to 96% (Q8_0) of the read bandwidth, the arithmetic between the
 * loads holding the stream back. With these a Llama-3.2-1B step's int8 products took 22% (Q4_K), 15% (Q6_K), 11%
 * (Q8_0), 20% (Q4) and 6% (Q8) less at one row, 16-23% less at four, 6-13% at sixteen, the same at 64; its exact
 * products 8-22% less at one row; BF16C's LM head 18% less at one row and 29% at four (Xeon Ice Lake, VNNI; flat
 * from 4 to 16 KiB ahead, slower to L2 or without temporal locality; python -m loadtest.lab.kernel_ab HEAD
 * WORKTREE, python -m loadtest.lab.gemm). The passes of the later rows over the same slice find it in the caches and
 * prefetch nothing. The fp32 panels' 16-lane body (arch/x86/f32_avx512.c) reads at the bandwidth without them. */
#ifndef PANEL_AHEAD
#define PANEL_AHEAD 4096
#endif
/* Bytes of a block panel slice per 32 k, on average (a K-quant super-block's header spread over its groups). */
static inline int slice_group_bytes(int format) {
    return kquant(format) ? ksb_bytes(format) / (KSB / Q8_GROUP) : block_bytes(format);
}
/* The lines from p + ahead that the next ``bytes`` of a panel will read, prefetched to L1 (none where ahead is 0). */
static inline __attribute__((always_inline)) void prefetch_ahead(const void *p, int bytes, int ahead) {
    if (ahead)
        for (int l = 0; l < bytes; l += 64) __builtin_prefetch((const char *)p + ahead + l, 0, 3);
}

/* Whether a block format's values are d q + m (else d q), and whether its weights are nibbles (else bytes). */
static inline int block_with_m(int format) { return format != Q8_PANELS; }
static inline int block_nibbles(int format) {
    return format == Q4_PANELS || format == Q4K_PANELS || format == Q6K_PANELS;
}

/* Q6K's high two bits: after a group's four nibble words, two words a column (Q6_HIGH), word j / 2 for nibble words
 * j and j + 1 (j even): byte i of it holds the high bits of the values in nibbles 2 i and 2 i + 1 of nibble word j
 * (bits 0-1, 2-3) and of word j + 1 (bits 4-5, 6-7). One shift and one mask then put a nibble's high bits beside
 * it, for the exact products (q6_high) as for the int8 ones (four a lane). */
#define Q6_HIGH 4 /* index (in vectors of NV) of a Q6K group's first high word */
static inline v8i q6_high(v8i h, int g, int kk) { /* bits 4-5: the high bits of nibble kk of nibble word g */
    return ((h >> (8 * (kk / 2) + 4 * (g % 2) + 2 * (kk % 2))) & 3) << 4;
}

/* BF16 panels hold weights whose low 16 bits are zero (a bf16 checkpoint loaded as fp32) at half the bytes: the
 * high halves, two consecutive k of one column in each 32-bit lane, the even k in the low half (as int8 panels put
 * four). Weight kk (0..1) of each lane is then one shift or one mask from the fp32 value it is.
 * NOTE: the fp32 panel layout with one bf16 per column (each vector of 8 widened by vpmovzxwd and a shift) read
 * ~15 GB/s at one row, against ~23 for fp32 panels (python -m loadtest.compact_gemm --format bf16). */
static inline v8f bf16_lane(v8i w, int kk) { return (v8f)(kk ? w & -65536 : w << 16); }

/* Weight kk (0..7) of the eight k in each lane of a Q4 nibble vector, dequantized: d q + m. d q is exact (a d of at
 * most 17 significant bits times a 4-bit q), so the one rounding of the add (fused or not) gives the bits of the fp32
 * weight. */
static inline v8f q4_lane(v8i w, int kk, v8f d, v8f m) {
    return d * __builtin_convertvector((w >> (4 * kk)) & 15, v8f) + m;
}

/* Weight kk (0..7) of nibble word g of a Q6K group, its high bits from h: d (q + 32) - 32 d, where both products and
 * the result d q have at most 24 significant bits (an 18-bit d times 6 bits), so the add rounds to the exact d q. */
static inline v8f q6_lane(v8i w, v8i h, int g, int kk, v8f d, v8f m) {
    return d * __builtin_convertvector(((w >> (4 * kk)) & 15) | q6_high(h, g, kk), v8f) + m;
}

/* Weight kk (0..3) of each lane of a Q8 byte vector, dequantized: d q, exact (an fp16 d times a 7-bit q). */
static inline v8f q8_lane(v8i w, int kk, v8f d) { return d * int8_lane(w, kk); }

/* A block or BF16 panel's kc x NR slice as the fp32 panel slice of the same weights (kc a multiple
 * of 32; of 2 for BF16). */
static __attribute__((unused)) void unpack(const void *panel, int kc, float *out, int format) {
    if (format == BF16_PANELS) {
        for (int k = 0; k < kc; k += 2)
            for (int v = 0; v < NV; v++) {
                v8i w = ((const v8iu *)panel)[k / 2 * NV + v];
                store8(out + (int64_t)k * NR + 8 * v, bf16_lane(w, 0));
                store8(out + (int64_t)(k + 1) * NR + 8 * v, bf16_lane(w, 1));
            }
        return;
    }
    const int nibbles = block_nibbles(format), with_m = block_with_m(format), per_word = nibbles ? 8 : 4;
    for (int k = 0; k < kc; k += Q8_GROUP)
        for (int v = 0; v < NV; v++) {
            v8f d0, d1, m0, m1;
            const v8iu *words = block_at(panel, k, format, v, &d0, &d1, &m0, &m1);
            for (int g = 0; g < Q8_GROUP / per_word; g++) {
                const int second = g >= Q8_GROUP / per_word / 2; /* k 16..31: their own scales, where such */
                v8f d = second ? d1 : d0, m = second ? m1 : m0;
                v8i w = words[g * NV + v], h = format == Q6K_PANELS ? words[(Q6_HIGH + g / 2) * NV + v] : (v8i){0};
#pragma GCC unroll 8
                for (int kk = 0; kk < per_word; kk++) {
                    v8f value = format == Q6K_PANELS ? q6_lane(w, h, g, kk, d, m)
                                : nibbles ? q4_lane(w, kk, d, m) : q8_lane(w, kk, d);
                    if (!nibbles && with_m) value += m;
                    store8(out + (int64_t)(k + per_word * g + kk) * NR + 8 * v, value);
                }
            }
        }
}

/* Bytes of k rows of a packed panel (k % 4 == 0 for int8 panels, k % 2 == 0 for BF16, k % 32 == 0 for the blocks). */
static inline int64_t panel_bytes(int64_t k, int format) {
    if (format == F32_PANELS) return k * NR * (int64_t)sizeof(float);
    if (format == BF16_PANELS) return k * NR * 2;
    if (format == I8_PANELS) return k * NR;
    if (kquant(format)) return k / KSB * ksb_bytes(format);
    return k / Q4_GROUP * block_bytes(format);
}

#ifndef KC
#define KC 768
#endif

/* A micro-tile's row of accumulators into y: stored from the first k block, added after it, the bias added with the
 * last. */
static inline __attribute__((always_inline)) void store_tile_row(float *yi, const v8f c[NV], int cols,
                                                                 const float *bias, int first) {
    if (cols == NR && !bias) {
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) store8(yi + 8 * v, first ? c[v] : load8(yi + 8 * v) + c[v]);
    } else {
        for (int j = 0; j < cols; j++) yi[j] = (first ? 0.0f : yi[j]) + c[j / 8][j % 8] + (bias ? bias[j] : 0.0f);
    }
}

/* Rows per block: a block's k slices (KC fp32 values a row) stay in L2 while the panels pass over them, in a quarter
 * of the core's L2 as the CPU reports it, and at least 256 KB (84 rows: what every machine had before). Why: on a Xeon
 * with 2 MB of L2 a step's products at 103 rows took 12-14% less time in one block than in blocks of 84 (fp32 and Q4
 * panels; at 200 rows 5-9%, python -m loadtest.lab.kernel_ab WORKTREE "WORKTREE -DROW_BLOCK=128"): each block
 * unpacks every compact panel slice again, and a short last block runs fewer rows per slice. */
static __attribute__((unused)) int row_block(void) {
    static int rows = 0; /* the same value from any thread */
    if (!rows) {
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE), least = 256 * 1024;
        rows = (int)((l2 / 4 > least ? l2 / 4 : least) / ((int64_t)KC * 4)) / MR * MR;
    }
    return rows;
}
#ifndef ROW_BLOCK
#define ROW_BLOCK row_block()
#endif

#endif
