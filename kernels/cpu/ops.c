/* Harpoon's fp32 CPU kernels, loaded through ctypes by kernels/cpu/__init__.py.
 *
 * Why C: on a small CPU a decode step is a few hundred tiny operations. Torch spends more time dispatching them,
 * and its decode attention must first gather every request's KV blocks into a contiguous copy per layer. These
 * kernels read the paged pool in place and stream the weights of a skinny matmul exactly once.
 *
 * Plain C with GCC vector extensions (8 floats, one AVX2 register) and OpenMP, so it builds with -march=native on
 * any x86-64 or ARM host; the one intrinsic (avx512_bf16's dot product) has a portable twin with the same bits. Every pointer is fp32 and contiguous unless a stride or a format argument
 * says otherwise.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ops.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef __AVX512F__
typedef float v16f __attribute__((vector_size(64), aligned(4))); /* sixteen floats: one AVX-512 register */
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define HP_NATIVE_BF16 1 /* vdpbf16ps: 16 bfloat16 products summed per 8 lanes per instruction */
#else
#define HP_NATIVE_BF16 0
#endif

/* u8 x s8 dot products, four a 32-bit lane (the Q8X products, below) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HP_DOT_U8S8 1
static inline v8i dot_u8s8(v8i acc, v8i u, v8i s) {
    return (v8i)_mm256_dpbusd_epi32((__m256i)acc, (__m256i)u, (__m256i)s);
}
#elif defined(__AVXVNNI__)
#define HP_DOT_U8S8 1
static inline v8i dot_u8s8(v8i acc, v8i u, v8i s) {
    return (v8i)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)u, (__m256i)s);
}
#else
#define HP_DOT_U8S8 0
static inline v8i dot_u8s8(v8i acc, v8i u, v8i s) { (void)u, (void)s; return acc; } /* never called */
#endif

/* u8 x s8 products with AVX2's maddubs: pairs summed to 16-bit lanes (pairs_u8s8), a run of them summed as such
 * (add16) where it cannot saturate, then widened to 32-bit lanes (widen16). Unsigned weights (nibbles; Q5's and
 * Q5K's q, 0..31; Q6K's q + 32, 0..63) go in as they are: a pair's sum is at most 2 x 63 x 127 = 16002. */
#ifdef __AVX2__
#define HP_DOT_S8S8 1
static inline v8i pairs_u8s8(v8i u, v8i x) { return (v8i)_mm256_maddubs_epi16((__m256i)u, (__m256i)x); }
static inline v8i add16(v8i a, v8i b) { return (v8i)_mm256_add_epi16((__m256i)a, (__m256i)b); }
static inline v8i widen16(v8i pairs) { return (v8i)_mm256_madd_epi16((__m256i)pairs, _mm256_set1_epi16(1)); }
/* s8 x s8 dot products (llama.cpp's way before VNNI): |w| (unsigned) times x with w's sign, pairs summed to 16 bits
 * (at most 2 x 128 x 127 = 32512: no saturation), then to 32-bit lanes. Two more instructions than a VNNI dot, and
 * no offset to take back off. */
static inline v8i dot_s8s8(v8i acc, v8i w, v8i x) {
    return acc + widen16(pairs_u8s8((v8i)_mm256_sign_epi8((__m256i)w, (__m256i)w),
                                    (v8i)_mm256_sign_epi8((__m256i)x, (__m256i)w)));
}
#else
#define HP_DOT_S8S8 0
static inline v8i dot_s8s8(v8i acc, v8i w, v8i x) { (void)w, (void)x; return acc; } /* never called */
static inline v8i pairs_u8s8(v8i u, v8i x) { (void)x; return u; }                  /* never called */
static inline v8i add16(v8i a, v8i b) { (void)b; return a; }                        /* never called */
static inline v8i widen16(v8i pairs) { return pairs; }                              /* never called */
#endif

/* The Q8X dot products this build has (bit 0: VNNI's u8 x s8, bit 1: AVX2's s8 x s8), and the one products use:
 * the backend times both where both exist (hp_set_q8x_dot) and keeps the faster. */
enum { Q8X_VNNI = 1, Q8X_MADDUBS = 2 };
static int q8x_dot = HP_DOT_U8S8 ? Q8X_VNNI : Q8X_MADDUBS;
int hp_q8x_dots(void) { return (HP_DOT_U8S8 ? Q8X_VNNI : 0) | (HP_DOT_S8S8 ? Q8X_MADDUBS : 0); }
int hp_q8x_available(void) { return hp_q8x_dots() != 0; }
/* From how many rows on AMX tiles take the Q8X products instead of the dot product (0: never; the same bits, so
 * the backend sets it from its timings at start-up: hp_set_q8x_tile_rows). */
static int q8x_tile_rows = 0;
int hp_q8x_tiles_available(void);
int hp_set_q8x_tile_rows(int rows) {
    if (rows < 0 || (rows && !hp_q8x_tiles_available())) return -1;
    q8x_tile_rows = rows;
    return 0;
}
int hp_set_q8x_dot(int dot) {
    if (!(hp_q8x_dots() & dot) || (dot != Q8X_VNNI && dot != Q8X_MADDUBS)) return -1;
    q8x_dot = dot;
    return 0;
}

static inline v8f load8(const float *p) { return *(const v8f *)p; }
static inline void store8(float *p, v8f v) { *(v8f *)p = v; } /* unaligned, straight from the register */

static inline float hsum8(v8f v) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
}

static inline float dot(const float *a, const float *b, int n) {
    v8f acc0 = {0}, acc1 = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 += load8(a + i) * load8(b + i);
        acc1 += load8(a + i + 8) * load8(b + i + 8);
    }
    for (; i + 8 <= n; i += 8) acc0 += load8(a + i) * load8(b + i);
    float s = hsum8(acc0 + acc1);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* e^x for eight lanes, within 2 ulp of expf over the whole range (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2,
 * a degree-6 polynomial for e^r, 2^n built in the exponent bits). Inputs past +-88.38 saturate to e^+-88.38; NaN
 * stays NaN. NOTE: the scalar expf of glibc cost ~4 ns a call here, more than the rest of the decode attention's
 * softmax and than the whole of SiLU's arithmetic. */
static inline v8f exp8(v8f x) {
    const v8f hi = splat8(88.3762626647949f), lo = splat8(-88.3762626647949f), magic = splat8(12582912.0f);
    x = select8(x > hi, hi, x);
    x = select8(x < lo, lo, x);
    v8f t = x * splat8(1.44269504088896341f) + magic; /* round to nearest: n sits in the low mantissa bits */
    v8f n = t - magic;
    v8f r = x - n * splat8(0.693359375f) - n * splat8(-2.12194440e-4f);
    v8f p = splat8(1.9875691500E-4f);
    p = p * r + splat8(1.3981999507E-3f);
    p = p * r + splat8(8.3334519073E-3f);
    p = p * r + splat8(4.1665795894E-2f);
    p = p * r + splat8(1.6666665459E-1f);
    p = p * r + splat8(5.0000001201E-1f);
    v8f y = p * r * r + r + splat8(1.0f);
    v8i bits = ((v8i)t - (v8i)magic + 127) << 23; /* 2^n; n = -127 (x near -88.38) gives 0 */
    return y * (v8f)bits;
}

/* The largest of n floats (n >= 1), eight lanes at a time. */
static float max_of(const float *x, int n) {
    v8f m = splat8(x[0]);
    int i = 0;
    for (; i + 8 <= n; i += 8) m = select8(load8(x + i) > m, load8(x + i), m);
    float mx = m[0];
    for (int j = 1; j < 8; j++) mx = m[j] > mx ? m[j] : mx;
    for (; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    return mx;
}

/* x[i] = e^(x[i] - sub) for n floats, returning their sum: a softmax's numerators. */
static float exp_sub_sum(float *x, int n, float sub) {
    v8f acc = {0}, s = splat8(sub);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f e = exp8(load8(x + i) - s);
        store8(x + i, e);
        acc += e;
    }
    if (i < n) { /* the tail through the same function, so every position is computed alike */
        v8f tail = s;
        memcpy(&tail, x + i, sizeof(float) * (n - i));
        v8f e = exp8(tail - s);
        for (int j = 0; j < n - i; j++) {
            x[i + j] = e[j];
            acc[j] += e[j];
        }
    }
    return hsum8(acc);
}

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
#if defined(__AVX512F__) && defined(__AVX512VL__) && NV == 3
#define MRF 8
#else
#define MRF MR
#endif
#endif

int hp_panel_width(void) { return NR; }
/* The most rows a product over compact panels runs in registers, widening their values there; from one more on, it
 * widens each panel slice into an fp32 buffer first (panel_product). */
int hp_register_rows(void) { return MRF; }

/* packed [ceil(N / width), K, width] = w [N, K] by panels of width columns, zero past column N: 32-bit words moved
 * as bits, so fp32 weights or two bfloat16 (k, k + 1) a word, the BF16C and BF16A layouts. Why in C: torch's copy
 * of the same transposed view packed 0.6-0.7 GB/s in a warm process, this loop 2.1-2.6 (in a fresh one the first
 * writes to the panels' fresh pages then take most of the time). */
void hp_pack_words(const uint32_t *w, uint32_t *packed, int N, int K, int width) {
    int panels = (N + width - 1) / width;
#pragma omp parallel for schedule(dynamic, 1)
    for (int p = 0; p < panels; p++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < width; j++) {
                int n = p * width + j;
                packed[((int64_t)p * K + k) * width + j] = n < N ? w[(int64_t)n * K + k] : 0;
            }
}

void hp_pack_weight(const float *w, float *packed, int N, int K) {
    hp_pack_words((const uint32_t *)w, (uint32_t *)packed, N, K, NR);
}

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

typedef int v8iu __attribute__((vector_size(32), aligned(4)));

/* Eight fp16 values at p as floats (exact). NOTE: GCC 12 converts a vector of _Float16 one element at a time (a
 * 1-row Q4K product took 1.5x as long), so F16C's instruction is named where the CPU has it. */
#if defined(__AVX2__) && defined(__F16C__) /* immintrin.h is included with AVX2 */
static inline v8f half8(const void *p) { return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
static inline v8f half8(const void *p) {
    v8f r;
    for (int i = 0; i < 8; i++) r[i] = (float)((const _Float16 *)p)[i];
    return r;
}
#endif

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

/* c[i] += x[i][k] * b for the rows of a micro-tile: one broadcast of x per row. */
static inline __attribute__((always_inline)) void accumulate(int rows, v8f c[MRF][NV], const float *x, int64_t ldx,
                                                             int k, const v8f b[NV]) {
#pragma GCC unroll 8
    for (int i = 0; i < MRF; i++) {
        if (i < rows) {
            v8f a = splat8(x[i * ldx + k]); /* one vbroadcastss from memory */
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) c[i][v] += a * b[v];
        }
    }
}

/* y[rows, cols] (+)= x[rows, kc] . panel[kc, NR]: NV * rows accumulators. The first k block stores, later ones add,
 * the last adds the bias, or for int8 panels scales each column. Every format feeds the same FMAs in the same order,
 * so a Q4 panel gives the bits of the fp32 panel of the same weights. */
static inline __attribute__((always_inline)) void micro_kernel(int rows, const float *x, int64_t ldx,
                                                               const void *panel, int kc, float *y, int64_t ldy,
                                                               int cols, const float *bias, const float *scale,
                                                               int first, int format) {
    v8f c[MRF][NV], b[NV];
#pragma GCC unroll 8
    for (int i = 0; i < MRF; i++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) c[i][v] = (v8f){0};
    if (format == F32_PANELS) {
        for (int k = 0; k < kc; k++) {
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) b[v] = load8((const float *)panel + (int64_t)k * NR + 8 * v);
            accumulate(rows, c, x, ldx, k, b);
        }
    } else if (format == I8_PANELS || format == BF16_PANELS) { /* 4 or 2 consecutive k in each 32-bit lane */
        const int bf16 = format == BF16_PANELS, per_word = bf16 ? 2 : 4;
        for (int k = 0; k < kc; k += per_word) {
            const v8iu *words = (const v8iu *)((const char *)panel + (int64_t)k * NR * (bf16 ? 2 : 1));
            v8i w[NV];
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) w[v] = words[v];
#pragma GCC unroll 4
            for (int kk = 0; kk < per_word; kk++) {
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) b[v] = bf16 ? bf16_lane(w[v], kk) : int8_lane(w[v], kk);
                accumulate(rows, c, x, ldx, k + kk, b);
            }
        }
    } else { /* block formats (constant per call): per 32 inputs, the scales, then the weights */
        const int nibbles = block_nibbles(format), with_m = block_with_m(format), per_word = nibbles ? 8 : 4;
        for (int k = 0; k < kc; k += Q4_GROUP) {
            const v8iu *words = 0;
            v8f d[NV], m[NV], d1[NV], m1[NV];
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) words = block_at(panel, k, format, v, &d[v], &d1[v], &m[v], &m1[v]);
            for (int g = 0; g < Q4_GROUP / per_word; g++) {
                v8i w[NV];
                if (g == Q4_GROUP / per_word / 2) /* the second 16 k: their own scales, where a format has such */
#pragma GCC unroll 4
                    for (int v = 0; v < NV; v++) d[v] = d1[v], m[v] = m1[v];
                v8i h[NV];
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) {
                    w[v] = words[g * NV + v];
                    h[v] = format == Q6K_PANELS ? words[(Q6_HIGH + g / 2) * NV + v] : (v8i){0};
                }
#pragma GCC unroll 8
                for (int kk = 0; kk < per_word; kk++) {
#pragma GCC unroll 4
                    for (int v = 0; v < NV; v++)
                        b[v] = format == Q6K_PANELS ? q6_lane(w[v], h[v], g, kk, d[v], m[v])
                               : nibbles ? q4_lane(w[v], kk, d[v], m[v])
                                         : with_m ? q8_lane(w[v], kk, d[v]) + m[v] : q8_lane(w[v], kk, d[v]);
                    accumulate(rows, c, x, ldx, k + per_word * g + kk, b);
                }
            }
        }
    }
    const int scaled = format == I8_PANELS && scale;
#pragma GCC unroll 8
    for (int i = 0; i < MRF; i++) {
        if (i >= rows) break;
        float *yi = y + i * ldy;
        if (cols == NR && !bias) {
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) {
                v8f t = first ? c[i][v] : load8(yi + 8 * v) + c[i][v];
                if (scaled) t *= load8(scale + 8 * v);
                *(v8f *)(yi + 8 * v) = t;
            }
        } else {
            for (int j = 0; j < cols; j++) {
                float t = (first ? 0.0f : yi[j]) + c[i][j / 8][j % 8] + (bias ? bias[j] : 0.0f);
                yi[j] = scaled ? t * scale[j] : t;
            }
        }
    }
}

/* A block or BF16 panel's kc x NR slice as the fp32 panel slice of the same weights (kc a multiple
 * of 32; of 2 for BF16). */
