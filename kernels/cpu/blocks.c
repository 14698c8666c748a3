/* Finding the 4- and 8-bit blocks that a linear weight's fp32 values exactly are (kernels/cpu/blocks.py says why:
 * such weights are held as Q4 or Q8 panels, whose products have the bits of the fp32 panels').
 *
 * Why C: the search runs once per weight at load. In torch it took 12-47 ns a weight (a block's candidates are
 * tried in turn, Q4_K's with a sort and up to 16 fits over the whole block), over half a minute for a Q4_K model of
 * 1B weights and longer than gguf's own dequantization of the file. Here each candidate stops at the first value it
 * does not rebuild, and the smallest gap needs no sort: 3-5 ns a weight on two cores (python -m
 * loadtest.find_blocks).
 *
 * A weight [N, K] is seen as N K / 32 blocks of 32 consecutive inputs (GGUF's block). A block takes the first
 * candidate scale that rebuilds every one of its values; a weight is taken only if every block is. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ops.h"
#include "vec.h"

#define GROUP 32      /* inputs per block: Q4_GROUP and Q8_GROUP in ops.c, as GGUF's */
#define SCALE_BITS 17 /* significant bits of an fp16 times a 6-bit integer: a K-quant sub-block's scale or min */

/* x rounded to the nearest fp16 value (ties to even, as torch's .half()), as a float. NOTE: by hand, not _Float16,
 * which GCC has on x86 only from version 12. */
static inline float fp16_value(float x) {
    float a = fabsf(x);
    if (!(a < 65520.0f)) return a == a ? copysignf(INFINITY, x) : x; /* past the largest half-way point, or NaN */
    if (a < 0x1p-14f) return nearbyintf(x * 0x1p24f) * 0x1p-24f;  /* subnormal: multiples of 2^-24 */
    uint32_t i;
    memcpy(&i, &x, sizeof i);
    i = (i + 0xFFFu + ((i >> 13) & 1u)) & ~0x1FFFu; /* 11 significant bits, to nearest even */
    memcpy(&x, &i, sizeof x);
    return x;
}

/* x rounded to `bits` significant bits (half away from zero), as a candidate for a scale that has that many; the
 * exact check decides. */
static inline float round_bits(float x, int bits) {
    uint32_t i, drop = 24 - bits;
    memcpy(&i, &x, sizeof i);
    i = (i + (1u << (drop - 1))) & ~((1u << drop) - 1);
    memcpy(&x, &i, sizeof x);
    return x;
}

/* q = the nearest of 0..15 to (x - m) / d for each value; whether d q + m gives back every value. NOTE: by value,
 * so a -0.0 weight may come back +0.0 (GGUF Q4_0 with a negative d gives -0.0 where q = 8; d q + m cannot): the
 * panels' products still have the bits of the fp32 panels', as an accumulator that starts at +0.0 never becomes
 * -0.0. d q is exact (d of at most 17 significant bits, q of 4), so fused or not the add rounds once, as in the
 * kernel. */
static int fit_q4(const float *x, float d, float m, uint8_t *q) {
    float step = d != 0.0f ? d : 1.0f;
    for (int i = 0; i < GROUP; i++) {
        float v = nearbyintf((x[i] - m) / step);
        q[i] = (uint8_t)(v > 15.0f ? 15.0f : v >= 0.0f ? v : 0.0f);
        if (d * q[i] + m != x[i]) return 0; /* from the integer, as the kernel rebuilds it */
    }
    return 1;
}

/* The smallest positive difference between two values of a block (infinite where all are one value): for each
 * value, the next larger one less it: the same differences as a sort's neighbours, in 32 x 4 vector steps (an
 * insertion sort in their place tripled the whole search's time on Q4_K). */
static float smallest_gap(const float *x) {
    float gap = INFINITY;
    for (int i = 0; i < GROUP; i++) {
        v8f next = splat8(INFINITY), xi = splat8(x[i]);
        for (int j = 0; j < GROUP; j += 8) {
            v8f v = *(const v8f *)(x + j);
            next = select8((v > xi) & (v < next), v, next);
        }
        float up = next[0];
        for (int k = 1; k < 8; k++) up = next[k] < up ? next[k] : up;
        if (up - x[i] < gap) gap = up - x[i];
    }
    return gap;
}

