/* The products of packed weights: y = x . w^T (+ bias) for fp32 activations and panels of any format (panels.h),
 * and the dispatch by format (hp_linear_packed) to the bodies of the other files (products.h): BF16C panels to
 * linear_bf16.c, int8 activations to linear_q8x.c, the AMX formats to arch/x86/amx_bf16.c. The exact products of
 * every fp32 and compact format run here, with the same bits from every format of the same weights.
 *
 * Why C: on a small CPU a decode step is a few hundred tiny operations. Torch spends more time dispatching them;
 * these kernels stream the weights of a skinny matmul exactly once. Plain C with GCC vector extensions and OpenMP,
 * so it builds with -march=native on any x86-64 or ARM host. Every pointer is fp32 and contiguous unless a stride or
 * a format argument says otherwise. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "micro_kernel.h"
#include "products.h"

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

/* panel_rows over an fp32 slice, compiled on its own. NOTE: inlined into the Q4 product's loop beside the Q4
 * micro-kernels, its MR-row kernel spilled an accumulator inside the k loop and ran at half speed. */
static __attribute__((noinline)) void panel_rows_f32_narrow(int m0, int m1, const float *x, int64_t ldx,
                                                            const float *panel, int kc, float *y, int64_t ldy,
                                                            int cols, const float *b, int first) {
    panel_rows(m0, m1, x, ldx, panel, kc, y, ldy, cols, b, 0, first, F32_PANELS);
}

/* Rows m0..m1 of y (+)= x . an fp32 panel slice: 16-lane FMAs where the build has them (arch/x86/f32_avx512.c). */
static inline void panel_rows_f32(int m0, int m1, const float *x, int64_t ldx, const float *panel, int kc, float *y,
                                  int64_t ldy, int cols, const float *b, int first) {
    if (HP_F32_WIDE)
        hp_f32w_rows(m0, m1, x, ldx, panel, kc, y, ldy, cols, b, first);
    else
        panel_rows_f32_narrow(m0, m1, x, ldx, panel, kc, y, ldy, cols, b, first);
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
    if (!HP_F32_WIDE) return; /* never called: panel_pairs gives none */
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
        hp_f32w2_rows(m0, m1, x + k0, ldx, (const float *)a, (const float *)b, kc, y + n0, ldy,
                      bias && last ? bias + n0 : 0, first);
    }
}

/* NOTE: a product's parallel loop shares its panels out guided: each thread takes a long run of consecutive panels
 * (the first thread half of them, the next half of the rest, ...), and the runs shrink to one panel at the end, so
 * the threads still even out when another process takes a core. A thread's weights are then long spans that the
 * hardware prefetchers follow. Why: with one panel per task (dynamic, 1) the threads took alternate panels and each
 * one's reads jumped at every panel; with two runs a thread (1-4 rows) the runs were shorter. Guided took 4-9% off
 * a step's Q4 products at 1-110 rows (fp32 activations), 13-19% with int8 activations at 16-64 rows, 1-12% off
 * fp32 panels' (docs/benchmarks.md). */

/* The bodies of the fp32 products from MRF + 1 rows on (enum hp_f32_body): each panel on its own
 * (micro_kernel_f32w), or whole panels two at a time (micro_kernel_f32w2), the same bits. The backend times both at
 * start-up and names the faster in each product word (HP_F32_BODY_AT); pairs by default where built. */
int hp_f32_bodies(void) { return 1 << HP_F32_PANELS | (HP_F32_WIDE ? 1 << HP_F32_PAIRS : 0); }

/* Pairs of whole panels a product's loop takes as one task each (panel_pair_product): all of them where its rows
 * are compute-bound (more than MRF) and the body ``f32`` is pairs (and built), else none. The int8 panels keep their
 * own kernel. */