static void unpack(const void *panel, int kc, float *out, int format) {
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
/* Rows m0..m1 of y (+)= x . one panel slice (kc x NR), in blocks of MRF rows; x and y start at the slice's k0, n0. */
static inline __attribute__((always_inline)) void panel_rows(int m0, int m1, const float *x, int64_t ldx,
                                                             const void *panel, int kc, float *y, int64_t ldy,
                                                             int cols, const float *b, const float *sc, int first,
                                                             int format) {
    _Static_assert(MRF <= 8 && (MRF == 8 || MRF <= 5), "panel_rows has a case for every row count below MRF");
    for (int m = m0; m < m1; m += MRF) {
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
        switch (m1 - m < MRF ? m1 - m : MRF) {
        /* a constant row count per call, so each case compiles to its own unrolled kernel */
        case 1: micro_kernel(1, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format); break;
        case 2: micro_kernel(2, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format); break;
#if MRF > 3
        case 3: micro_kernel(3, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format); break;
#endif
#if MRF > 4
        case 4: micro_kernel(4, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format); break;
#endif
#if MRF > 5
        case 5: micro_kernel(5, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format); break;
        case 6: micro_kernel(6, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format); break;
        case 7: micro_kernel(7, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format); break;
#endif
        default: micro_kernel(MRF, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format); break;
        }
    }
}

#if defined(__AVX512F__) && NV == 3
/* The fp32 micro-kernel on AVX-512: a panel's 24 columns as one 16-lane and one 8-lane vector, 8 rows. Each output
 * is still one FMA chain over k in order (a lane's FMA is the same in a 16-lane register), so the bits are
 * micro_kernel's; but 16 FMAs carry 192 products where 12 carried 96, and one broadcast serves both vectors. Why:
 * the products of prompt chunks and of batches of decodes run here (a compact panel is unpacked to fp32 first). On
 * a Xeon with AMX a step's products at 16-128 rows took 4-10% less time, Q4 and fp32 panels alike (python -m
 * loadtest.lab.kernel_ab HEAD~1 HEAD --format q4 --rows 16,64). */
#define MRW 8 /* 8 x 2 accumulators + 2 weight vectors + a broadcast: 19 of 32 registers (12 rows ran 1.6x slower) */

static inline __attribute__((always_inline)) void micro_kernel_f32w(int rows, const float *x, int64_t ldx,
                                                                    const float *panel, int kc, float *y, int64_t ldy,
                                                                    int cols, const float *bias, int first) {
    v16f lo[MRW];
    v8f hi[MRW];
#pragma GCC unroll 8
    for (int i = 0; i < MRW; i++) lo[i] = (v16f){0}, hi[i] = (v8f){0};
    for (int k = 0; k < kc; k++) {
        const float *w = panel + (int64_t)k * NR;
        const v16f wl = *(const v16f *)w;
        const v8f wh = load8(w + 16);
#pragma GCC unroll 8
        for (int i = 0; i < MRW; i++) {
            if (i < rows) { /* one broadcast for both: fused multiply-adds, as the contracted c += a * b are */
                const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
                lo[i] = (v16f)_mm512_fmadd_ps(a, (__m512)wl, (__m512)lo[i]);
                hi[i] = (v8f)_mm256_fmadd_ps(_mm512_castps512_ps256(a), (__m256)wh, (__m256)hi[i]);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MRW; i++) {
        if (i >= rows) break;
        float *yi = y + i * ldy;
        if (cols == NR && !bias) {
            *(v16f *)yi = first ? lo[i] : *(const v16f *)yi + lo[i];
            store8(yi + 16, first ? hi[i] : load8(yi + 16) + hi[i]);
        } else {
            for (int j = 0; j < cols; j++)
                yi[j] = (first ? 0.0f : yi[j]) + (j < 16 ? lo[i][j] : hi[i][j - 16]) + (bias ? bias[j] : 0.0f);
        }
    }
}

/* micro_kernel_f32w over two whole panels side by side (48 columns: panel s0's 24, then s1's), 8 rows: three 16-lane
 * vectors a row, the middle one s0's last 8 columns and s1's first 8. Each output is the same FMA chain over k in
 * order, so the bits are micro_kernel_f32w's. Why: a 24-column panel is one 16-lane and one 8-lane FMA a row and
 * k, so at most 3/4 of the FMA units' lanes did work; here every FMA is 16 lanes wide (24 accumulators + 3 weight
 * vectors + a broadcast: 28 of 32 registers). */
#define MRW2 8
static inline __attribute__((always_inline)) void micro_kernel_f32w2(int rows, const float *x, int64_t ldx,
                                                                     const float *s0, const float *s1, int kc,
                                                                     float *y, int64_t ldy, const float *bias,
                                                                     int first) {
    v16f acc[3][MRW2];
#pragma GCC unroll 8
    for (int i = 0; i < MRW2; i++) acc[0][i] = acc[1][i] = acc[2][i] = (v16f){0};
    for (int k = 0; k < kc; k++) {
        const v16f w0 = *(const v16f *)(s0 + (int64_t)k * NR), w2 = *(const v16f *)(s1 + (int64_t)k * NR + 8);
        const __m512d joined = _mm512_insertf64x4(_mm512_castpd256_pd512((__m256d)load8(s0 + (int64_t)k * NR + 16)),
                                                  (__m256d)load8(s1 + (int64_t)k * NR), 1);
        const v16f w1 = (v16f)joined;
#pragma GCC unroll 8
        for (int i = 0; i < MRW2; i++) {
            if (i < rows) {
                const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
                acc[0][i] = (v16f)_mm512_fmadd_ps(a, (__m512)w0, (__m512)acc[0][i]);
                acc[1][i] = (v16f)_mm512_fmadd_ps(a, (__m512)w1, (__m512)acc[1][i]);
                acc[2][i] = (v16f)_mm512_fmadd_ps(a, (__m512)w2, (__m512)acc[2][i]);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MRW2; i++) {
        if (i >= rows) break;
        float *yi = y + i * ldy;
        for (int v = 0; v < 3; v++) {
            if (!bias) { /* as micro_kernel_f32w stores a whole panel */
                *(v16f *)(yi + 16 * v) = first ? acc[v][i] : *(const v16f *)(yi + 16 * v) + acc[v][i];
            } else {
                for (int j = 0; j < 16; j++)
                    yi[16 * v + j] = (first ? 0.0f : yi[16 * v + j]) + acc[v][i][j] + bias[16 * v + j];
            }
        }
    }
}

/* Rows m0..m1 of a product (x, ldx, y, ldy in scope) in blocks of 8, each block one call KERNEL(r, xm, ym) with its
 * row count r a constant, so each count compiles to its own unrolled kernel. */
#define EIGHT_ROW_BLOCKS(KERNEL)                                                                                      \
    for (int m = m0; m < m1; m += 8) {                                                                                \
        const float *xm = x + m * ldx;                                                                                \
        float *ym = y + m * ldy;                                                                                      \
        switch (m1 - m < 8 ? m1 - m : 8) {                                                                            \
        case 1: KERNEL(1, xm, ym); break;                                                                             \
        case 2: KERNEL(2, xm, ym); break;                                                                             \
        case 3: KERNEL(3, xm, ym); break;                                                                             \
        case 4: KERNEL(4, xm, ym); break;                                                                             \
        case 5: KERNEL(5, xm, ym); break;                                                                             \
        case 6: KERNEL(6, xm, ym); break;                                                                             \
        case 7: KERNEL(7, xm, ym); break;                                                                             \
        default: KERNEL(8, xm, ym); break;                                                                            \
        }                                                                                                             \
    }
_Static_assert(MRW == 8 && MRW2 == 8, "EIGHT_ROW_BLOCKS runs both wide fp32 micro-kernels");

static __attribute__((noinline)) void panel_rows_f32w2(int m0, int m1, const float *x, int64_t ldx, const float *s0,
                                                       const float *s1, int kc, float *y, int64_t ldy,
                                                       const float *b, int first) {
#define PAIR(r, xm, ym) micro_kernel_f32w2(r, xm, ldx, s0, s1, kc, ym, ldy, b, first)
    EIGHT_ROW_BLOCKS(PAIR)
#undef PAIR
}
#define HP_PANEL_PAIRS 1
#else
#define HP_PANEL_PAIRS 0
#endif

/* panel_rows over an fp32 slice, compiled on its own. NOTE: inlined into the Q4 product's loop beside the Q4
 * micro-kernels, its MR-row kernel spilled an accumulator inside the k loop and ran at half speed. */
static __attribute__((noinline)) void panel_rows_f32(int m0, int m1, const float *x, int64_t ldx, const float *panel,
                                                     int kc, float *y, int64_t ldy, int cols, const float *b,
                                                     int first) {
#if defined(__AVX512F__) && NV == 3
#define SINGLE(r, xm, ym) micro_kernel_f32w(r, xm, ldx, panel, kc, ym, ldy, cols, b, first)
    EIGHT_ROW_BLOCKS(SINGLE)
#undef SINGLE
#else
    panel_rows(m0, m1, x, ldx, panel, kc, y, ldy, cols, b, 0, first, F32_PANELS);
#endif
}

/* Panel p of the product for rows m0..m1: every k block, every block of MRF rows. A compact slice that more than
 * one row block reads is unpacked to fp32 once, so its widening is not repeated for every MRF rows. */
static inline __attribute__((always_inline)) void panel_product(int p, int m0, int m1, const float *x, int64_t ldx,
                                                                const void *packed, const float *bias,
                                                                const float *scales, float *y, int64_t ldy, int N,
                                                                int K, int format) {
    int n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR;
    const int widened = format != F32_PANELS && format != I8_PANELS;
    float unpacked[widened ? KC * NR : 1] __attribute__((aligned(64)));
    for (int k0 = 0; k0 < K; k0 += KC) {
        const void *panel = (const char *)packed + panel_bytes((int64_t)p * K + k0, format);
        int kc = K - k0 < KC ? K - k0 : KC, first = k0 == 0, last = k0 + KC >= K;
        const float *b = bias && last ? bias + n0 : 0, *sc = scales && last ? scales + n0 : 0;
        if (widened && m1 - m0 > MRF) {
            unpack(panel, kc, unpacked, format);
            panel_rows_f32(m0, m1, x + k0, ldx, unpacked, kc, y + n0, ldy, cols, b, first);
        } else if (format == F32_PANELS) {
            panel_rows_f32(m0, m1, x + k0, ldx, (const float *)panel, kc, y + n0, ldy, cols, b, first);
        } else {
            panel_rows(m0, m1, x + k0, ldx, panel, kc, y + n0, ldy, cols, b, sc, first, format);
        }
    }
}

/* Panels p and p + 1, both whole, for rows m0..m1 (more than MRF): panel_product's compute-bound case with both
 * slices in fp32 (unpacked into this thread's buffer where compact) and every FMA 16 lanes wide
 * (micro_kernel_f32w2). */
static inline __attribute__((always_inline)) void panel_pair_product(int p, int m0, int m1, const float *x,
                                                                     int64_t ldx, const void *packed,
                                                                     const float *bias, float *y, int64_t ldy, int K,
                                                                     int format) {
#if HP_PANEL_PAIRS
    static __thread float *unpacked = 0; /* 2 x KC x NR floats (147 KB): a thread's stack may not hold them */
    if (!unpacked && format != F32_PANELS) unpacked = (float *)aligned_alloc(64, sizeof(float) * 2 * KC * NR);
    const int n0 = p * NR;
    for (int k0 = 0; k0 < K; k0 += KC) {
        const void *a = (const char *)packed + panel_bytes((int64_t)p * K + k0, format);
        const void *b = (const char *)packed + panel_bytes((int64_t)(p + 1) * K + k0, format);
        const int kc = K - k0 < KC ? K - k0 : KC, first = k0 == 0, last = k0 + KC >= K;
        if (format != F32_PANELS) {
            unpack(a, kc, unpacked, format);
            unpack(b, kc, unpacked + KC * NR, format);
            a = unpacked, b = unpacked + KC * NR;
        }
        panel_rows_f32w2(m0, m1, x + k0, ldx, (const float *)a, (const float *)b, kc, y + n0, ldy,
                         bias && last ? bias + n0 : 0, first);
    }
#else
    (void)p, (void)m0, (void)m1, (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)K;
    (void)format;
#endif
}

/* Rows per block: a block's k slices (KC fp32 values a row) stay in L2 while the panels pass over them, in a quarter
 * of the core's L2 as the CPU reports it, and at least 256 KB (84 rows: what every machine had before). Why: on a Xeon
 * with 2 MB of L2 a step's products at 103 rows took 12-14% less time in one block than in blocks of 84 (fp32 and Q4
 * panels; at 200 rows 5-9%, python -m loadtest.lab.kernel_ab WORKTREE "WORKTREE -DROW_BLOCK=128"): each block
 * unpacks every compact panel slice again, and a short last block runs fewer rows per slice. */
static int row_block(void) {
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

/* NOTE: a product's parallel loop shares its panels out guided: each thread takes a long run of consecutive panels
 * (the first thread half of them, the next half of the rest, ...), and the runs shrink to one panel at the end, so
 * the threads still even out when another process takes a core. A thread's weights are then long spans that the
 * hardware prefetchers follow. Why: with one panel per task (dynamic, 1) the threads took alternate panels and each
 * one's reads jumped at every panel; with two runs a thread (1-4 rows) the runs were shorter. Guided took 4-9% off
 * a step's Q4 products at 1-110 rows (fp32 activations), 13-19% with int8 activations at 16-64 rows, 1-12% off
 * fp32 panels' (docs/benchmarks.md). */

/* The bodies of the fp32 products from 5 rows on (enum hp_f32_body): each panel on its own (micro_kernel_f32w), or
 * whole panels two at a time (micro_kernel_f32w2), the same bits. Pairs by default where built; the backend times
 * both at start-up and keeps the faster. */
enum hp_f32_body { HP_F32_PANELS = 0, HP_F32_PAIRS = 1 };
static int f32_body = HP_PANEL_PAIRS ? HP_F32_PAIRS : HP_F32_PANELS;
int hp_f32_bodies(void) { return 1 << HP_F32_PANELS | (HP_PANEL_PAIRS ? 1 << HP_F32_PAIRS : 0); }
/* Makes ``body`` the body and returns the one before it, or -1 (nothing changed) where this build lacks it. */
int hp_set_f32_body(int body) {
    if (body < 0 || body > HP_F32_PAIRS || !(hp_f32_bodies() & 1 << body)) return -1;
    const int before = f32_body;
    f32_body = body;
    return before;
}

/* Pairs of whole panels a product's loop takes as one task each (panel_pair_product): all of them where its rows
 * are compute-bound (more than MRF) and the body is pairs, else none. The int8 panels keep their own kernel. */
static inline int panel_pairs(int M, int N, int format) {
    return f32_body == HP_F32_PAIRS && M > MRF && format != I8_PANELS ? N / NR / 2 : 0;
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) . w^T (+ bias), w packed by hp_pack_weight.
 * Threads split the panels. Rows go in blocks that stay in L2; k goes in blocks of KC so the panel slice (KC x NR,
 * at most 72 KB) stays in L2 while every row of the block passes over it. A decode batch thus streams the weights
 * once. Every output is the same sequence of FMAs whatever M and whichever panel holds its column, so a row's result
 * does not depend on the batch, and a subset of columns packed on its own computes bit-identical values.
 * NOTE: NV = 3, MR = 4 measured best on the AMD EPYC development machines (6x16 as fast, 3x32 25% slower). KC = 768
 * keeps the K = 576 products of SmolLM2-135M in one k block (a 55 KB panel slice, read from L2): 5-6% faster than
 * KC = 256 at 16 and 64 rows, the same at 1 and 256 (python -m loadtest.kernel_ab); 160 GFLOP/s on two cores from
 * 64 rows on, ~90% of their FMA peak.
 * NOTE: each weight format has its own parallel loop (LINEAR_LOOP, written once per format), so OpenMP outlines one
 * body per format with the format a constant; a shared body had made it a runtime flag inside the micro-kernel. */
#define LINEAR_LOOP(bias, scales, format)                                                                             \
    const int pairs = panel_pairs(M, N, format), panels = (N + NR - 1) / NR;                                          \
    for (int m0 = 0; m0 < M; m0 += ROW_BLOCK) {                                                                       \
        int m1 = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;                                                             \
        _Pragma("omp parallel for schedule(guided)") for (int t = 0; t < panels - pairs; t++) {                       \
            if (t < pairs)                                                                                            \
                panel_pair_product(2 * t, m0, m1, x, ldx, packed, bias, y, ldy, K, format);                           \
            else                                                                                                      \
                panel_product(t + pairs, m0, m1, x, ldx, packed, bias, scales, y, ldy, N, K, format);                 \
        }                                                                                                             \
    }

void hp_linear(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy, int M,
               int N, int K) {
    LINEAR_LOOP(bias, 0, F32_PANELS)
}

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

/* ---- BF16C: a bfloat16 model's products, computed in bfloat16 ---------------------------------------------------
 * The weights are BF16 panels (two consecutive k of a column per 32-bit lane, the even k in the low half); the
 * activations are rounded to bfloat16 (nearest even) once per call, as pairs of k in 32-bit words the same way. Each
 * output then sums the exact products of the pairs in fp32, per pair the odd k first, as vdpbf16ps does:
 *     c += x[2i+1] w[2i+1];  c += x[2i] w[2i]        (each product of two bfloat16 is exact in fp32)
 * Where the compiler targets avx512_bf16 the micro-kernel is that instruction; elsewhere the same sums are FMAs on the
 * widened values, with the same bits (but for subnormal inputs, which the instruction reads as zero). Why: twice the
 * products per instruction of fp32 FMAs, and half the bytes of fp32 panels, with no per-step widening. The sums run
 * in the same order whatever the number of rows, so a row's result does not depend on its batch. */
#ifdef __AVX512F__
#define MRB 8 /* 8 rows x 3 vectors = 24 accumulators, + 3 weight vectors + 1 broadcast: 28 of 32 registers */
#else
#define MRB 4
#endif

static inline v8f bf16_pair_lo(uint32_t w) { return splat8(((union { uint32_t u; float f; }){w << 16}).f); }
static inline v8f bf16_pair_hi(uint32_t w) { return splat8(((union { uint32_t u; float f; }){w & 0xffff0000u}).f); }

/* The body that computes BF16C products (enum hp_bf16_dot). By default avx512_bf16's dot product where the CPU has
 * it, else the FMAs with its bits; the backend times every body this CPU has (AMX tiles too, amx.c: their own
 * bits) at start-up and keeps the fastest for the process. */
static int bf16_dot = HP_NATIVE_BF16 ? HP_BF16_DPBF16 : HP_BF16_FMA;
int hp_bf16_dots(void) {
    return 1 << HP_BF16_FMA | (HP_NATIVE_BF16 ? 1 << HP_BF16_DPBF16 : 0) |
           (hp_amx_bf16_available() ? 1 << HP_BF16_AMX : 0);
}
/* Makes ``dot`` the body and returns the one before it, or -1 (nothing changed) where this CPU lacks ``dot``. */
int hp_set_bf16_dot(int dot) {
    if (dot < 0 || dot > HP_BF16_AMX || !(hp_bf16_dots() & 1 << dot)) return -1;
    const int before = bf16_dot;
    bf16_dot = dot;
    return before;
}

/* The activations of a BF16C product, rounded to bfloat16 and packed by groups of MRB rows: for group g and pair
 * kp (k = 2 kp, 2 kp + 1), the MRB rows' pairs side by side as 32-bit words, the even k in the low half:
 *     a[(g * K/2 + kp) * MRB + i] = (bf16(x[g MRB + i][2 kp + 1]) << 16) | bf16(x[g MRB + i][2 kp])
 * so a micro-kernel broadcasts each row's pair from one base address. Rows past M are zero. */
static void pack_rows_bf16(const float *x, int64_t ldx, uint32_t *a, int M, int K) {
    const int groups = (M + MRB - 1) / MRB, pairs = K / 2;
#pragma omp parallel for schedule(static) if ((int64_t)M * K >= 65536)
    for (int g = 0; g < groups; g++) {
        uint32_t *ag = a + (int64_t)g * pairs * MRB;
        for (int i = 0; i < MRB; i++) {
            const int m = g * MRB + i;
            if (m >= M) {
                for (int kp = 0; kp < pairs; kp++) ag[(int64_t)kp * MRB + i] = 0;
                continue;
            }
            const float *row = x + m * ldx;
            for (int kp = 0; kp < pairs; kp++) {
                uint32_t lo, hi;
                memcpy(&lo, row + 2 * kp, sizeof lo);
                memcpy(&hi, row + 2 * kp + 1, sizeof hi);
                lo = (lo & 0x7fffffff) > 0x7f800000 ? 0x7fc0 : (lo + 0x7fff + ((lo >> 16) & 1)) >> 16;
                hi = (hi & 0x7fffffff) > 0x7f800000 ? 0x7fc0 : (hi + 0x7fff + ((hi >> 16) & 1)) >> 16;
                ag[(int64_t)kp * MRB + i] = (hi << 16) | lo;
            }
        }
    }
}

/* y[rows, cols] (+)= a[rows, kc] . panel[kc, NR], a one group of packed activations from its first pair of this k
 * block: the same store / add / bias steps as micro_kernel. ``native``: the dot-product instruction, else its FMA
 * twin (a compile-time constant in each instance). */
static inline __attribute__((always_inline)) void micro_kernel_bf16c(int rows, const uint32_t *a, const void *panel,
                                                                     int kc, float *y, int64_t ldy, int cols,
                                                                     const float *bias, int first, int native) {
    v8f c[MRB][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MRB; i++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) c[i][v] = (v8f){0};
    for (int k = 0; k < kc; k += 2) {
        const v8iu *words = (const v8iu *)((const char *)panel + (int64_t)k * NR * 2);
        const uint32_t *ak = a + (int64_t)(k / 2) * MRB;
        v8i w[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) w[v] = words[v];
#if HP_NATIVE_BF16
        if (native) {
#pragma GCC unroll 8
            for (int i = 0; i < MRB; i++) {
                if (i >= rows) break;
                const __m256bh ai = (__m256bh)_mm256_set1_epi32((int)ak[i]);
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) c[i][v] = (v8f)_mm256_dpbf16_ps((__m256)c[i][v], ai, (__m256bh)w[v]);
            }
            continue;
        }
#endif
#pragma GCC unroll 8
        for (int i = 0; i < MRB; i++) {
            if (i >= rows) break;
            const v8f odd = bf16_pair_hi(ak[i]), even = bf16_pair_lo(ak[i]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) {
                c[i][v] += odd * bf16_lane(w[v], 1);
                c[i][v] += even * bf16_lane(w[v], 0);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MRB; i++) {
        if (i >= rows) break;
        store_tile_row(y + i * ldy, c[i], cols, bias, first);
    }
}

/* Rows m0..m1 (m0 a multiple of MRB) of one panel's product for one k block, a group of MRB rows at a time. */
static inline __attribute__((always_inline)) void panel_rows_bf16c(int m0, int m1, const uint32_t *a, int pairs,
                                                                   int kp0, const void *panel, int kc, float *y,
                                                                   int64_t ldy, int cols, const float *b, int first,
                                                                   int native) {
    for (int m = m0; m < m1; m += MRB) {
        const uint32_t *ag = a + ((int64_t)(m / MRB) * pairs + kp0) * MRB;
        float *ym = y + m * ldy;
        switch (m1 - m < MRB ? m1 - m : MRB) {
#define ROWS(r) \
    case r: micro_kernel_bf16c(r, ag, panel, kc, ym, ldy, cols, b, first, native); break;
            ROWS(1) ROWS(2) ROWS(3)
#if MRB > 4
            ROWS(4) ROWS(5) ROWS(6) ROWS(7)
#endif
#undef ROWS
        default: micro_kernel_bf16c(MRB, ag, panel, kc, ym, ldy, cols, b, first, native); break;
        }
    }
}

/* Panel p of a BF16C product for rows m0..m1, every k block; ``native`` constant per instance. */
static inline __attribute__((always_inline)) void panel_product_bf16c(int p, int m0, int m1, const uint32_t *a,
                                                                      const void *packed, const float *bias, float *y,
                                                                      int64_t ldy, int N, int K, int native) {
    int n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR;
    for (int k0 = 0; k0 < K; k0 += KC) {
        const void *panel = (const char *)packed + panel_bytes((int64_t)p * K + k0, BF16_PANELS);
        int kc = K - k0 < KC ? K - k0 : KC, last = k0 + KC >= K;
        panel_rows_bf16c(m0, m1, a, K / 2, k0 / 2, panel, kc, y + n0, ldy, cols, bias && last ? bias + n0 : 0,
                         k0 == 0, native);
    }
}

static __attribute__((noinline)) void panel_product_bf16c_native(int p, int m0, int m1, const uint32_t *a,
                                                                 const void *packed, const float *bias, float *y,
                                                                 int64_t ldy, int N, int K) {
    panel_product_bf16c(p, m0, m1, a, packed, bias, y, ldy, N, K, 1);
}

static __attribute__((noinline)) void panel_product_bf16c_fma(int p, int m0, int m1, const uint32_t *a,
                                                              const void *packed, const float *bias, float *y,
                                                              int64_t ldy, int N, int K) {
    panel_product_bf16c(p, m0, m1, a, packed, bias, y, ldy, N, K, 0);
}

/* hp_linear_packed for BF16C panels (K even). The packed activations live in a buffer of the calling thread, grown
 * as needed and kept: a decode step calls this ~4 times a layer. Row blocks (multiples of MRB) stay in L2. */
static void linear_bf16c(const float *x, int64_t ldx, const void *packed, const float *bias, float *y, int64_t ldy,
                         int M, int N, int K) {
    if (bf16_dot == HP_BF16_AMX && hp_linear_bf16c_amx(x, ldx, packed, NR, 0, bias, y, ldy, M, N, K) == 0) return;
    static __thread uint32_t *buffer = 0;
    static __thread int64_t buffer_size = 0;
    const int64_t need = (int64_t)((M + MRB - 1) / MRB) * MRB * (K / 2);
    if (need > buffer_size) {
        free(buffer);
        buffer_size = need;
        buffer = (uint32_t *)malloc(sizeof(uint32_t) * buffer_size);
    }
    uint32_t *a = buffer; /* NOTE: a local: inside the parallel loops, the threads would each see their own buffer */
    pack_rows_bf16(x, ldx, a, M, K);
    const int block = ROW_BLOCK / MRB * MRB;
    for (int m0 = 0; m0 < M; m0 += block) {
        int m1 = m0 + block < M ? m0 + block : M;
        if (bf16_dot != HP_BF16_FMA) {
#pragma omp parallel for schedule(guided)
            for (int p = 0; p < (N + NR - 1) / NR; p++) panel_product_bf16c_native(p, m0, m1, a, packed, bias, y, ldy, N, K);
        } else {
#pragma omp parallel for schedule(guided)
            for (int p = 0; p < (N + NR - 1) / NR; p++) panel_product_bf16c_fma(p, m0, m1, a, packed, bias, y, ldy, N, K);
        }
    }
}

/* hp_linear for the same weights packed in any format of enum hp_weight_format but HP_I8, with the same bits:
 *   Q4 panels (kernels/cpu/blocks.py; K % Q4_GROUP == 0): 0.75 bytes a weight instead of 4;
 *   Q8 panels (kernels/cpu/blocks.py; K % Q8_GROUP == 0): 1.125 bytes a weight;
 *   Q5 and Q6M panels (kernels/cpu/blocks.py; K % Q8_GROUP == 0): 1.25 and 1.5 bytes a weight;
 *   Q4K, Q5K and Q6K panels (GGUF's K-quant scales as they are; K % 256 == 0): 0.5625, 1.06 and 0.83;
 *   BF16 panels (every weight's low 16 bits zero; K % 2 == 0): half the bytes.
 * One or a few rows dequantize in registers, so a decode step at a small batch streams only the compact bytes from
 * memory; more rows share one fp32 copy of each panel slice. */
static void linear_q8x(int format, const float *x, int64_t ldx, const void *packed, const float *bias, float *y,
                       int64_t ldy, int M, int N, int K);

void hp_linear_packed(int format, const float *x, int64_t ldx, const void *packed, const float *bias, float *y,
                      int64_t ldy, int M, int N, int K) {
    if (format & HP_Q8X) { /* int8 activations where asked, the format a block format and the CPU able */
        format &= ~HP_Q8X;
        if (hp_q8x_available() && format != HP_F32 && format != HP_I8 && format != HP_BF16 && format != HP_BF16C) {
            linear_q8x(format, x, ldx, packed, bias, y, ldy, M, N, K);
            return;
        }
    }
    if (format == HP_Q4) {
        LINEAR_LOOP(bias, 0, Q4_PANELS)
    } else if (format == HP_Q8) {
        LINEAR_LOOP(bias, 0, Q8_PANELS)
    } else if (format == HP_Q5) {
        LINEAR_LOOP(bias, 0, Q5_PANELS)
    } else if (format == HP_Q6M) {
        LINEAR_LOOP(bias, 0, Q6M_PANELS)
    } else if (format == HP_Q4K) {
        LINEAR_LOOP(bias, 0, Q4K_PANELS)
    } else if (format == HP_Q5K) {
        LINEAR_LOOP(bias, 0, Q5K_PANELS)
    } else if (format == HP_Q6K) {
        LINEAR_LOOP(bias, 0, Q6K_PANELS)
    } else if (format == HP_BF16) {
        LINEAR_LOOP(bias, 0, BF16_PANELS)
    } else if (format == HP_BF16C) {
        linear_bf16c(x, ldx, packed, bias, y, ldy, M, N, K);
    } else if (hp_split_format(format) || format == HP_BF16A || format == HP_Q4A || format == HP_Q6A ||
               format == HP_Q8A) {
        /* packed only where AMX runs (kernels/cpu/__init__.py): NaN, never garbage */
        const int failed = hp_split_format(format)
                               ? hp_linear_split_amx(format, x, ldx, packed, bias, y, ldy, M, N, K)
                               : hp_linear_bf16c_amx(x, ldx, packed, HP_BF16A_WIDTH, format == HP_BF16A ? 0 : format,
                                                     bias, y, ldy, M, N, K);
        if (failed)
            for (int m = 0; m < M; m++)
                for (int n = 0; n < N; n++) y[m * ldy + n] = NAN;
    } else {
        hp_linear(x, ldx, packed, bias, y, ldy, M, N, K);
    }
}

/* ids [M] = each row's argmax (torch's: the first of equal maxima, a NaN the largest) over the N columns of
 * hp_linear_packed(format, x, packed) without bias, from the same products, where AMX computes them (amx.c); else -1
 * and nothing written. */
int hp_argmax_packed(int format, const float *x, int64_t ldx, const void *packed, int M, int N, int K, int64_t *ids) {
    if (format == HP_BF16C && bf16_dot == HP_BF16_AMX) return hp_argmax_bf16c_amx(x, ldx, packed, NR, 0, M, N, K, ids);
    if (format == HP_BF16A || format == HP_Q4A || format == HP_Q6A || format == HP_Q8A)
        return hp_argmax_bf16c_amx(x, ldx, packed, HP_BF16A_WIDTH, format == HP_BF16A ? 0 : format, M, N, K, ids);
    return -1;
}

/* ---- Q8X: block panels times activations rounded to int8, as llama.cpp multiplies a GGUF file ------------------
 * Opt-in (HP_Q8X on the format; EngineConfig.quantized_matmul = "int8"). Each call rounds its rows to int8 per 32 k
 * (d = max |x| / 127, q = round(x / d)) and multiplies each 32 k of a block panel as integers: vpdpbusd sums four
 * u8 x s8 products a 32-bit lane. Nibble weights (Q4, Q4K) are unsigned as they are; byte weights are signed, made
 * unsigned by q ^ 0x80 (q + 128), and 128 Σ qx is taken back off. Without VNNI (AVX2 only), or where it measured
 * slower, AVX2's maddubs takes signed bytes (Q8) with two sign instructions (dot_s8s8, offset 0) and unsigned
 * weights as they are (pairs_u8s8: nibbles, Q6K's q + 32, Q5's and Q5K's q in 0..31); a nibble block's pair sums
 * stay 16-bit until its fix-up. NOTE: that took 15% off a Llama-3.2-1B Q4_K_M's decode step of one sequence and
 * 28% off one of sixteen (AMD EPYC, AVX2; signed pairs for every weight before; python -m loadtest.lab.step_profile);
 * Q5K's products of a 1B step 4% at one row and 15-18% at sixteen (python -m loadtest.lab.kernel_ab --format q5_k).
 * Per 16 k (the finest scales, Q6K's and Q6M's):
 *     c += d_w d_x (Σ u qx - offset Σ qx) + m_w d_x Σ qx
 * Not exact: the activations' rounding (at most half a step of max |x| / 127 per value of each 32) shows in the
 * products, as it does in llama.cpp's. Why: a small batch over dequantized-in-register weights is compute-bound
 * (~6 vector ops per 8 weights); here it is ~1.5 per 32. */

/* One row's activations for Q8X: per 32 k, 8 words of four int8 each (nibble formats: word 2j the even k of k
 * 8j..8j+7, word 2j + 1 the odd, matching a nibble word's low and high nibbles; byte formats: k in order), its d,
 * and the sums of q over each 16 k. */
struct q8x_row {
    const int32_t *words;
    const float *d;
    const int32_t *sums;
};

/* One 32-k group of a row rounded to int8: its d, the sums of q over k 0..15 and 16..31, and its bytes in the
 * layout of q8x_row. */
static inline void quantize_group_q8x(const float *xb, int nibbles, int8_t *out, float *d, int32_t *sums) {
#ifdef __AVX2__
    /* The scalar loop's bits: a max is exact, and cvtps rounds to nearest even as lrintf does. Why: the scalar
     * loop (a libm call per fmaxf and lrintf) was 19% of a 64-client step of SmolLM2-135M with int8 products. */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        x[j] = _mm256_loadu_ps(xb + 8 * j);
        amax = _mm256_max_ps(_mm256_andnot_ps(sign, x[j]), amax); /* a NaN is skipped, as fmaxf skips it */
    }
    amax = _mm256_max_ps(amax, _mm256_permute2f128_ps(amax, amax, 1));
    amax = _mm256_max_ps(amax, _mm256_shuffle_ps(amax, amax, 0x4e));
    amax = _mm256_max_ps(amax, _mm256_shuffle_ps(amax, amax, 0xb1));
    const float db = _mm256_cvtss_f32(amax) / 127.0f, inv = db > 0.0f ? 1.0f / db : 0.0f;
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    /* nibble layout: word 2 j holds the even k of 8 j .. 8 j + 7, word 2 j + 1 the odd */
    const __m256i order = nibbles ? _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)
                                  : _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i q[4];
    for (int j = 0; j < 4; j++) {
        q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(x[j], _mm256_set1_ps(inv)));
        q[j] = _mm256_min_epi32(_mm256_max_epi32(q[j], lo), hi);
    }
    /* the sums over k 0..15 and 16..31: pairs, then fours, then the two 128-bit halves */
    __m256i s = _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    s = _mm256_hadd_epi32(s, s);
    const __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    _mm_storel_epi64((__m128i *)sums, s2);
    for (int j = 0; j < 4; j++) q[j] = _mm256_permutevar8x32_epi32(q[j], order);
    /* packs interleave 128-bit lanes: 32-bit word i of the bytes is (vector i % 4, half i / 4); put them in order */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)out,
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *d = db;
#else
    float amax = 0.0f;
    for (int k = 0; k < Q8_GROUP; k++) amax = fmaxf(amax, fabsf(xb[k]));
    const float db = amax / 127.0f, inv = db > 0.0f ? 1.0f / db : 0.0f;
    int32_t s0 = 0, s1 = 0;
    for (int k = 0; k < Q8_GROUP; k++) {
        long r = lrintf(xb[k] * inv);
        int8_t q = (int8_t)(r > 127 ? 127 : r < -127 ? -127 : r);
        if (k < Q8_GROUP / 2) s0 += q; else s1 += q;
        out[nibbles ? (k / 8 * 2 + k % 2) * 4 + k % 8 / 2 : k] = q; /* nibble order: k = 8 j + 2 i + o: word 2 j + o */
    }
    *d = db;
    sums[0] = s0, sums[1] = s1;
#endif
}

static void quantize_rows_q8x(const float *x, int64_t ldx, int M, int K, int nibbles, int32_t *words, float *d,
                              int32_t *sums) {
    const int blocks = K / Q8_GROUP;
#pragma omp parallel for schedule(static) if ((int64_t)M * K >= 65536)
    for (int m = 0; m < M; m++)
        for (int b = 0; b < blocks; b++) {
            const int64_t i = (int64_t)m * blocks + b;
            quantize_group_q8x(x + m * ldx + b * Q8_GROUP, nibbles, (int8_t *)(words + i * 8), d + i, sums + 2 * i);
        }
}

/* err[m] >= ||x_m - x^_m||, where x^_m is row m as the Q8X products round it (d q per 32 k): the very rounding of
 * quantize_group_q8x, the squares summed in double and the root rounded up by a relative 2^-20. For a screen that
 * must bound how far an int8-activation product lies from the exact one (engine/backends/greedy_head.py). */
void hp_q8x_rounding_error(const float *x, int64_t ldx, int M, int K, double *err) {
    for (int m = 0; m < M; m++) {
        double sq = 0.0;
        for (int b = 0; b < K / Q8_GROUP; b++) {
            const float *xb = x + m * ldx + b * Q8_GROUP;
            int8_t q[Q8_GROUP];
            float d;
            int32_t sums[2];
            quantize_group_q8x(xb, 0, q, &d, sums);
            for (int k = 0; k < Q8_GROUP; k++) {
                const double e = (double)xb[k] - (double)d * q[k];
                sq += e * e;
            }
        }
        err[m] = sqrt(sq) * (1.0 + 0x1p-20);
    }
}

/* The NV weight vectors that meet activation word 4 h + t of a 32-k block: nibble word 2 h + t / 2's low nibbles
 * (even k) or high (odd k), with Q6K's high bits from bits 2 (2 (t / 2) + t % 2); or bytes, made unsigned where
 * offset_bits says so. */
static inline __attribute__((always_inline)) void q8x_weights(const v8iu *words, int h, int t, int format,
                                                              v8i offset_bits, v8i u[NV]) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        if (block_nibbles(format)) {
            v8i w = words[(2 * h + t / 2) * NV + v];
            u[v] = (t % 2 ? w >> 4 : w) & splat8i(0x0f0f0f0f);
            /* bits 2t, 2t + 1 of each byte of the high word to bits 4-5: one shift (none at t = 2) and one mask.
             * NOTE: a shift down, a mask and a shift up had made Q6K's int8 products 6-10% slower (AVX2, 1-16
             * rows of a Llama-3.2-1B step, python -m loadtest.lab.kernel_ab --format q6_k). */
            if (format == Q6K_PANELS) {
                const v8i hi = words[(Q6_HIGH + h) * NV + v];
                u[v] |= (t == 0 ? hi << 4 : t == 1 ? hi << 2 : t == 2 ? hi : hi >> 2) & splat8i(0x30303030);
            }
        } else {
            u[v] = words[(4 * h + t) * NV + v] ^ offset_bits;
        }
    }
}

/* Whether a block format's weight scales are per 16 k (Q6K, Q6M), so its integer sums are folded per half block. */
static inline int q8x_halves(int format) { return format == Q6K_PANELS || format == Q6M_PANELS; }

/* One row's integer sums of a run of k with one weight scale (half h of block b), folded into its float sums c:
 *     c += d_w (d_x (Σ u qx - offset Σ qx)) (+ m_w d_x Σ qx)
 * Every body does exactly this, so a row's outputs do not depend on the body its batch took. */
static inline __attribute__((always_inline)) void q8x_fix_up(v8f c[NV], const v8i acc[NV], const struct q8x_row *a,
                                                             int b, int h, const v8f d[NV], const v8f m[NV],
                                                             float offset, int format) {
    const int halves = q8x_halves(format);
    const int32_t *sums = a->sums + 2 * b;
    const float sum = (float)(halves ? sums[h] : sums[0] + sums[1]);
    const v8f dx = splat8(a->d[b]), dsum = splat8(a->d[b] * sum);
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        v8f dot = __builtin_convertvector(acc[v], v8f);
        if (offset != 0.0f) dot -= splat8(offset) * sum; /* exact: |.| < 2^24; none for nibbles (x - 0 = x) */
        c[v] += d[v] * (dot * dx);
        /* Q6K's m is the -32 d of its offset, taken off in the integers instead */
        if (format != Q6K_PANELS && block_with_m(format)) c[v] += m[v] * dsum;
    }
}

