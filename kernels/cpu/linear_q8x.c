/* Q8X: block panels times activations rounded to int8, as llama.cpp multiplies a GGUF file.
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
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "products.h"
#include "q8x.h"

/* The Q8X dot products this build has (bit 0: VNNI's u8 x s8, bit 1: AVX2's s8 x s8; enum hp_q8x_dot): the backend
 * times both where both exist and names the faster in each product word (HP_Q8X_DOT_AT). */
#define Q8X_VNNI HP_Q8X_VNNI
#define Q8X_MADDUBS HP_Q8X_MADDUBS
int hp_q8x_dots(void) { return (HP_DOT_U8S8 ? 1 << Q8X_VNNI : 0) | (HP_DOT_S8S8 ? 1 << Q8X_MADDUBS : 0); }
int hp_q8x_available(void) { return hp_q8x_dots() != 0; }

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

/* One row's integer sums of a run of k with one weight scale (half h of block b), folded into its float sums c:
 *     c += d_w (d_x (Σ u qx - offset Σ qx)) (+ m_w d_x Σ qx)
 * Every body does exactly this, so a row's outputs do not depend on the body its batch took. */
static inline __attribute__((always_inline)) void q8x_fix_up(v8f c[NV], const v8i acc[NV], const struct q8x_row *a,
                                                             int b, int h, const v8f d[NV], const v8f m[NV],
                                                             float offset, int format) {
    const int halves = scales_per_half(format);
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
#define Q8X_SUMS(R, rows, a, b0, panel, kc, format, dot, early, ahead, fix_up)                                        \
    do {                                                                                                              \
        const int unsigned_bytes_ = !block_nibbles(format) && (dot) == Q8X_VNNI;                                      \
        const v8i offset_bits_ = splat8i(unsigned_bytes_ ? (int)0x80808080 : 0);                                      \
        const int halves_ = scales_per_half(format);                                                                   \
        /* maddubs on nibbles: a 32-k block's 8 words summed in 16 bits (8 x 2 x 15 x 127 = 30480), widened once */   \
        const int sums16_ = (dot) == Q8X_MADDUBS && ((format) == Q4_PANELS || (format) == Q4K_PANELS);                \
        /* Q6K's q + 32, Q5's and Q5K's q (0..31): unsigned bytes, their pairs widened each word */                  \
        const int unsigned_ = (dot) == Q8X_MADDUBS                                                                    \
            && ((format) == Q6K_PANELS || (format) == Q5_PANELS || (format) == Q5K_PANELS);                           \
        for (int k = 0; k < (kc); k += Q8_GROUP) {                                                                    \
            const int b = (b0) + k / Q8_GROUP;                                                                        \
            v8f d[2][NV], m[2][NV];                                                                                   \
            const v8iu *words = block_at(panel, k, format, 0, &d[0][0], &d[1][0], &m[0][0], &m[1][0]);              \
            prefetch_ahead(words, slice_group_bytes(format), ahead);                                                  \
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
 * steps of micro_kernel. Its float sums stay in registers. ``early`` as Q8X_SUMS's; ``ahead``: bytes to prefetch
 * ahead of the weights (PANEL_AHEAD), 0 for none. */
static inline __attribute__((always_inline)) void micro_kernel_q8x(int rows, const struct q8x_row *a, int b0,
                                                                   const void *panel, int kc, float *y, int64_t ldy,
                                                                   int cols, const float *bias, int first,
                                                                   int format, int dot, int early, int ahead) {
    const float offset = q8x_offset(format, dot);
    v8f c[MR][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) c[i][v] = (v8f){0};
#define FIX_UP(i, h, d, m, acc) q8x_fix_up(c[i], acc, a + (i), b, h, d, m, offset, format)
    Q8X_SUMS(MR, rows, a, b0, panel, kc, format, dot, early, ahead, FIX_UP);
#undef FIX_UP
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        if (i >= rows) break;
        store_tile_row(y + i * ldy, c[i], cols, bias, first);
    }
}

/* Rows of the wide Q8X body: its integer sums (MRQ x NV) take 24 of the 32 vector registers, so its float sums live
 * in a tile in L1 instead, loaded and stored once a weight scale. Where there are 16 registers it is not taken. */
#define MRQ 8
/* micro_kernel_q8x for MRQ rows and a whole panel (cols == NR). Why: at 64 rows the 4-row body kept its 24 sums in
 * 32 registers with its scales, its spills were a third of its loads, and its products ran at ~30% of the dot
 * product's rate. */
static inline __attribute__((always_inline)) void micro_kernel_q8x_wide(const struct q8x_row *a, int b0,
                                                                        const void *panel, int kc, float *y,
                                                                        int64_t ldy, const float *bias, int first,
                                                                        int format, int dot, int ahead) {
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
    Q8X_SUMS(MRQ, MRQ, a, b0, panel, kc, format, dot, 0, ahead, FIX_UP);
#undef FIX_UP
#pragma GCC unroll 8
    for (int i = 0; i < MRQ; i++) {
        v8f c[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) c[v] = load8(tile[i] + 8 * v);
        store_tile_row(y + i * ldy, c, NR, bias, first);
    }
}

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
                             format, dot, 1, PANEL_AHEAD);
        else {
            int m = m0;
            if (HP_VREGS == 32 && cols == NR)
                for (; m + MRQ <= m1; m += MRQ)
                    micro_kernel_q8x_wide(rows + m, k0 / Q8_GROUP, panel, kc, y + m * ldy + n0, ldy, b, k0 == 0,
                                          format, dot, m == m0 ? PANEL_AHEAD : 0);
            for (; m < m1; m += MR)
                micro_kernel_q8x(m1 - m < MR ? m1 - m : MR, rows + m, k0 / Q8_GROUP, panel, kc, y + m * ldy + n0,
                                 ldy, cols, b, k0 == 0, format, dot, 0, m == m0 ? PANEL_AHEAD : 0);
        }
    }
}