static inline int panel_pairs(int M, int N, int format, int f32) {
    return HP_F32_WIDE && f32 == HP_F32_PAIRS && M > MRF && format != I8_PANELS ? N / NR / 2 : 0;
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
#define LINEAR_LOOP(bias, scales, format, f32)                                                                        \
    const int pairs = panel_pairs(M, N, format, f32), panels = (N + NR - 1) / NR;                                     \
    for (int m0 = 0; m0 < M; m0 += ROW_BLOCK) {                                                                       \
        int m1 = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;                                                             \
        _Pragma("omp parallel for schedule(guided)") for (int t = 0; t < panels - pairs; t++) {                       \
            if (t < pairs)                                                                                            \
                panel_pair_product(2 * t, m0, m1, x, ldx, packed, bias, y, ldy, K, format);                           \
            else                                                                                                      \
                panel_product(t + pairs, m0, m1, x, ldx, packed, bias, scales, y, ldy, N, K, format);                 \
        }                                                                                                             \
    }

/* hp_linear_packed for fp32 panels with this build's default bodies. */
void hp_linear(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy, int M,
               int N, int K) {
    hp_linear_packed(HP_F32, x, ldx, packed, bias, y, ldy, M, N, K);
}

/* hp_linear for the same weights packed in any format of enum hp_weight_format but HP_I8, with the same bits:
 *   Q4 panels (kernels/cpu/blocks.py; K % Q4_GROUP == 0): 0.75 bytes a weight instead of 4;
 *   Q8 panels (kernels/cpu/blocks.py; K % Q8_GROUP == 0): 1.125 bytes a weight;
 *   Q5 and Q6M panels (kernels/cpu/blocks.py; K % Q8_GROUP == 0): 1.25 and 1.5 bytes a weight;
 *   Q4K, Q5K and Q6K panels (GGUF's K-quant scales as they are; K % 256 == 0): 0.5625, 1.06 and 0.83;
 *   BF16 panels (every weight's low 16 bits zero; K % 2 == 0): half the bytes.
 * One or a few rows dequantize in registers, so a decode step at a small batch streams only the compact bytes from
 * memory; more rows share one fp32 copy of each panel slice. */
void hp_linear_packed(int word, const float *x, int64_t ldx, const void *packed, const float *bias, float *y,
                      int64_t ldy, int M, int N, int K) {
    const int format = word & HP_FORMAT_BITS, f32 = hp_f32_body(word, HP_F32_WIDE);
    /* int8 activations where asked, the format a block format and the CPU able */
    if (word & HP_Q8X && hp_q8x_available() && format != HP_F32 && format != HP_I8 && format != HP_BF16 &&
        format != HP_BF16C) {
        hp_linear_q8x(word, x, ldx, packed, bias, y, ldy, M, N, K);
        return;
    }
    if (format == HP_Q4) {
        LINEAR_LOOP(bias, 0, Q4_PANELS, f32)
    } else if (format == HP_Q8) {
        LINEAR_LOOP(bias, 0, Q8_PANELS, f32)
    } else if (format == HP_Q5) {
        LINEAR_LOOP(bias, 0, Q5_PANELS, f32)
    } else if (format == HP_Q6M) {
        LINEAR_LOOP(bias, 0, Q6M_PANELS, f32)
    } else if (format == HP_Q4K) {
        LINEAR_LOOP(bias, 0, Q4K_PANELS, f32)
    } else if (format == HP_Q5K) {
        LINEAR_LOOP(bias, 0, Q5K_PANELS, f32)
    } else if (format == HP_Q6K) {
        LINEAR_LOOP(bias, 0, Q6K_PANELS, f32)
    } else if (format == HP_BF16) {
        LINEAR_LOOP(bias, 0, BF16_PANELS, f32)
    } else if (format == HP_BF16C) {
        hp_linear_bf16c(hp_bf16_body(word), x, ldx, packed, bias, y, ldy, M, N, K);
    } else if (hp_split_format(format) || format == HP_BF16A || format == HP_Q4A || format == HP_Q6A ||
               format == HP_Q8A) {
        /* packed only where AMX runs (kernels/cpu/packing.py): NaN, never garbage */
        const int failed = hp_split_format(format)
                               ? hp_linear_split_amx(format, x, ldx, packed, bias, y, ldy, M, N, K)
                               : hp_linear_bf16c_amx(x, ldx, packed, HP_BF16A_WIDTH, format == HP_BF16A ? 0 : format,
                                                     bias, y, ldy, M, N, K);
        if (failed)
            for (int m = 0; m < M; m++)
                for (int n = 0; n < N; n++) y[m * ldy + n] = NAN;
    } else {
        LINEAR_LOOP(bias, 0, F32_PANELS, f32)
    }
}

/* y [M, N] ~= x . w^T for int8 panels and per-column scales [>= N]: a quarter of the fp32 weight's bytes, for
 * products whose error is bounded and checked by the caller (the LM head's screened argmax). A panel is
 * [K / 4, NV, 8, 4]: lane l of vector v holds column 8 v + l at four consecutive k, low byte first; K % 4 == 0. */
void hp_linear_i8(const float *x, int64_t ldx, const signed char *packed, const float *scales, float *y, int64_t ldy,
                  int M, int N, int K) {
    LINEAR_LOOP(0, scales, I8_PANELS, HP_F32_PANELS)
}