/* The integer sums of ``rows`` rows (at most R) of one panel slice (kc x NR) from block b0 on, each run of k with one
 * weight scale (16 k for Q6K and Q6M, else 32) summed in integers, then handed to fix_up(i, h, d, m, acc[i]).
 * ``format``, ``dot`` and ``early`` constant per instance. ``early``: read the block's scales before its sums (one
 * row: registers to spare), else after them. */
#define Q8X_SUMS(R, rows, a, b0, panel, kc, format, dot, early, fix_up)                                               \
    do {                                                                                                              \
        const int unsigned_bytes_ = !block_nibbles(format) && (dot) == Q8X_VNNI;                                      \
        const v8i offset_bits_ = splat8i(unsigned_bytes_ ? (int)0x80808080 : 0);                                      \
        const int halves_ = q8x_halves(format);                                                                       \
        /* maddubs on nibbles: a 32-k block's 8 words summed in 16 bits (8 x 2 x 15 x 127 = 30480), widened once */   \
        const int sums16_ = (dot) == Q8X_MADDUBS && ((format) == Q4_PANELS || (format) == Q4K_PANELS);                \
        /* Q6K's q + 32, Q5's and Q5K's q (0..31): unsigned bytes, their pairs widened each word */                  \
        const int unsigned_ = (dot) == Q8X_MADDUBS                                                                    \
            && ((format) == Q6K_PANELS || (format) == Q5_PANELS || (format) == Q5K_PANELS);                           \
        for (int k = 0; k < (kc); k += Q8_GROUP) {                                                                    \
            const int b = (b0) + k / Q8_GROUP;                                                                        \
            v8f d[2][NV], m[2][NV];                                                                                   \
            const v8iu *words = block_at(panel, k, format, 0, &d[0][0], &d[1][0], &m[0][0], &m[1][0]);              \
            if (early)                                                                                                \
                _Pragma("GCC unroll 4") for (int v = 1; v < NV; v++)                                                  \
                    block_at(panel, k, format, v, &d[0][v], &d[1][v], &m[0][v], &m[1][v]);                            \
            v8i acc[R][NV];                                                                                           \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                                                     \
                if (h == 0 || halves_)                                                                                \
                    _Pragma("GCC unroll 8") for (int i = 0; i < (R); i++)                                             \
                        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[i][v] = (v8i){0};                    \
                _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) { /* activation word 4 h + t */                   \
                    v8i u[NV];                                                                                        \
                    q8x_weights(words, h, t, format, offset_bits_, u);                                                \
                    _Pragma("GCC unroll 8") for (int i = 0; i < (R); i++) {                                           \
                        if (i >= (rows)) break;                                                                       \
                        const v8i xq = splat8i((a)[i].words[(int64_t)b * 8 + 4 * h + t]);                             \
                        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[i][v] =                              \
                            (dot) == Q8X_VNNI ? dot_u8s8(acc[i][v], u[v], xq)                                         \
                            : sums16_         ? add16(acc[i][v], pairs_u8s8(u[v], xq))                                \
                            : unsigned_       ? acc[i][v] + widen16(pairs_u8s8(u[v], xq))                             \
                                              : dot_s8s8(acc[i][v], u[v], xq);                                        \
                    }                                                                                                 \
                }                                                                                                     \
                if (h == 0 && !halves_) continue;                                                                     \
                if (!(early))                                                                                         \
                    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)                                              \
                        block_at(panel, k, format, v, &d[0][v], &d[1][v], &m[0][v], &m[1][v]);                        \
                _Pragma("GCC unroll 8") for (int i = 0; i < (R); i++) {                                               \
                    if (i >= (rows)) break;                                                                           \
                    if (sums16_) _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[i][v] = widen16(acc[i][v]); \
                    fix_up(i, h, d[h], m[h], acc[i]);                                                                 \
                }                                                                                                     \
            }                                                                                                         \
        }                                                                                                             \
    } while (0)

