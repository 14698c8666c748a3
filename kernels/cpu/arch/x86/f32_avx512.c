/* fp32 products on AVX-512: an fp32 panel slice (or two side by side) times up to 8 rows, every FMA one of the
 * 16-lane registers (products.h: hp_f32w_rows, hp_f32w2_rows). linear.c calls them from 5 rows on where HP_F32_WIDE;
 * in other builds they are never called. */
#include <stdint.h>

#include "../../panels.h"
#include "../../products.h"

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

void hp_f32w_rows(int m0, int m1, const float *x, int64_t ldx, const float *panel, int kc, float *y, int64_t ldy,
                  int cols, const float *b, int first) {
#define SINGLE(r, xm, ym) micro_kernel_f32w(r, xm, ldx, panel, kc, ym, ldy, cols, b, first)
    EIGHT_ROW_BLOCKS(SINGLE)
#undef SINGLE
}

void hp_f32w2_rows(int m0, int m1, const float *x, int64_t ldx, const float *s0, const float *s1, int kc, float *y,
                   int64_t ldy, const float *b, int first) {
#define PAIR(r, xm, ym) micro_kernel_f32w2(r, xm, ldx, s0, s1, kc, ym, ldy, b, first)
    EIGHT_ROW_BLOCKS(PAIR)
#undef PAIR
}
#else
void hp_f32w_rows(int m0, int m1, const float *x, int64_t ldx, const float *panel, int kc, float *y, int64_t ldy,
                  int cols, const float *b, int first) {
    (void)m0, (void)m1, (void)x, (void)ldx, (void)panel, (void)kc, (void)y, (void)ldy, (void)cols, (void)b, (void)first;
}
void hp_f32w2_rows(int m0, int m1, const float *x, int64_t ldx, const float *s0, const float *s1, int kc, float *y,
                   int64_t ldy, const float *b, int first) {
    (void)m0, (void)m1, (void)x, (void)ldx, (void)s0, (void)s1, (void)kc, (void)y, (void)ldy, (void)b, (void)first;
}
#endif
