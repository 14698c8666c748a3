/* What the Q8X products (linear_q8x.c) and their AMX-INT8 body (arch/x86/amx_int8.c) share: the rows of rounded
 * activations, which weights meet which activation word, and the AMX body's entry. */
#ifndef HARPOON_Q8X_H
#define HARPOON_Q8X_H
#include <stdint.h>

#include "panels.h"

/* One row's activations for Q8X: per 32 k, 8 words of four int8 each (nibble formats: word 2j the even k of k
 * 8j..8j+7, word 2j + 1 the odd, matching a nibble word's low and high nibbles; byte formats: k in order), its d,
 * and the sums of q over each 16 k. */
struct q8x_row {
    const int32_t *words;
    const float *d;
    const int32_t *sums;
};

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
static inline int scales_per_half(int format) { return format == Q6K_PANELS || format == Q6M_PANELS; }

/* LOOP(format) for the block format ``code`` (enum hp_weight_format): one instance per format, each a constant in
 * its own, so each compiles (and OpenMP outlines) a body of its own. */
#define Q8X_FOR_FORMAT(code, LOOP)                                                                                    \
    switch (code) {                                                                                                   \
    case HP_Q4: LOOP(Q4_PANELS) break;                                                                                \
    case HP_Q8: LOOP(Q8_PANELS) break;                                                                                \
    case HP_Q5: LOOP(Q5_PANELS) break;                                                                                \
    case HP_Q6M: LOOP(Q6M_PANELS) break;                                                                              \
    case HP_Q4K: LOOP(Q4K_PANELS) break;                                                                              \
    case HP_Q5K: LOOP(Q5K_PANELS) break;                                                                              \
    default: LOOP(Q6K_PANELS) break;                                                                                  \
    }

/* The Q8X products of a block format (of panels.h) on AMX tiles for all M rows: the bits of the dot-product bodies.
 * Only where hp_q8x_tiles_available() (ops.h). */
void hp_q8x_amx(int format, const struct q8x_row *rows, int M, const void *packed, const float *bias, float *y,
                int64_t ldy, int N, int K);

#endif