/* The offset the integer sums carry: Q6K's weights hold q + 32; bytes made unsigned, q + 128. */
static inline float q8x_offset(int format, int dot) {
    return format == Q6K_PANELS ? 32.0f : !block_nibbles(format) && dot == Q8X_VNNI ? 128.0f : 0.0f;
}

/* y[rows, cols] (+)= the rows' int8 activations . one panel slice (kc x NR) from block b0 on: the store / add / bias
 * steps of micro_kernel. Its float sums stay in registers. ``early`` as Q8X_SUMS's. */
static inline __attribute__((always_inline)) void micro_kernel_q8x(int rows, const struct q8x_row *a, int b0,
                                                                   const void *panel, int kc, float *y, int64_t ldy,
                                                                   int cols, const float *bias, int first,
                                                                   int format, int dot, int early) {
    const float offset = q8x_offset(format, dot);
    v8f c[MR][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) c[i][v] = (v8f){0};
#define FIX_UP(i, h, d, m, acc) q8x_fix_up(c[i], acc, a + (i), b, h, d, m, offset, format)
    Q8X_SUMS(MR, rows, a, b0, panel, kc, format, dot, early, FIX_UP);
#undef FIX_UP
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        if (i >= rows) break;
        store_tile_row(y + i * ldy, c[i], cols, bias, first);
    }
}

#ifdef __AVX512F__
/* Rows of the wide Q8X body: its integer sums (MRQ x NV) take 24 of the 32 vector registers, so its float sums live
 * in a tile in L1 instead, loaded and stored once a weight scale. Where there are 16 registers it is not compiled. */
#define MRQ 8
/* micro_kernel_q8x for MRQ rows and a whole panel (cols == NR). Why: at 64 rows the 4-row body kept its 24 sums in
 * 32 registers with its scales, its spills were a third of its loads, and its products ran at ~30% of the dot
 * product's rate. */
static inline __attribute__((always_inline)) void micro_kernel_q8x_wide(const struct q8x_row *a, int b0,
                                                                        const void *panel, int kc, float *y,
                                                                        int64_t ldy, const float *bias, int first,
                                                                        int format, int dot) {
    const float offset = q8x_offset(format, dot);
    float tile[MRQ][NR] __attribute__((aligned(32)));
#pragma GCC unroll 8
    for (int i = 0; i < MRQ; i++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) store8(tile[i] + 8 * v, (v8f){0});
#define FIX_UP(i, h, d, m, acc)                                                                                       \
    do {                                                                                                              \
        v8f c[NV];                                                                                                    \
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) c[v] = load8(tile[i] + 8 * v);                           \
        q8x_fix_up(c, acc, a + (i), b, h, d, m, offset, format);                                                      \
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) store8(tile[i] + 8 * v, c[v]);                           \
    } while (0)
    Q8X_SUMS(MRQ, MRQ, a, b0, panel, kc, format, dot, 0, FIX_UP);
#undef FIX_UP
#pragma GCC unroll 8
    for (int i = 0; i < MRQ; i++) {
        v8f c[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) c[v] = load8(tile[i] + 8 * v);
        store_tile_row(y + i * ldy, c, NR, bias, first);
    }
}
#endif