/* Rows per block of a Q8X product: a block's int8 rows (K bytes each) stay in L2 while the panels pass over them. */
#define Q8X_ROW_BLOCK 128

#define Q8X_LOOP_DOT(format, dot)                                                                                     \
    for (int m0 = 0; m0 < M; m0 += Q8X_ROW_BLOCK) {                                                                   \
        const int m1 = m0 + Q8X_ROW_BLOCK < M ? m0 + Q8X_ROW_BLOCK : M;                                               \
        _Pragma("omp parallel for schedule(guided)") for (int p = 0; p < (N + NR - 1) / NR; p++)                     \
            panel_product_q8x(p, m0, m1, rows, packed, bias, y, ldy, N, K, format, dot);                              \
    }
#define Q8X_LOOP(format)                                                                                              \
    if (tile_rows && M >= tile_rows) {                                                                                \
        hp_q8x_amx(format, rows, M, packed, bias, y, ldy, N, K);                                                      \
    } else if (dot == Q8X_VNNI && HP_DOT_U8S8) {                                                                      \
        Q8X_LOOP_DOT(format, Q8X_VNNI)                                                                                \
    } else {                                                                                                          \
        Q8X_LOOP_DOT(format, Q8X_MADDUBS)                                                                             \
    }

/* hp_linear_packed for a block format with HP_Q8X. The int8 rows live in a buffer of the calling thread, grown as
 * needed and kept: a decode step calls this ~4 times a layer. ``word``: the format and its body fields (ops.h).
 * NOTE: faster than the exact products at every row count measured (1.4-3.3x from 1 to 256 rows on the AMD EPYC,
 * Q4_K, Q6_K, Q8_0 and mixed panels of an 8192 x 2048 weight), so it takes every call it is asked for. */
void hp_linear_q8x(int word, const float *x, int64_t ldx, const void *packed, const float *bias, float *y,
                   int64_t ldy, int M, int N, int K) {
    const int format = word & HP_FORMAT_BITS, dot = hp_q8x_dot(word);
    /* the tiles only where this CPU lets the process use them; elsewhere the word's rows are never taken */
    const int tile_rows = hp_q8x_tiles_available() ? hp_q8x_tile_rows(word) : 0;
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
    Q8X_FOR_FORMAT(format, Q8X_LOOP)
}
