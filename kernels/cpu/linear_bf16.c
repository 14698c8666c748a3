/* BF16C: a bfloat16 model's products, computed in bfloat16.
 * The weights are BF16 panels (two consecutive k of a column per 32-bit lane, the even k in the low half); the
 * activations are rounded to bfloat16 (nearest even) once per call, as pairs of k in 32-bit words the same way. Each
 * output then sums the exact products of the pairs in fp32, per pair the odd k first, as vdpbf16ps does:
 *     c += x[2i+1] w[2i+1];  c += x[2i] w[2i]        (each product of two bfloat16 is exact in fp32)
 * Where the compiler targets avx512_bf16 the micro-kernel is that instruction; elsewhere the same sums are FMAs on the
 * widened values, with the same bits (but for subnormal inputs, which the instruction reads as zero). Why: twice the
 * products per instruction of fp32 FMAs, and half the bytes of fp32 panels, with no per-step widening. The sums run
 * in the same order whatever the number of rows, so a row's result does not depend on its batch. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "panels.h"
#include "products.h"

/* Rows a BF16C micro-kernel takes: with 32 registers 8 rows x 3 vectors = 24 accumulators, + 3 weight vectors + 1
 * broadcast: 28 of them; with 16, 4 rows. */
#define MRB (HP_VREGS == 32 ? 8 : 4)

static inline v8f bf16_pair_lo(uint32_t w) { return splat8(((union { uint32_t u; float f; }){w << 16}).f); }
static inline v8f bf16_pair_hi(uint32_t w) { return splat8(((union { uint32_t u; float f; }){w & 0xffff0000u}).f); }

/* The bodies that can compute BF16C products (enum hp_bf16_dot): the FMAs always, avx512_bf16's dot product where the
 * CPU has it, AMX tiles (arch/x86/amx_bf16.c: their own bits) where it has them. The backend times every one at
 * start-up and names the fastest in each product word (HP_BF16_BODY_AT). */
int hp_bf16_dots(void) {
    return 1 << HP_BF16_FMA | (HP_NATIVE_BF16 ? 1 << HP_BF16_DPBF16 : 0) |
           (hp_amx_bf16_available() ? 1 << HP_BF16_AMX : 0);
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
 * twin (a compile-time constant in each instance); ``ahead`` as micro_kernel's. */
static inline __attribute__((always_inline)) void micro_kernel_bf16c(int rows, const uint32_t *a, const void *panel,
                                                                     int kc, float *y, int64_t ldy, int cols,
                                                                     const float *bias, int first, int native,
                                                                     int ahead) {
    v8f c[MRB][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MRB; i++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) c[i][v] = (v8f){0};
    for (int k = 0; k < kc; k += 2) {
        const v8iu *words = (const v8iu *)((const char *)panel + (int64_t)k * NR * 2);
        const uint32_t *ak = a + (int64_t)(k / 2) * MRB;
        prefetch_ahead(words, NV * 32, ahead);
        v8i w[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) w[v] = words[v];
        if (HP_NATIVE_BF16 && native) {
#pragma GCC unroll 8
            for (int i = 0; i < MRB; i++) {
                if (i >= rows) break;
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) c[i][v] = dpbf16(c[i][v], ak[i], w[v]);
            }
            continue;
        }
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
        const int pf = m == m0 ? PANEL_AHEAD : 0; /* as panel_rows's */
        switch (m1 - m < MRB ? m1 - m : MRB) {
#define ROWS(r) \
    case r: micro_kernel_bf16c(r, ag, panel, kc, ym, ldy, cols, b, first, native, pf); break;
            ROWS(1) ROWS(2) ROWS(3)
#if MRB > 4
            ROWS(4) ROWS(5) ROWS(6) ROWS(7)
#endif
#undef ROWS
        default: micro_kernel_bf16c(MRB, ag, panel, kc, ym, ldy, cols, b, first, native, pf); break;
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
void hp_linear_bf16c(int body, const float *x, int64_t ldx, const void *packed, const float *bias, float *y,
                     int64_t ldy, int M, int N, int K) {
    if (body == HP_BF16_AMX && hp_linear_bf16c_amx(x, ldx, packed, NR, 0, bias, y, ldy, M, N, K) == 0) return;
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
        if (body != HP_BF16_FMA && HP_NATIVE_BF16) {
#pragma omp parallel for schedule(guided)
            for (int p = 0; p < (N + NR - 1) / NR; p++)
                panel_product_bf16c_native(p, m0, m1, a, packed, bias, y, ldy, N, K);
        } else {
#pragma omp parallel for schedule(guided)
            for (int p = 0; p < (N + NR - 1) / NR; p++)
                panel_product_bf16c_fma(p, m0, m1, a, packed, bias, y, ldy, N, K);
        }
    }
}