/* Panel p of a Q8X product for rows m0..m1, every k block, MR rows at a time; ``format`` constant per instance. */
static inline __attribute__((always_inline)) void panel_product_q8x(int p, int m0, int m1, const struct q8x_row *rows,
                                                                    const void *packed, const float *bias, float *y,
                                                                    int64_t ldy, int N, int K, int format,
                                                                    int dot) {
    const int n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR;
    for (int k0 = 0; k0 < K; k0 += KC) {
        const void *panel = (const char *)packed + panel_bytes((int64_t)p * K + k0, format);
        const int kc = K - k0 < KC ? K - k0 : KC, last = k0 + KC >= K;
        const float *b = bias && last ? bias + n0 : 0;
        /* NOTE: one body per format and dot product, the row count a runtime bound, and one more for a single row
         * (a one-stream decode): there the general body keeps MR rows' sums in registers it cannot have, and with
         * the sums of a whole 32 k live its spills made a 1-row Q4_K product 1.6x slower. Not for Q6M, whose 1-row
         * product that body made ~1.5x slower (four scale vectors a block). A body per row count (28 in all) had
         * added 5 s to every build of the library for no measurable speed. */
        if (m1 - m0 == 1 && format != Q6M_PANELS)
            micro_kernel_q8x(1, rows + m0, k0 / Q8_GROUP, panel, kc, y + m0 * ldy + n0, ldy, cols, b, k0 == 0,
                             format, dot, 1);
        else {
            int m = m0;
#ifdef MRQ
            if (cols == NR)
                for (; m + MRQ <= m1; m += MRQ)
                    micro_kernel_q8x_wide(rows + m, k0 / Q8_GROUP, panel, kc, y + m * ldy + n0, ldy, b, k0 == 0,
                                          format, dot);
#endif
            for (; m < m1; m += MR)
                micro_kernel_q8x(m1 - m < MR ? m1 - m : MR, rows + m, k0 / Q8_GROUP, panel, kc, y + m * ldy + n0,
                                 ldy, cols, b, k0 == 0, format, dot, 0);
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__linux__) && NV == 3
#define HP_Q8X_AMX 1
/* Q8X products on AMX tiles: per 32 k (16 for Q6K and Q6M, whose scales are per 16) of a panel, one tile op sums
 * 16 rows' int8 activations times the panel's 24 columns of weights as integers (TDPBSUD for nibbles, which are
 * unsigned, Q6K's q + 32 among them; TDPBSSD for signed bytes, with no offset to take back off), and the vector
 * units fold each sum into the float sums with q8x_fix_up's operations (q8x_fix_up_row). An integer sum is exact in
 * any order, and each float sum takes the same fix-ups in the same order, the same KC slices, as Q8X_SUMS gives it,
 * so a row's outputs are those of the VNNI body to the bit, whichever rows share its batch. Why: vpdpbusd sums 32
 * products an instruction, a tile op 8192. Tiles as amx.c configures them: 0-1 and 2-3 a row group's sums (columns
 * 0-15, 16-23) for alternate blocks, 4 and 5 its activations, 6 and 7 the weights. */
#define Q8X_TILE_ROW (NR * 4)                   /* bytes of a row of weights as the tiles take them: k / 4 */
#define Q8X_TILE_BLOCK (Q8_GROUP / 4 * Q8X_TILE_ROW) /* a 32-k block of them */

/* A block's scales (block_at's d and m of both halves, for the NV vectors of columns: 24 floats in a row). */
struct q8x_scales {
    v8f d[2][NV], m[2][NV];
};

/* One row's tile sums s (24 columns) of a run of k with one weight scale folded into its float sums c: q8x_fix_up's
 * operations, lane by lane the same (so the same bits), 16 columns a register and the last 8 in a half. */
static inline __attribute__((always_inline)) void q8x_fix_up_row(float *c, const int32_t *s, const struct q8x_row *a,
                                                                 int b, int h, const struct q8x_scales *sc, int fold,
                                                                 float offset, int format) {
    const int32_t *sums = a->sums + 2 * b;
    const float sum = (float)(q8x_halves(format) ? sums[h] : sums[0] + sums[1]), dx = a->d[b], dsum = dx * sum;
    const int with_m = format != Q6K_PANELS && block_with_m(format); /* Q6K's m is taken off in the integers */
    const float *d = (const float *)sc->d[fold], *m = (const float *)sc->m[fold];
    __m512 lo = _mm512_cvtepi32_ps(_mm512_load_si512(s));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)(s + 16)));
    if (offset != 0.0f) {
        lo = _mm512_sub_ps(lo, _mm512_set1_ps(offset * sum));
        hi = _mm256_sub_ps(hi, _mm256_set1_ps(offset * sum));
    }
    __m512 clo = _mm512_fmadd_ps(_mm512_loadu_ps(d), _mm512_mul_ps(lo, _mm512_set1_ps(dx)), _mm512_load_ps(c));
    __m256 chi = _mm256_fmadd_ps(_mm256_loadu_ps(d + 16), _mm256_mul_ps(hi, _mm256_set1_ps(dx)),
                                 _mm256_load_ps(c + 16));
    if (with_m) {
        clo = _mm512_fmadd_ps(_mm512_loadu_ps(m), _mm512_set1_ps(dsum), clo);
        chi = _mm256_fmadd_ps(_mm256_loadu_ps(m + 16), _mm256_set1_ps(dsum), chi);
    }
    _mm512_store_ps(c, clo);
    _mm256_store_ps(c + 16, chi);
}

/* The KC slice of panel p from block b0 on (kc k), every row: its weights widened once into the tiles' layout (row
 * 4 h + t: the NV vectors q8x_weights gives for activation word 4 h + t, raw bytes for byte formats) and its scales
 * read, then each row group's sums, fix-ups and stores. ``format`` constant per instance. */
static inline __attribute__((always_inline)) void q8x_amx_slice(const struct q8x_row *rows, int M, int K, int b0,
                                                                const void *panel, int kc, float *y, int64_t ldy,
                                                                int cols, const float *bias, int first, int format) {
    int8_t weights[KC / Q8_GROUP * Q8X_TILE_BLOCK] __attribute__((aligned(64)));
    struct q8x_scales scales[KC / Q8_GROUP];
    int32_t sums[2 * 16 * 32] __attribute__((aligned(64))); /* two jobs' tile sums, rows 32 apart */
    float c[16 * 32] __attribute__((aligned(64)));      /* its float sums, the same layout */
    const int blocks = kc / Q8_GROUP, halves = q8x_halves(format), step = halves ? 16 : Q8_GROUP;
    const int64_t lda = K; /* a row's int8 words, K bytes, the next row's after them (linear_q8x) */
    const float offset = format == Q6K_PANELS ? 32.0f : 0.0f;
    for (int i = 0; i < blocks; i++) {
        struct q8x_scales *sc = scales + i;
        const v8iu *words = 0;
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            words = block_at(panel, i * Q8_GROUP, format, v, &sc->d[0][v], &sc->d[1][v], &sc->m[0][v], &sc->m[1][v]);
        for (int j = 0; j < 8; j++) {
            v8i u[NV];
            q8x_weights(words, j / 4, j % 4, format, splat8i(0), u);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) memcpy(weights + i * Q8X_TILE_BLOCK + j * Q8X_TILE_ROW + 32 * v, &u[v], 32);
        }
    }
    const int jobs = blocks * (1 + halves); /* job j: half j % 2 of block j / 2 (halves), or block j */
    for (int g = 0; g < M; g += 16) {
        const int group = M - g < 16 ? M - g : 16;
        memset(c, 0, sizeof c);
        /* Job j's tile ops go to accumulator set j % 2 (tiles 0-1 or 2-3); its sums are stored once job j + 1's ops
         * are issued, and folded in one job later still, so the vector units' fix-ups overlap the tiles' work and
         * no load waits on the tile store it reads (as amx.c's split products do). */
#define Q8X_JOB_OPS(ACC0, ACC1, A, j)                                                                                 \
    do {                                                                                                              \
        const int i_ = halves ? (j) / 2 : (j), h_ = halves ? (j) % 2 : 0;                                            \
        const int8_t *w_ = weights + i_ * Q8X_TILE_BLOCK + h_ * (step / 4) * Q8X_TILE_ROW;                          \
        _tile_zero(ACC0);                                                                                             \
        _tile_zero(ACC1);                                                                                             \
        _tile_loadd(6, w_, Q8X_TILE_ROW);                                                                             \
        _tile_loadd(7, w_ + 64, Q8X_TILE_ROW);                                                                        \
        _tile_loadd(A, (const char *)(rows[g].words + (int64_t)(b0 + i_) * 8) + h_ * step, lda);                      \
        if (block_nibbles(format)) {                                                                                  \
            _tile_dpbsud(ACC0, A, 6);                                                                                 \
            _tile_dpbsud(ACC1, A, 7);                                                                                 \
        } else {                                                                                                      \
            _tile_dpbssd(ACC0, A, 6);                                                                                 \
            _tile_dpbssd(ACC1, A, 7);                                                                                 \
        }                                                                                                             \
    } while (0)
        for (int j = 0; j <= jobs + 1; j++) {
            if (j < jobs && j % 2)
                Q8X_JOB_OPS(2, 3, 5, j);
            else if (j < jobs)
                Q8X_JOB_OPS(0, 1, 4, j);
            if (j >= 1 && j <= jobs) { /* job j - 1's sums, into buffer (j - 1) % 2 */
                int32_t *s = sums + ((j - 1) % 2) * 16 * 32;
                if ((j - 1) % 2) {
                    _tile_stored(2, s, 128);
                    _tile_stored(3, s + 16, 128);
                } else {
                    _tile_stored(0, s, 128);
                    _tile_stored(1, s + 16, 128);
                }
            }
            if (j >= 2) { /* job j - 2's fix-ups */
                const int e = j - 2, i = halves ? e / 2 : e, h = halves ? e % 2 : 0;
                const int fold = halves ? h : 1; /* Q8X_SUMS folds a whole block at its second half */
                const int32_t *s = sums + (e % 2) * 16 * 32;
                for (int r = 0; r < group; r++)
                    q8x_fix_up_row(c + 32 * r, s + 32 * r, rows + g + r, b0 + i, h, scales + i, fold, offset, format);
            }
        }
#undef Q8X_JOB_OPS
        for (int r = 0; r < group; r++) {
            v8f cr[NV];
            memcpy(cr, c + 32 * r, sizeof cr);
            store_tile_row(y + (int64_t)(g + r) * ldy, cr, cols, bias, first);
        }
    }
}

/* Panel p of a Q8X product on the tiles, every row, KC k at a time as panel_product_q8x. */
static inline __attribute__((always_inline)) void panel_product_q8x_amx(int p, const struct q8x_row *rows, int M,
                                                                        const void *packed, const float *bias,
                                                                        float *y, int64_t ldy, int N, int K,
                                                                        int format) {
    const int n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR;
    for (int k0 = 0; k0 < K; k0 += KC) {
        const void *panel = (const char *)packed + panel_bytes((int64_t)p * K + k0, format);
        const int kc = K - k0 < KC ? K - k0 : KC, last = k0 + KC >= K;
        q8x_amx_slice(rows, M, K, k0 / Q8_GROUP, panel, kc, y + n0, ldy, cols, bias && last ? bias + n0 : 0,
                      k0 == 0, format);
    }
}

#define Q8X_AMX_LOOP(format)                                                                                          \
    _Pragma("omp parallel") {                                                                                         \
        hp_amx_load_config(M < 16 ? M : 16, NR, q8x_halves(format) ? 8 : 16);                                         \
        _Pragma("omp for schedule(guided)") for (int p = 0; p < (N + NR - 1) / NR; p++)                               \
            panel_product_q8x_amx(p, rows, M, packed, bias, y, ldy, N, K, format);                                    \
        _tile_release();                                                                                              \
    }
#else
#define HP_Q8X_AMX 0
#define Q8X_AMX_LOOP(format) /* never taken: q8x_tile_rows stays 0 */
#endif

int hp_q8x_tiles_available(void) { return HP_Q8X_AMX && hp_amx_bf16_available(); }

/* Rows per block of a Q8X product: a block's int8 rows (K bytes each) stay in L2 while the panels pass over them. */
#define Q8X_ROW_BLOCK 128

#define Q8X_LOOP_DOT(format, dot)                                                                                     \
    for (int m0 = 0; m0 < M; m0 += Q8X_ROW_BLOCK) {                                                                   \
        const int m1 = m0 + Q8X_ROW_BLOCK < M ? m0 + Q8X_ROW_BLOCK : M;                                               \
        _Pragma("omp parallel for schedule(guided)") for (int p = 0; p < (N + NR - 1) / NR; p++)                     \
            panel_product_q8x(p, m0, m1, rows, packed, bias, y, ldy, N, K, format, dot);                              \
    }
#define Q8X_LOOP(format)                                                                                              \
    if (HP_Q8X_AMX && q8x_tile_rows && M >= q8x_tile_rows) {                                                         \
        Q8X_AMX_LOOP(format)                                                                                          \
    } else if (q8x_dot == Q8X_VNNI && HP_DOT_U8S8) {                                                                 \
        Q8X_LOOP_DOT(format, Q8X_VNNI)                                                                                \
    } else {                                                                                                          \
        Q8X_LOOP_DOT(format, Q8X_MADDUBS)                                                                             \
    }

/* hp_linear_packed for a block format with HP_Q8X. The int8 rows live in a buffer of the calling thread, grown as
 * needed and kept: a decode step calls this ~4 times a layer.
 * NOTE: faster than the exact products at every row count measured (1.4-3.3x from 1 to 256 rows on the AMD EPYC,
 * Q4_K, Q6_K, Q8_0 and mixed panels of an 8192 x 2048 weight), so it takes every call it is asked for. */
static void linear_q8x(int format, const float *x, int64_t ldx, const void *packed, const float *bias, float *y,
                       int64_t ldy, int M, int N, int K) {
    static __thread char *buffer = 0;
    static __thread int64_t buffer_size = 0;
    const int64_t blocks = K / Q8_GROUP;
    /* and 16 rows' words more: a tile loads a whole group of 16 rows, past the last (never used) */
    const int64_t need = (int64_t)M * (blocks * (8 * 4 + 4 + 2 * 4) + (int64_t)sizeof(struct q8x_row)) +
                         16 * blocks * 8 * 4;
    if (need > buffer_size) {
        free(buffer);
        buffer_size = need;
        buffer = (char *)malloc(buffer_size);
    }
    struct q8x_row *rows = (struct q8x_row *)buffer; /* NOTE: locals: the threads of the loops share them */
    int32_t *words = (int32_t *)(rows + M), *sums = words + M * blocks * 8;
    float *d = (float *)(sums + M * blocks * 2);
    quantize_rows_q8x(x, ldx, M, K, block_nibbles(format), words, d, sums);
    for (int m = 0; m < M; m++)
        rows[m] = (struct q8x_row){words + m * blocks * 8, d + m * blocks, sums + m * blocks * 2};
    switch (format) {
    case HP_Q4: Q8X_LOOP(Q4_PANELS) break;
    case HP_Q8: Q8X_LOOP(Q8_PANELS) break;
    case HP_Q5: Q8X_LOOP(Q5_PANELS) break;
    case HP_Q6M: Q8X_LOOP(Q6M_PANELS) break;
    case HP_Q4K: Q8X_LOOP(Q4K_PANELS) break;
    case HP_Q5K: Q8X_LOOP(Q5K_PANELS) break;
    default: Q8X_LOOP(Q6K_PANELS) break;
    }
}