/* One block as d q + m, q in 0..15, trying the scales of GGUF's 4-bit formats in turn:
 * - Q4_1: m is the block's smallest value and d its range over 15, both fp16 (its quantizer maps the smallest
 *   value to q = 0 and the largest to 15).
 * - Q4_0, d' (q - 8) with d' fp16: its quantizer maps the value of largest magnitude to q = 0, so that value is
 *   -8 d'; as d q + m, d = |d'| and m = -8 d (d' > 0) or -7 d (d' < 0, q reversed).
 * - Q4_K: d and m (minus the sub-block's min) are each an fp16 times a 6-bit integer, so of at most 17 significant
 *   bits, and its blocks need not reach q = 0 or 15. First d = the range over 15 and m = the smallest value,
 *   rounded to 17 bits; then d = the range over the steps it spans (counted in the smallest gap between two
 *   values) and m = the smallest value less d q_low, for each q_low it could have. */
static int find_q4(const float *x, float *d, float *m, uint8_t *q) {
    float low = x[0], high = x[0];
    for (int i = 0; i < GROUP; i++) {
        if (!isfinite(x[i])) return 0;
        low = x[i] < low ? x[i] : low;
        high = x[i] > high ? x[i] : high;
    }
    float span = high - low;
    if (fit_q4(x, *d = fp16_value(span / 15), *m = fp16_value(low), q)) return 1;
    float largest = -low > high ? low : high, step = fabsf(largest) / 8;
    if (fp16_value(step) == step && fit_q4(x, *d = step, *m = largest < 0 ? -8 * step : -7 * step, q)) return 1;
    if (fit_q4(x, *d = round_bits(span / 15, SCALE_BITS), *m = round_bits(low, SCALE_BITS), q)) return 1;
    float gap = smallest_gap(x);
    float steps = isfinite(gap) ? nearbyintf(span / gap) : 1.0f;
    step = round_bits(span / steps, SCALE_BITS); /* 0 for a block of one value */
    for (int q_low = 0; q_low < 16; q_low++)
        if (fit_q4(x, *d = step, *m = round_bits((float)((double)low - (double)step * q_low), SCALE_BITS), q))
            return 1;
    return 0;
}

/* q = the nearest of -127..127 to x / d for each value; whether d q gives back every value bit for bit (so a -0.0
 * weight only where d q gives it, d <= -0.0), with d a finite fp16 value (so d q is exact). */
static int fit_q8(const float *x, float d, int8_t *q) {
    float step = d != 0.0f ? d : 1.0f;
    if (!isfinite(d) || fp16_value(d) != d) return 0;
    for (int i = 0; i < GROUP; i++) {
        float v = nearbyintf(x[i] / step);
        q[i] = (int8_t)(v > 127.0f ? 127.0f : v >= -127.0f ? v : -127.0f);
        float r = d * q[i]; /* from the integer: a q of -0.0 would give back a -0.0 that the kernel cannot */
        if (memcmp(&r, x + i, sizeof r)) return 0;
    }
    return 1;
}

/* One block as d q, d an fp16 value and q in -127..127, trying in turn the d of GGUF's Q8_0 (the largest magnitude
 * over 127, as its quantizer maps that value to q = +-127) and of Q5_0 (d (q - 16) with q in 0..31: minus the value
 * of largest magnitude over 16, as its quantizer maps that to q = 0). A block of zeros keeps their sign in d (gguf's
 * quantizer gives a -0.0 d for it, and d 0 = -0.0). */
static int find_q8(const float *x, float *d, int8_t *q) {
    float largest = x[0];
    for (int i = 0; i < GROUP; i++) {
        if (isnan(x[i])) return 0;
        if (fabsf(x[i]) > fabsf(largest)) largest = x[i]; /* the first of the largest magnitude */
    }
    if (fit_q8(x, *d = fabsf(largest) / 127, q)) return 1;
    return fit_q8(x, *d = largest == 0 ? largest : largest / -16, q);
}

/* Blocks of w [num_blocks, 32] as HP_Q4 (d, m [num_blocks], q [num_blocks, 32] uint8) or HP_Q8 (d, q int8; m is
 * not written) blocks. Returns 0 where every block is found, 1 where some is not (then the outputs are partial: the
 * threads stop at the first such block). */
int hp_find_blocks(int format, const float *w, int64_t num_blocks, float *d, float *m, void *q) {
    int missed = 0;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < num_blocks; b++) {
        int stop;
#pragma omp atomic read
        stop = missed;
        if (stop) continue;
        int found = format == HP_Q4 ? find_q4(w + b * GROUP, d + b, m + b, (uint8_t *)q + b * GROUP)
                                    : find_q8(w + b * GROUP, d + b, (int8_t *)q + b * GROUP);
        if (!found) {
#pragma omp atomic write
            missed = 1;
        }
    }
    return missed;
}
