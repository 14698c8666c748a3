/* The exact products' register body: MRF rows times one panel slice, any format of panels.h widened to fp32 in
 * registers (micro_kernel), and a run of rows in blocks of MRF (panel_rows). linear.c runs the products through it;
 * lm_head.c recomputes single columns with it, so both give the same bits. */
#ifndef HARPOON_MICRO_KERNEL_H
#define HARPOON_MICRO_KERNEL_H
#include "panels.h"

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
                                                               int first, int format, int ahead) {
    v8f c[MRF][NV], b[NV];
#pragma GCC unroll 8
    for (int i = 0; i < MRF; i++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) c[i][v] = (v8f){0};
    if (format == F32_PANELS) {
        for (int k = 0; k < kc; k++) {
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) b[v] = load8((const float *)panel + (int64_t)k * NR + 8 * v);
            prefetch_ahead((const float *)panel + (int64_t)k * NR, NR * 4, ahead);
            accumulate(rows, c, x, ldx, k, b);
        }
    } else if (format == I8_PANELS || format == BF16_PANELS) { /* 4 or 2 consecutive k in each 32-bit lane */
        const int bf16 = format == BF16_PANELS, per_word = bf16 ? 2 : 4;
        for (int k = 0; k < kc; k += per_word) {
            const v8iu *words = (const v8iu *)((const char *)panel + (int64_t)k * NR * (bf16 ? 2 : 1));
            prefetch_ahead(words, NV * 32, ahead);
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
            prefetch_ahead(words, slice_group_bytes(format), ahead);
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


/* Rows m0..m1 of y (+)= x . one panel slice (kc x NR), in blocks of MRF rows; x and y start at the slice's k0, n0. */
static inline __attribute__((always_inline)) void panel_rows(int m0, int m1, const float *x, int64_t ldx,
                                                             const void *panel, int kc, float *y, int64_t ldy,
                                                             int cols, const float *b, const float *sc, int first,
                                                             int format) {
    _Static_assert(MRF <= 8 && (MRF == 8 || MRF <= 5), "panel_rows has a case for every row count below MRF");
    for (int m = m0; m < m1; m += MRF) {
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
        const int pf = m == m0 ? PANEL_AHEAD : 0; /* the first rows' pass prefetches; the later find the slice cached */
        switch (m1 - m < MRF ? m1 - m : MRF) {
        /* a constant row count per call, so each case compiles to its own unrolled kernel */
        case 1: micro_kernel(1, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format, pf); break;
        case 2: micro_kernel(2, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format, pf); break;
#if MRF > 3
        case 3: micro_kernel(3, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format, pf); break;
#endif
#if MRF > 4
        case 4: micro_kernel(4, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format, pf); break;
#endif
#if MRF > 5
        case 5: micro_kernel(5, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format, pf); break;
        case 6: micro_kernel(6, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format, pf); break;
        case 7: micro_kernel(7, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format, pf); break;
#endif
        default: micro_kernel(MRF, xm, ldx, panel, kc, ym, ldy, cols, b, sc, first, format, pf); break;
        }
    }
}

#endif