/* An fp16 value at p as a float (exact). */
static inline float half_float(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

/* Column n of Q4KS or Q6KS panels as split_column gives it: the scales from the super-block's header (amx.c's
 * split_scales), the q where ops.h's hp_ksplit_low_at and hp_ksplit_high_at place them. */
static void ksplit_column(int format, const char *packed, int64_t n, int K, float *row) {
    const int64_t p = n / HP_BF16A_WIDTH, half = n % HP_BF16A_WIDTH / 16, c = n % 16;
    for (int b = 0; b < K / 32; b++) {
        float scales[32];
        const int64_t head_bytes = hp_ksplit_head_bytes(format), tile_bytes = hp_ksplit_tile_bytes(format);
        const char *super = packed + (p * (K / 256) + b / 8) * hp_ksplit_super_bytes(format);
        const uint8_t *head = (const uint8_t *)super + half * head_bytes;
        const float d = half_float(head + 2 * c);
        if (format == HP_Q4KS) {
            scales[c] = d * (float)head[HP_Q4KS_SCALES_AT + 16 * (b % 8) + c];
            scales[16 + c] = -(half_float(head + HP_Q4KS_DMIN_AT + 2 * c) *
                               (float)head[HP_Q4KS_MINS_AT + 16 * (b % 8) + c]);
        } else {
            scales[c] = d * (float)(int8_t)head[HP_Q6KS_SCALES_AT + 16 * (2 * (b % 8)) + c];
            scales[16 + c] = d * (float)(int8_t)head[HP_Q6KS_SCALES_AT + 16 * (2 * (b % 8) + 1) + c];
        }
        const uint8_t *q = (const uint8_t *)super + 2 * head_bytes + ((b % 8) * 2 + half) * tile_bytes;
        for (int kk = 0; kk < 32; kk++) {
            const int r = kk / 2, pos = 2 * (int)c + kk % 2; /* the tile's row (a pair of k), the value's place */
            int v = q[hp_ksplit_low_at(r, pos) + r % 4 / 2] >> 4 * (r % 2) & 15;
            if (format == HP_Q4KS) {
                row[b * 32 + kk] = fmaf(scales[c], (float)v, scales[16 + c]);
            } else {
                v |= (q[HP_Q6KS_HIGH_AT + hp_ksplit_high_at(r, pos)] >> 2 * (r % 4) & 3) << 4;
                row[b * 32 + kk] = scales[16 * (kk / 16) + c] * (float)(v - 32);
            }
        }
    }
}

/* Column n of Q4S, Q6S, Q8S, Q4KS or Q6KS panels (the tiles' layouts: kernels/cpu/__init__.py's
 * pack_weight_q4a/q6a/q8a, ops.h's Q4KS and Q6KS) as its K weights in fp32: Q4S and Q4KS d q + m in one rounding,
 * as the Q4 panels' lanes; Q6S and Q6KS d (q - 32) and Q8S d q, exact. */
static void split_column(int format, const char *packed, int64_t n, int K, float *row) {
    if (hp_ksplit_format(format)) {
        ksplit_column(format, packed, n, K, row);
        return;
    }
    const int64_t tile = hp_widened_tile_bytes(format), half = n % HP_BF16A_WIDTH / 16;
    const int64_t p = n / HP_BF16A_WIDTH, high = n % HP_BF16A_WIDTH / 8 % 2, c = n % 16, at = 2 * (c % 8);
    for (int b = 0; b < K / 32; b++) {
        const char *t = packed + ((p * (K / 32) + b) * 2 + half) * tile;
        float scales[32];
        memcpy(scales, t, sizeof scales);
        for (int kk = 0; kk < 32; kk++) {
            const int r = kk / 2, e = kk % 2; /* the tile's row (a pair of k) and the pair's element */
            float v;
            if (format == HP_Q8S) {
                v = scales[c] * (float)(int8_t)t[64 + 32 * r + 16 * high + at + e];
            } else {
                const uint8_t byte = (uint8_t)t[128 + 16 * r + at + e];
                int q = high ? byte >> 4 : byte & 15;
                if (format == HP_Q4S) {
                    v = fmaf(scales[c], (float)q, scales[16 + c]);
                } else {
                    const uint8_t bits = (uint8_t)t[384 + 16 * (r / 2) + at + e];
                    q |= (bits >> (4 * (r % 2) + 2 * high) & 3) << 4;
                    v = scales[16 * (kk / 16) + c] * (float)(q - 32);
                }
            }
            row[b * 32 + kk] = v;
        }
    }
}

/* Rows of a weight [N, K] held as panels of any format of enum hp_weight_format but HP_I8: out[t] = w[ids[t]], the
 * very fp32 values the products use. Why: a tied LM head is also the embedding table, and reading the lookups from
 * its panels spares an fp32 row-major copy of the table (113 MB for SmolLM2-135M, 3.6 times its Q8 panels' 32 MB).
 * Returns the first t whose id is outside 0..N-1 (no row of out written from it on), or -1. */
/* The format whose bytes a read of a weight's values (hp_embed_rows, hp_row_norms) takes ``format``'s panels as. */
static int read_format(int format) {
    if (format == HP_BF16C) return BF16_PANELS; /* the same bytes; a lookup is the weight's bfloat16 value */
    /* Q4A, Q6A and Q8A panels are Q4S's, Q6S's and Q8S's bytes: a lookup is the fp32 value the tiles round to
     * bfloat16 (a tied LM head widened on AMX; the caller rounds the rows as the products do) */
    if (format == HP_Q4A || format == HP_Q6A || format == HP_Q8A) return format + HP_Q4S - HP_Q4A;
    return format;
}

int hp_embed_rows(int format, const void *packed, int N, int K, const int64_t *ids, int T, float *out) {
    format = read_format(format);
    for (int t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return t;
#pragma omp parallel for schedule(static) if (T >= 64)
    for (int t = 0; t < T; t++) {
        const int64_t p = ids[t] / NR, col = ids[t] % NR;
        float *row = out + (int64_t)t * K;
        if (hp_split_format(format)) {
            split_column(format, (const char *)packed, ids[t], K, row);
            continue;
        }
        if (format == HP_BF16A) { /* [panels, K / 2, width, 2] bfloat16 */
            const int64_t w = HP_BF16A_WIDTH, pa = ids[t] / w, ca = ids[t] % w;
            const uint16_t *panel = (const uint16_t *)packed + pa * K * w;
            for (int k = 0; k < K; k++) {
                const uint32_t bits = (uint32_t)panel[((int64_t)(k / 2) * w + ca) * 2 + k % 2] << 16;
                memcpy(row + k, &bits, sizeof bits);
            }
            continue;
        }
        if (format == F32_PANELS) {
            const float *panel = (const float *)packed + p * K * NR;
            for (int k = 0; k < K; k++) row[k] = panel[(int64_t)k * NR + col];
            continue;
        }
        float slice[KC * NR] __attribute__((aligned(64)));
        for (int k0 = 0; k0 < K; k0 += KC) {
            int kc = K - k0 < KC ? K - k0 : KC;
            unpack((const char *)packed + panel_bytes(p * K + k0, format), kc, slice, format);
            for (int k = 0; k < kc; k++) row[k0 + k] = slice[(int64_t)k * NR + col];
        }
    }
    return -1;
}

/* The Euclidean norm, in double, of each of the N rows of a weight [N, K] held as fp32, BF16 or block panels (the
 * formats hp_embed_rows unpacks): norms[j] = ||w[j]|| of the very fp32 values the products use. Each panel's slices
 * are unpacked once for all its NR rows, where reading the rows back one by one (hp_embed_rows) unpacks a whole
 * slice for each. Why: the LM head's int8 screen bounds its errors by these norms, and an 8B model's 128k-row Q8_0
 * head took 2.4 s of every start read back a row at a time. Returns 0, or -1 for a format it does not read. */
int hp_row_norms(int format, const void *packed, int N, int K, double *norms) {
    format = read_format(format); /* the split formats' columns are not NR-wide panels of slices: not read here */
    if (format == HP_BF16A || format == I8_PANELS || hp_split_format(format)) return -1;
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        double sums[NR] = {0};
        float slice[KC * NR] __attribute__((aligned(64)));
        for (int k0 = 0; k0 < K; k0 += KC) {
            const int kc = K - k0 < KC ? K - k0 : KC;
            const float *values = slice;
            if (format == F32_PANELS)
                values = (const float *)packed + (p * K + k0) * NR;
            else
                unpack((const char *)packed + panel_bytes(p * K + k0, format), kc, slice, format);
            for (int k = 0; k < kc; k++)
                for (int c = 0; c < NR; c++) sums[c] += (double)values[k * NR + c] * values[k * NR + c];
        }
        for (int c = 0; c < NR && p * NR + c < N; c++) norms[p * NR + c] = sqrt(sums[c]);
    }
    return 0;
}

/* The fp32 panels [panels, K, NR] of a weight held as compact panels (BF16, or blocks of Q4, Q8, Q5, Q6M and the
 * K-quants): the very fp32 slices the products unpack from them once they take more than MRF rows (panel_product),
 * so a product over either gives the same bits. Why: a step of many rows pays that widening at every step; a small
 * model can keep both, the compact panels for the few rows bound by their bytes, these for the many
 * (engine/backends/wide_panels.py). Returns 0, or -1 for a format whose products are not fp32 panels' (BF16C and
 * the AMX formats) or that is not compact (fp32, int8). */
int hp_widen_panels(int format, const void *packed, int N, int K, float *out) {
    if (format != BF16_PANELS && format != Q4_PANELS && format != Q8_PANELS && format != Q5_PANELS &&
        format != Q6M_PANELS && format != Q4K_PANELS && format != Q5K_PANELS && format != Q6K_PANELS)
        return -1;
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int k0 = 0; k0 < K; k0 += KC)
            unpack((const char *)packed + panel_bytes(p * K + k0, format), K - k0 < KC ? K - k0 : KC,
                   out + (p * K + k0) * NR, format);
    return 0;
}

/* y [M, N] ~= x . w^T for int8 panels and per-column scales [>= N]: a quarter of the fp32 weight's bytes, for
 * products whose error is bounded and checked by the caller (the LM head's screened argmax). A panel is
 * [K / 4, NV, 8, 4]: lane l of vector v holds column 8 v + l at four consecutive k, low byte first; K % 4 == 0. */
void hp_linear_i8(const float *x, int64_t ldx, const signed char *packed, const float *scales, float *y, int64_t ldy,
                  int M, int N, int K) {
    LINEAR_LOOP(0, scales, I8_PANELS)
}

typedef double v4d __attribute__((vector_size(32), aligned(8)));
typedef float v4f __attribute__((vector_size(16), aligned(4)));
typedef long long v4l __attribute__((vector_size(32)));

/* Column j of hp_linear_packed's y = x . w^T for one row x and panels of ``format`` (fp32 or a block format),
 * computed as that product computes it: the same micro-kernel over j's panel, the same k blocks, the same store path
 * for a partial last panel (every row count gives a row the same bits). */
static float linear_column(const float *x, const void *packed, int N, int K, int j, int format) {
    int p = j / NR, n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR;
    float y[NR];
    for (int k0 = 0; k0 < K; k0 += KC) {
        int kc = K - k0 < KC ? K - k0 : KC;
        micro_kernel(1, x + k0, 0, (const char *)packed + panel_bytes((int64_t)p * K + k0, format), kc, y, NR, cols,
                     0, 0, k0 == 0, format);
    }
    return y[j - n0];
}

/* Greedy tokens from approximate logits (engine/backends/greedy_head.py explains the bound): for row m of h [M, K],
 * every column j with approx_j + r_j >= max_i (approx_i - r_i), where r_j = s_m err_j bounds |approx_j - logit_j|,
 * may hold the argmax of the exact logits; each is recomputed as hp_linear_packed would (format, packed, N, K), and
 * the largest, lowest j on a tie, is tokens[m]. s_m is row_scale[m], or where row_scale is NULL ||h_m|| rounded up by
 * a relative 2^-20. In double, with a slack of 2^-30 of the magnitudes in the comparison, far above double's
 * rounding here. tokens[m] = -1 where a value is not finite or more than max_cand columns qualify: the caller then
 * computes all logits. */
void hp_screened_argmax(const float *h, int64_t ldh, int M, int K, const float *approx, const double *err,
                        const double *row_scale, int format, const void *packed, int N, int max_cand,
                        int64_t *tokens) {
    /* rows on both cores: each row reads every column's bound (49152 on SmolLM2), and a screened step may have
     * hundreds of rows (Int8ScreenedHead) */
#pragma omp parallel for schedule(dynamic) if (M > 1)
    for (int m = 0; m < M; m++) {
        const float *a = approx + (int64_t)m * N, *x = h + m * ldh;
        double sq = 0.0;
        if (!row_scale)
            for (int k = 0; k < K; k++) sq += (double)x[k] * x[k];
        const double norm = row_scale ? row_scale[m] : sqrt(sq) * (1.0 + 0x1p-20);
        const v4d vnorm = {norm, norm, norm, norm};
        v4d floor4 = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, widest4 = {0}, nan4 = {0};
        int j = 0;
        for (; j + 4 <= N; j += 4) {
            v4d aj = __builtin_convertvector(*(const v4f *)(a + j), v4d), r = vnorm * *(const v4d *)(err + j);
            v4d lo = aj - r;
            nan4 += aj - aj; /* NaN once any a_j is infinite or NaN */
            floor4 = (v4d)(((v4l)lo & (v4l)(lo > floor4)) | ((v4l)floor4 & ~(v4l)(lo > floor4)));
            widest4 = (v4d)(((v4l)r & (v4l)(r > widest4)) | ((v4l)widest4 & ~(v4l)(r > widest4)));
        }
        double floor = -INFINITY, widest = 0.0, nan = nan4[0] + nan4[1] + nan4[2] + nan4[3];
        for (int i = 0; i < 4; i++) {
            floor = floor4[i] > floor ? floor4[i] : floor;
            widest = widest4[i] > widest ? widest4[i] : widest;
        }
        for (; j < N; j++) {
            double r = norm * err[j];
            nan += a[j] - a[j];
            floor = a[j] - r > floor ? a[j] - r : floor;
            widest = r > widest ? r : widest;
        }
        tokens[m] = -1;
        if (!isfinite(norm) || nan != 0.0) continue;
        const double threshold = floor - 0x1p-30 * (1.0 + fabs(floor) + widest);
        int count = 0;
        float best = -INFINITY;
        for (j = 0; j < N && count <= max_cand; j++) {
            if (a[j] + norm * err[j] < threshold) continue;
            count++;
            float logit = linear_column(x, packed, N, K, j, format);
            if (tokens[m] < 0 || logit > best) best = logit, tokens[m] = j;
        }
        if (count > max_cand) tokens[m] = -1;
    }
}

/* Structured outputs: logits[rows[i]][t] = -inf wherever bit t of bitmask row i is clear (xgrammar's layout: word
 * t / 32, bit t % 32). NOTE: most words of a grammar's mask are all ones or all zeros, so those cost one compare;
 * torch's bit unpacking over the whole vocabulary took ~130 us a row of SmolLM2's 49152 tokens here. */
void hp_apply_token_bitmask(float *logits, int64_t ld, const int64_t *rows, const int32_t *bitmask, int num_rows,
                            int words, int vocab) {
    for (int i = 0; i < num_rows; i++) {
        float *row = logits + rows[i] * ld;
        const uint32_t *mask = (const uint32_t *)bitmask + (int64_t)i * words;
        for (int w = 0; w < words && w * 32 < vocab; w++) {
            const uint32_t m = mask[w];
            const int base = w * 32, n = vocab - base < 32 ? vocab - base : 32;
            if (m == 0xffffffffu) continue;
            for (int b = 0; b < n; b++) /* no branch on the bit: a mixed word's bits are unpredictable */
                row[base + b] = (m >> b) & 1u ? row[base + b] : -INFINITY;
        }
    }
}

/* Lane i of the result is the sum of the lanes of a[i]: eight horizontal sums in three shuffle-and-add levels. */
static inline v8f sum_lanes8(const v8f a[8]) {
    const v8i even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
    v8f t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], even) + __builtin_shuffle(a[2 * i], a[2 * i + 1], odd);
    /* t[i] = [a2i 0+1, 2+3, a2i+1 0+1, 2+3 | a2i 4+5, 6+7, a2i+1 4+5, 6+7] */
    for (int i = 0; i < 2; i++)
        u[i] = __builtin_shuffle(t[2 * i], t[2 * i + 1], even) + __builtin_shuffle(t[2 * i], t[2 * i + 1], odd);
    /* u[0] = [low halves of a0..a3 | high halves of a0..a3], u[1] the same for a4..a7 */
    const v8i lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = {4, 5, 6, 7, 12, 13, 14, 15};
    return __builtin_shuffle(u[0], u[1], lo) + __builtin_shuffle(u[0], u[1], hi);
}

/* Where the attention's prefetches go. */
#ifndef HP_PREFETCH_LOCALITY
#define HP_PREFETCH_LOCALITY 2 /* to L2 (T1): 3-12% less decode attention than to L1 at 1-64 sequences of 192-1024
                                * positions, every pool type, on a Xeon with AMX (python -m loadtest.lab.kernel_ab) */
#endif
/* The cache block holding positions p0..end of a chunk, every line of it asked for into L1. NOTE: the pool is cold
 * in a decode step (every weight streams through the caches between two layers), and from DRAM the attention read it
 * at ~10 GB/s where the same block order streams at ~25: its few loads in flight per 8 positions left the memory
 * idle while it computed. Asking for every line first puts them all in flight at once; with the block that comes
 * next prefetched to L2 under this one's arithmetic (struct trickle), they arrive from L2. A prefetch rather than a
 * load of each line (as this did before) lets the arithmetic start on the first lines while the last are on their
 * way: 2-11% less decode attention at 4-64 sequences of 192-1024 positions, int8, bfloat16 and fp32 pools, the same
 * at one sequence of 192 (Xeon with AMX, python -m loadtest.lab.kernel_ab). */
static inline const char *fetch_block(const void *cache, const int32_t *table, int p0, int end, int block_size,
                                      int64_t row) {
    const char *block = (const char *)cache + table[p0 / block_size] * (block_size * row);
    for (int64_t i = 0; i < (end - p0) * row; i += 64) __builtin_prefetch(block + i, 0, 3);
    return block;
}

/* The block read after the current one, prefetched to L2 a few lines per tile of arithmetic. NOTE: prefetching a
 * whole block in one burst (as this kernel did) stalled: a core has 16 line-fill buffers, a 3-12 KiB block is 51-192
 * lines, so the burst waited out the memory's latency several times over while no arithmetic ran. Spread over the
 * block's tiles, the requests stay within the buffers and the arithmetic hides them. */
struct trickle {
    const char *next; /* NULL: nothing to prefetch */
    int64_t bytes, done, step;
};

static inline struct trickle trickle_of(const char *next, int64_t bytes, int tiles) {
    const int64_t lines = (bytes + 63) / 64, per_tile = (lines + tiles - 1) / tiles; /* tiles >= 1 */
    return (struct trickle){next, bytes, 0, per_tile * 64};
}

/* Block b + 1 of a chunk's pass over cache, or NULL after its last block. */
static inline const char *block_after(const void *cache, const int32_t *table, int b, int last, int64_t block_bytes) {
    return b < last ? (const char *)cache + table[b + 1] * block_bytes : NULL;
}

static inline void trickle_some(struct trickle *t) {
    if (!t->next) return;
    const int64_t end = t->done + t->step < t->bytes ? t->done + t->step : t->bytes;
    for (; t->done < end; t->done += 64) __builtin_prefetch(t->next + t->done, 0, HP_PREFETCH_LOCALITY);
}

static inline void trickle_rest(struct trickle *t) {
    t->step = t->bytes;
    trickle_some(t);
}

/* Bytes of one KV head's row of one position in a pool of kv_format: D values, and for int8 the row's scale after
 * them (a float32: the row is d q, d = max |x| / 127). */
static inline int64_t kv_head_bytes(int D, int kv_format) {
    return kv_format == HP_KV_I8 ? D + (int64_t)sizeof(float) : (int64_t)D * (kv_format == HP_KV_BF16 ? 2 : 4);
}

/* Eight consecutive K/V values from element i of a head's row, as fp32: loaded, for a bfloat16 pool widened in the
 * register (exact), for an int8 pool widened without its scale (kv_scale). NOTE: widening each block into an fp32
 * copy first (the old staging) was half the attention's time: GCC split the widening into three shuffles and a store
 * per eight values. */
static inline v8f kv8(const void *base, int64_t i, int kv_format) {
    if (kv_format == HP_KV_F32) return load8((const float *)base + i);
    if (kv_format == HP_KV_I8) {
#ifdef __AVX2__
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + i))));
#else
        typedef int8_t v8b __attribute__((vector_size(8), aligned(1)));
        return __builtin_convertvector(*(const v8b *)((const int8_t *)base + i), v8f);
#endif
    }
#ifdef __AVX2__
    return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i))),
                                  16);
#else
    typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
    typedef uint32_t v8u __attribute__((vector_size(32)));
    return (v8f)(__builtin_convertvector(*(const v8h *)((const uint16_t *)base + i), v8u) << 16);
#endif
}

#ifdef __AVX512F__
static inline v16f pair8(v8f lo, v8f hi) { /* [lo | hi] */
    return (v16f)_mm512_insertf64x4(_mm512_castpd256_pd512((__m256d)lo), (__m256d)hi, 1);
}
static inline v16f splat16(float x) { return (v16f)_mm512_set1_ps(x); }
static inline v16f q8x2(const float *q) { /* [q 0..7 | q 0..7] */
    return (v16f)_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)q));
}
static inline v8f low8(v16f v) { return (v8f)_mm512_castps512_ps256((__m512)v); }
static inline v8f high8(v16f v) { return (v8f)_mm512_extractf64x4_pd((__m512d)v, 1); }

/* kv8(a, i) and kv8(b, i) side by side, a's in the low lanes: the same values, widened in one register. */
static inline v16f kv8x2(const char *a, const char *b, int64_t i, int kv_format) {
    if (kv_format == HP_KV_F32) return pair8(load8((const float *)a + i), load8((const float *)b + i));
    if (kv_format == HP_KV_I8) {
        const __m128d x = _mm_loadh_pd(_mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)(a + i))),
                                       (const double *)(b + i));
        return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_castpd_si128(x)));
    }
    const __m128i lo = _mm_loadu_si128((const __m128i *)((const uint16_t *)a + i)),
                  hi = _mm_loadu_si128((const __m128i *)((const uint16_t *)b + i));
    const __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16);
}

/* Sixteen consecutive K/V values from element i of a head's row: kv8(base, i) and kv8(base, i + 8), one register. */
static inline v16f kv16(const void *base, int64_t i, int kv_format) {
    if (kv_format == HP_KV_F32) return *(const v16f *)((const float *)base + i);
    if (kv_format == HP_KV_I8) {
        const __m128i x = _mm_loadu_si128((const __m128i *)((const int8_t *)base + i));
        return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x));
    }
    return (v16f)_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i))), 16);
}
#endif

/* The factor a head's row of D values carries: its scale in an int8 pool, else 1. */
static inline float kv_scale(const void *base, int D, int kv_format) {
    if (kv_format != HP_KV_I8) return 1.0f;
    float d;
    memcpy(&d, (const int8_t *)base + D, sizeof d);
    return d;
}

/* A position's weight s in the sum of V: with an int8 row's scale (that of row v) folded in. */
static inline float weight_of(float s, const char *v, int D, int kv_format) {
    return kv_format == HP_KV_I8 ? s * kv_scale(v, D, kv_format) : s;
}

/* dot(q, row) for a K row of any format (an int8 row without its scale), summed exactly as dot() sums fp32 rows. */
static inline float dot_kv(const float *q, const void *k, int n, int kv_format) {
    if (kv_format == HP_KV_F32) return dot(q, (const float *)k, n);
    v8f acc0 = {0}, acc1 = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 += load8(q + i) * kv8(k, i, kv_format);
        acc1 += load8(q + i + 8) * kv8(k, i + 8, kv_format);
    }
    for (; i + 8 <= n; i += 8) acc0 += load8(q + i) * kv8(k, i, kv_format);
    return hsum8(acc0 + acc1); /* n is a multiple of 8 */
}

#ifdef __AVX512F__
#define ATT_GT 3 /* query heads of a group per register tile: 3 x 8 accumulators + 3 + 1 of 32 registers */
#else
#define ATT_GT 1 /* 16 registers: one head at a time */
#endif

/* acc[g][i] = the lane sums of query head g against the K vectors KV (of i < N, dims j .. j + 7), in VEC registers;
 * Q loads dims j .. j + 7 of a query head into one. */
#define SCORE_SUMS(VEC, N, acc, Q, KV)                                                                             \
    do {                                                                                                           \
        _Pragma("GCC unroll 3") for (int g = 0; g < ATT_GT; g++) for (int i = 0; i < (N); i++) acc[g][i] = (VEC){0}; \
        for (int j = 0; j < D; j += 8) {                                                                           \
            VEC qv[ATT_GT];                                                                                        \
            _Pragma("GCC unroll 3") for (int g = 0; g < ATT_GT; g++) if (g < G) qv[g] = Q(qg + g * D + j);         \
            for (int i = 0; i < (N); i++) {                                                                        \
                const VEC kv = KV;                                                                                 \
                _Pragma("GCC unroll 3") for (int g = 0; g < ATT_GT; g++) if (g < G) acc[g][i] += qv[g] * kv;       \
            }                                                                                                      \
        }                                                                                                          \
    } while (0)

/* Scores of positions p .. p+7 (head rows k, k + row, ... bytes) for G <= ATT_GT query heads qg (D apart): each K
 * vector is loaded once for all G heads. Per (head, position) the sum runs over the same 8-dim chunks and lane tree
 * as a single head's, so the bits do not depend on the tiling; an int8 row's scale multiplies its sum. With
 * AVX-512 a register holds two positions' 8 dims side by side (the same lanes, summed in the same order), so one
 * widening and one FMA serve two positions; with value_tile's 16 dims a register, a step's decode attention took
 * 7-15% less time at 16 and 64 sequences of 192 positions, every pool type, the same bits (Xeon with AMX, python -m
 * loadtest.lab.kernel_ab HEAD~1 HEAD --rows 1 --seqs 16,64 --context 192 --kv-dtype int8,bfloat16,float32). */
static inline __attribute__((always_inline)) void score_tile(const int D, int G, const float *qg, const char *k,
                                                             int64_t row, float *sg, int split, float scale,
                                                             const int kv_format) {
    v8f sums[ATT_GT][8];
#ifdef __AVX512F__
    v16f acc[ATT_GT][4];
    SCORE_SUMS(v16f, 4, acc, q8x2, kv8x2(k + 2 * i * row, k + (2 * i + 1) * row, j, kv_format));
#pragma GCC unroll 3
    for (int g = 0; g < ATT_GT; g++)
        for (int i = 0; i < 4; i++) sums[g][2 * i] = low8(acc[g][i]), sums[g][2 * i + 1] = high8(acc[g][i]);
#else
    SCORE_SUMS(v8f, 8, sums, load8, kv8(k + i * row, j, kv_format));
#endif
    v8f scales = splat8(scale);
    if (kv_format == HP_KV_I8)
        for (int i = 0; i < 8; i++) scales[i] = kv_scale(k + i * row, D, kv_format) * scale;
#pragma GCC unroll 3
    for (int g = 0; g < ATT_GT; g++)
        if (g < G) store8(sg + g * split, sum_lanes8(sums[g]) * scales);
}
#undef SCORE_SUMS

/* The body of value_tile in VEC registers of LANES floats, KV widening a row's values into one. */
#define VALUE_TILE(VEC, LANES, KV, SPLAT)                                                                          \
    do {                                                                                                           \
        const int nv = DV * 8 / (LANES);                                                                           \
        VEC acc[ATT_GT][8];                                                                                        \
        _Pragma("GCC unroll 3") for (int g = 0; g < ATT_GT; g++) if (g < G) for (int j = 0; j < nv; j++)           \
            acc[g][j] = *(const VEC *)(o + g * o_stride + (LANES) * j);                                            \
        for (int p = 0; p < n; p++) {                                                                              \
            VEC wv[ATT_GT];                                                                                        \
            _Pragma("GCC unroll 3") for (int g = 0; g < ATT_GT; g++) if (g < G)                                    \
                wv[g] = SPLAT(weight_of(sg[g * split + p], v + p * row, D, kv_format));                            \
            for (int j = 0; j < nv; j++) {                                                                         \
                const VEC vv = KV(v + p * row, d0 + (LANES) * j, kv_format);                                       \
                _Pragma("GCC unroll 3") for (int g = 0; g < ATT_GT; g++) if (g < G) acc[g][j] += wv[g] * vv;       \
            }                                                                                                      \
        }                                                                                                          \
        _Pragma("GCC unroll 3") for (int g = 0; g < ATT_GT; g++) if (g < G) for (int j = 0; j < nv; j++)           \
            *(VEC *)(o + g * o_stride + (LANES) * j) = acc[g][j];                                                  \
    } while (0)

/* o[g] (+)= sum over positions p0..end of s[g][p] v[p], for G <= ATT_GT query heads sharing the KV head of v (its
 * head rows v, v + row, ... bytes, D values each), the dims d0 .. d0 + 8 DV of each: each V vector is loaded once for
 * all G heads, and each (head, dim) sums the positions in order, as one head at a time would. An int8 row's scale
 * joins its weight s[g][p]. With AVX-512 (and DV even) the dims go 16 to a register: the same sums, per lane. */
static inline __attribute__((always_inline)) void value_tile(const int D, const int DV, int d0, int G, const float *sg,
                                                             int split, const char *v, int64_t row, int n, float *o,
                                                             int64_t o_stride, const int kv_format) {
#ifdef __AVX512F__
    if (DV % 2 == 0) {
        VALUE_TILE(v16f, 16, kv16, splat16);
        return;
    }
#endif
    VALUE_TILE(v8f, 8, kv8, splat8);
}
#undef VALUE_TILE

/* Queries a task of decode attention takes at most: a prompt chunk's consecutive tokens over the same block table
 * share each cache block's loads (one sequence, each token's context one position longer than the one before).
 * NOTE: a prompt token rides along as a decode query over its prefix (decoder.c); one at a time, each read the
 * whole prefix from memory again, though its arithmetic is that of a decode. Runs of up to 8 took 32% / 36% / 42%
 * off a 64-client step's attention (54 decodes of 192 positions and 54 prompt tokens from position 64; int8,
 * bfloat16 and fp32 pools), 4 a little less, 16 less (its last tasks ran long on one thread); decodes alone the
 * same (Xeon with AMX, python -m loadtest.lab.kernel_ab --prompt 54@64). */
#ifndef HP_ATT_QUERIES
#define HP_ATT_QUERIES 8
#endif

/* A task's queries (a decode alone, or consecutive tokens of a prompt chunk) over one chunk of their sequence: query
 * m's heads at q + m q_stride, its len[m] positions of the chunk (<= 0: the chunk is past its context), its scores
 * at scores + m num_heads split, its (max, sum, acc) per head at mine[m]. */
struct chunk_queries {
    int n, longest, reach; /* queries; the most positions one reaches; how many reach any */
    const float *q;
    int64_t q_stride;
    const int *len;
    float *scores;
    float *const *mine;
};

/* Scores of every query head against K, block by block and, inside a block, query by query and KV head by KV head,
 * the query heads of its group a few at a time (score_tile): each cache row (all KV heads of a position,
 * contiguous) is read whole while it is in cache, each of its vectors once per tile of query heads, and the block
 * stays in L1 for every query of the task. */
static inline __attribute__((always_inline)) void chunk_scores(const int D, int num_kv_heads, int group,
                                                               struct chunk_queries c, const void *k_cache,
                                                               const void *v_cache, const int32_t *table,
                                                               int block_size, float scale, int split,
                                                               const int kv_format) {
    const int tiles = num_kv_heads * ((group + ATT_GT - 1) / ATT_GT), last = (c.longest - 1) / block_size;
    const int64_t hb = kv_head_bytes(D, kv_format), row = num_kv_heads * hb; /* bytes of a head's row, a position's */
    const int64_t block_bytes = block_size * row, per_query = (int64_t)num_kv_heads * group * split;
    for (int p0 = 0; p0 < c.longest; p0 += block_size) {
        const int top = p0 + block_size < c.longest ? p0 + block_size : c.longest, b = p0 / block_size;
        const char *kb = fetch_block(k_cache, table, p0, top, block_size, row);
        const char *next = block_after(k_cache, table, b, last, block_bytes); /* after K's last block, V's first */
        struct trickle t = trickle_of(next ? next : (const char *)v_cache + table[0] * block_bytes, block_bytes,
                                      c.reach * tiles * ((top - p0 + 7) / 8));
        for (int m = 0; m < c.n; m++) {
            const int end = p0 + block_size < c.len[m] ? p0 + block_size : c.len[m];
            for (int h = 0; h < num_kv_heads && end > p0; h++)
                for (int g0 = 0; g0 < group; g0 += ATT_GT) {
                    const int G = group - g0 < ATT_GT ? group - g0 : ATT_GT;
                    const float *qg = c.q + m * c.q_stride + (int64_t)(h * group + g0) * D;
                    float *sg = c.scores + m * per_query + (int64_t)(h * group + g0) * split;
                    int p = p0;
                    for (; p + 8 <= end; p += 8) {
                        trickle_some(&t);
                        if (G == ATT_GT) /* a constant: no test of G in the loops */
                            score_tile(D, ATT_GT, qg, kb + (p - p0) * row + h * hb, row, sg + p, split, scale,
                                       kv_format);
                        else
                            score_tile(D, G, qg, kb + (p - p0) * row + h * hb, row, sg + p, split, scale, kv_format);
                    }
                    for (; p < end; p++) {
                        const char *k = kb + (p - p0) * row + h * hb;
                        const float s = kv_format == HP_KV_I8 ? kv_scale(k, D, kv_format) * scale : scale;
                        for (int g = 0; g < G; g++) sg[g * split + p] = dot_kv(qg + g * D, k, D, kv_format) * s;
                    }
                }
        }
        trickle_rest(&t);
    }
}

/* Each query head's weighted sum of V into its acc (mine), block by block and query by query as chunk_scores goes,
 * each V vector loaded once for the tile of query heads sharing it (value_tile). */
static inline __attribute__((always_inline)) void chunk_values(const int D, int num_kv_heads, int group,
                                                               struct chunk_queries c, const void *v_cache,
                                                               const int32_t *table, int block_size, int split,
                                                               const int kv_format) {
    const int tiles = num_kv_heads * ((group + ATT_GT - 1) / ATT_GT), last = (c.longest - 1) / block_size;
    const int64_t hb = kv_head_bytes(D, kv_format), row = num_kv_heads * hb;
    const int64_t block_bytes = block_size * row, per_query = (int64_t)num_kv_heads * group * split;
    for (int p0 = 0; p0 < c.longest; p0 += block_size) {
        const int top = p0 + block_size < c.longest ? p0 + block_size : c.longest, b = p0 / block_size;
        const char *vb = fetch_block(v_cache, table, p0, top, block_size, row);
        struct trickle t = trickle_of(block_after(v_cache, table, b, last, block_bytes), block_bytes,
                                      c.reach * tiles * ((D + 63) / 64));
        for (int m = 0; m < c.n; m++) {
            const int end = p0 + block_size < c.len[m] ? p0 + block_size : c.len[m];
            for (int h = 0; h < num_kv_heads && end > p0; h++)
                for (int g0 = 0; g0 < group; g0 += ATT_GT) {
                    const int G = group - g0 < ATT_GT ? group - g0 : ATT_GT, hg = h * group + g0;
                    for (int d0 = 0; d0 < D; d0 += 64) { /* 64 dims (8 vectors) a tile, or what remains of the head */
                        trickle_some(&t);
                        const int DV = D - d0 < 64 ? (D - d0) / 8 : 8;
                        const float *sv = c.scores + m * per_query + (int64_t)hg * split + p0;
                        float *o = c.mine[m] + hg * (D + 2) + 2 + d0;
                        if (G == ATT_GT)
                            value_tile(D, DV, d0, ATT_GT, sv, split, vb + h * hb, row, end - p0, o, D + 2,
                                       kv_format);
                        else
                            value_tile(D, DV, d0, G, sv, split, vb + h * hb, row, end - p0, o, D + 2, kv_format);
                    }
                }
        }
        trickle_rest(&t);
    }
}

/* One chunk of decode attention for a task's queries, every head: scores against the cached positions
 * (chunk_scores), then exp and sum (kept unnormalised with their max, for the merge), then the weighted sum of V
 * (chunk_values). Each query's sums run in the order they run for it alone, so its bits do not depend on the other
 * queries. NOTE: reading one head's 256 bytes out of every 768-byte row (a task per KV head) ran at a third of the
 * memory bandwidth on the development machines (~10 GB/s of used bytes vs ~30), as the lines in between were
 * fetched anyway. Sharing each K and V vector across the heads of a group took the hot attention from one load per
 * FMA (load-bound) to ~3 FMAs per load. Inlined with a constant head_dim (64, 128). */
static inline __attribute__((always_inline)) void attend_chunk_d(
    const int D, int num_kv_heads, int group, int n, const float *q, int64_t q_stride, const void *k_cache,
    const void *v_cache, const int32_t *table, int block_size, const int *len, float scale, float *scores, int split,
    float *const *mine, const int kv_format) {
    struct chunk_queries c = {n, 0, 0, q, q_stride, len, scores, mine};
    for (int m = 0; m < n; m++) c.longest = len[m] > c.longest ? len[m] : c.longest, c.reach += len[m] > 0;
    if (c.longest <= 0) return;
    chunk_scores(D, num_kv_heads, group, c, k_cache, v_cache, table, block_size, scale, split, kv_format);
    const int num_heads = num_kv_heads * group;
    for (int m = 0; m < n; m++)
        for (int hg = 0; len[m] > 0 && hg < num_heads; hg++) {
            float *sg = scores + (m * num_heads + hg) * (int64_t)split, mx = max_of(sg, len[m]);
            float *stats = mine[m] + hg * (D + 2);
            stats[0] = mx;
            stats[1] = exp_sub_sum(sg, len[m], mx);
            memset(stats + 2, 0, sizeof(float) * D);
        }
    chunk_values(D, num_kv_heads, group, c, v_cache, table, block_size, split, kv_format);
}

static void attend_chunk(int head_dim, int num_kv_heads, int group, int n, const float *q, int64_t q_stride,
                         const void *k_cache, const void *v_cache, const int32_t *table, int block_size,
                         const int *len, float scale, float *scores, int split, float *const *mine, int kv_format) {
#define ATTEND_D(D, FORMAT)                                                                                        \
    attend_chunk_d(D, num_kv_heads, group, n, q, q_stride, k_cache, v_cache, table, block_size, len, scale, scores, \
                   split, mine, FORMAT)
#define ATTEND(FORMAT)                                                                                             \
    (head_dim == 64 ? ATTEND_D(64, FORMAT) : head_dim == 128 ? ATTEND_D(128, FORMAT) : ATTEND_D(head_dim, FORMAT))
    if (kv_format == HP_KV_BF16)
        ATTEND(HP_KV_BF16);
    else if (kv_format == HP_KV_I8)
        ATTEND(HP_KV_I8);
    else
        ATTEND(HP_KV_F32);
#undef ATTEND
#undef ATTEND_D
}

/* Whether token t's query continues the run of queries that token `lead` starts: its context one position longer
 * than token t - 1's, over the blocks of lead's table (the one every query of the run reads). */
static int continues(const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, int t, int lead,
                     int block_size) {
    if (seq_lens[t] != seq_lens[t - 1] + 1) return 0;
    const int blocks = (seq_lens[t] + block_size - 1) / block_size;
    return memcmp(tables + t * table_stride, tables + lead * table_stride, sizeof(int32_t) * blocks) == 0;
}

/* Attention of one query token per sequence over its paged context, for a whole batch of decodes.
 *   q:      [num_seqs, num_heads, head_dim] (token stride q_stride)
 *   cache:  [num_blocks, block_size, num_kv_heads, head_dim] for K and for V, of the type kv_format names
 *   tables: [num_seqs, table_stride] int32 block ids; seq_lens: [num_seqs] int32 context lengths
 *   out:    [num_seqs, num_heads, head_dim] (token stride out_stride)
 * A task is one chunk of up to `split` positions of a run of queries (a decode alone, or up to HP_ATT_QUERIES
 * consecutive tokens of a prompt chunk), with all their heads. Long contexts split into chunks keep both cores busy
 * even for one sequence; each chunk keeps its max and sum per head, and a second pass merges the chunks (split-KV,
 * as the Triton kernel does). Within a chunk the softmax is exact: scores kept, max subtracted. Small batches get
 * short chunks, so even a single sequence makes enough tasks for every thread.
 *
 *     tokens    t0 t1 t2 t3 | t4 t5 t6 t7       (t3..t7 one prompt chunk: contexts 97, 98, ..., 101)
 *     runs      t0 t1 t2 t3..t7                  (run = tokens sharing each block's loads)
 *     tasks     (run, chunk of positions 0..255), (run, 256..511), ...; a query's chunks: those its context reaches */
void hp_paged_decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                               const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, float *out,
                               int64_t out_stride, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                               int block_size, float scale, int kv_format) {
    int group = num_heads / num_kv_heads;
    int split = num_seqs >= 8 ? 256 : 64;
    split = (split + block_size - 1) / block_size * block_size; /* chunks start on block boundaries */
    /* first chunk of each sequence (its partials' index), and the runs of queries: run r is tokens
     * run0[r] .. run0[r + 1] - 1, its tasks task0[r] .. task0[r + 1] - 1 (the last token's chunks) */
    int *chunk0 = malloc(sizeof(int) * (num_seqs + 1)), *run0 = malloc(sizeof(int) * (num_seqs + 1));
    int *task0 = malloc(sizeof(int) * (num_seqs + 1)), runs = 0;
    chunk0[0] = 0, task0[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        chunk0[s + 1] = chunk0[s] + (seq_lens[s] + split - 1) / split;
        if (s == 0 || s - run0[runs - 1] >= HP_ATT_QUERIES ||
            !continues(tables, table_stride, seq_lens, s, run0[runs - 1], block_size))
            run0[runs++] = s;
    }
    run0[runs] = num_seqs;
    int widest = 1; /* the most queries of a run: the scores each thread holds at once */
    for (int r = 0; r < runs; r++) {
        task0[r + 1] = task0[r] + (seq_lens[run0[r + 1] - 1] + split - 1) / split;
        widest = run0[r + 1] - run0[r] > widest ? run0[r + 1] - run0[r] : widest;
    }
    int num_chunks = chunk0[num_seqs], num_tasks = task0[runs];
    /* per chunk and query head: (max, sum, acc[head_dim]) */
    int64_t part = (int64_t)num_heads * (head_dim + 2);
    float *partial = malloc(sizeof(float) * (size_t)num_chunks * part);
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)widest * num_heads * split);
        int r = 0;
        /* NOTE: guided, as the products' panels: a thread's tasks in runs of consecutive ones took 2-7% off a
         * step's attention against one task at a time (dynamic, 1), at 1-64 sequences and 192-4096 positions. */
#pragma omp for schedule(guided)
        for (int c = 0; c < num_tasks; c++) {
            while (task0[r + 1] <= c) r++;
            while (task0[r] > c) r--;
            const int s0 = run0[r], n = run0[r + 1] - s0, first = (c - task0[r]) * split;
            int len[HP_ATT_QUERIES];
            float *mine[HP_ATT_QUERIES];
            for (int m = 0; m < n; m++) {
                const int rest = seq_lens[s0 + m] - first;
                len[m] = rest < split ? rest : split;
                mine[m] = partial + (int64_t)(chunk0[s0 + m] + c - task0[r]) * part; /* unused where len <= 0 */
            }
            attend_chunk(head_dim, num_kv_heads, group, n, q + (int64_t)s0 * q_stride, q_stride, k_cache, v_cache,
                         tables + (int64_t)s0 * table_stride + first / block_size, block_size, len, scale, scores,
                         split, mine, kv_format);
        }
        free(scores);
        /* merge: out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c */
#pragma omp for schedule(static)
        for (int t = 0; t < num_seqs * num_heads; t++) {
            int seq = t / num_heads, hg = t % num_heads;
            float mx = -INFINITY, sum = 0.0f;
            for (int c = chunk0[seq]; c < chunk0[seq + 1]; c++) {
                float m = partial[(int64_t)c * part + hg * (head_dim + 2)];
                mx = m > mx ? m : mx;
            }
            float *o = out + (int64_t)seq * out_stride + (int64_t)hg * head_dim;
            memset(o, 0, sizeof(float) * head_dim);
            for (int c = chunk0[seq]; c < chunk0[seq + 1]; c++) {
                const float *stats = partial + (int64_t)c * part + hg * (head_dim + 2);
                float w = expf(stats[0] - mx);
                sum += w * stats[1];
                for (int d = 0; d < head_dim; d++) o[d] += w * stats[2 + d];
            }
            float inv = 1.0f / sum;
            for (int d = 0; d < head_dim; d++) o[d] *= inv;
        }
    }
    free(partial);
    free(chunk0);
    free(run0);
    free(task0);
}

/* The small per-layer operations, each one pass over its rows. Work below ~16k elements stays on the calling
 * thread: waking the other OpenMP thread costs more than a decode row's arithmetic. */
#define PAR_MIN 16384

static void rms_row(const float *x, const float *w, float *out, int D, float eps) {
    v8f acc = {0};
    int d = 0;
    for (; d + 8 <= D; d += 8) acc += load8(x + d) * load8(x + d);
    float ss = hsum8(acc);
    for (; d < D; d++) ss += x[d] * x[d];
    float r = 1.0f / sqrtf(ss / D + eps);
    for (d = 0; d < D; d++) out[d] = w[d] * (x[d] * r);
}

/* out = w * x / rms(x), row by row (transformers' order: normalise, then scale). */
void hp_rms_norm(const float *x, int64_t ldx, const float *w, float *out, int M, int D, float eps) {
#pragma omp parallel for schedule(static) if ((int64_t)M * D >= PAR_MIN)
    for (int m = 0; m < M; m++) rms_row(x + m * ldx, w, out + (int64_t)m * D, D, eps);
}

/* residual += x, then out = rms_norm(residual): the residual add of one sublayer fused with the next norm. */
void hp_add_rms_norm(const float *x, float *residual, const float *w, float *out, int M, int D, float eps) {
#pragma omp parallel for schedule(static) if ((int64_t)M * D >= PAR_MIN)
    for (int m = 0; m < M; m++) {
        float *r = residual + (int64_t)m * D;
        const float *xm = x + (int64_t)m * D;
        for (int d = 0; d < D; d++) r[d] += xm[d];
        rms_row(r, w, out + (int64_t)m * D, D, eps);
    }
}

/* Rotary embedding in place on num_heads heads of each token row (the q heads and the k heads that follow them in
 * a fused qkv row): x * cos + rotate_half(x) * sin with tables [max_position, head_dim]. */
void hp_rotary(float *x, int64_t ldx, const int64_t *positions, const float *cos_cache, const float *sin_cache,
               int T, int num_heads, int head_dim) {
    int half = head_dim / 2;
#pragma omp parallel for schedule(static) if ((int64_t)T * num_heads * head_dim >= PAR_MIN)
    for (int t = 0; t < T; t++) {
        const float *c = cos_cache + positions[t] * head_dim, *s = sin_cache + positions[t] * head_dim;
        for (int h = 0; h < num_heads; h++) {
            float *v = x + t * ldx + (int64_t)h * head_dim;
            for (int i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* out [M, I] = silu(gate) * up for gate_up rows [M, 2I]. */
void hp_silu_mul(const float *gate_up, float *out, int M, int I) {
#pragma omp parallel for schedule(static) if ((int64_t)M * I >= PAR_MIN)
    for (int m = 0; m < M; m++) {
        const float *g = gate_up + (int64_t)m * 2 * I, *u = g + I;
        float *o = out + (int64_t)m * I;
        int i = 0;
        for (; i + 8 <= I; i += 8) {
            v8f gv = load8(g + i), y = gv / (splat8(1.0f) + exp8(-gv)) * load8(u + i);
            store8(o + i, y);
        }
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* fp32 -> bfloat16, rounded to nearest even, NaN kept a (quiet) NaN: the bits torch's conversion gives. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* One head's D values (a multiple of 8) as int8 and their scale: d = max |x| / 127, q = x / d rounded to nearest
 * even (x times the rounded 1 / d, as kernels/kv_int8.py computes it), d after the D bytes. */
static void store_head_i8(const float *x, int8_t *dst, int D) {
    float m = 0.0f;
#ifdef __AVX2__
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) amax = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), load8(x + i)), amax);
    for (int i = 0; i < 8; i++) m = fmaxf(m, amax[i]);
#else
    for (int i = 0; i < D; i++) m = fmaxf(m, fabsf(x[i]));
#endif
    const float d = m / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < D; i += 8) {
        const v8f y = load8(x + i) * splat8(inv);
#ifdef __AVX2__
        /* cvtps rounds to nearest even, as lrintf does; |y| <= 127 up to a rounding, which the clamp takes back */
        __m256i q = _mm256_cvtps_epi32((__m256)y);
        q = _mm256_min_epi32(_mm256_max_epi32(q, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)(dst + i), _mm_packs_epi16(w, w));
#else
        for (int j = 0; j < 8; j++) {
            const long r = lrintf(y[j]);
            dst[i + j] = (int8_t)(r > 127 ? 127 : r < -127 ? -127 : r);
        }
#endif
    }
    memcpy(dst + D, &d, sizeof d);
}

static void store_row(const float *src, void *cache, int64_t slot, int heads, int D, int kv_format) {
    const int row = heads * D;
    if (kv_format == HP_KV_F32) {
        memcpy((float *)cache + slot * row, src, sizeof(float) * row);
    } else if (kv_format == HP_KV_BF16) {
        uint16_t *dst = (uint16_t *)cache + slot * row;
        for (int i = 0; i < row; i++) dst[i] = to_bf16(src[i]);
    } else {
        const int64_t hb = kv_head_bytes(D, kv_format);
        for (int h = 0; h < heads; h++) store_head_i8(src + h * D, (int8_t *)cache + (slot * heads + h) * hb, D);
    }
}

/* Copies each token's K and V rows ([num_kv_heads, head_dim], row strides ldk and ldv) into its cache slot, in the
 * pools' element type (enum hp_kv_format). */
void hp_store_kv(const float *k, int64_t ldk, const float *v, int64_t ldv, void *k_cache, void *v_cache,
                 const int64_t *slots, int T, int num_kv_heads, int head_dim, int kv_format) {
    for (int t = 0; t < T; t++) {
        store_row(k + t * ldk, k_cache, slots[t], num_kv_heads, head_dim, kv_format);
        store_row(v + t * ldv, v_cache, slots[t], num_kv_heads, head_dim, kv_format);
    }
}
