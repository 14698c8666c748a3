/* The portable vector types and helpers every kernel file shares: GCC vector extensions of 8 floats or ints (one
 * AVX2 register) and 16 floats (one AVX-512 register, or two AVX ones), so any -march builds them. Nothing here
 * tests the instruction set (arch/simd.h does). */
#ifndef HARPOON_VEC_H
#define HARPOON_VEC_H
#include <stdint.h>

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int v8i __attribute__((vector_size(32)));
typedef int v8iu __attribute__((vector_size(32), aligned(4))); /* eight ints at any 4-byte boundary */
typedef float v16f __attribute__((vector_size(64), aligned(4)));

static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }
static inline v8i splat8i(int x) { return (v8i){x, x, x, x, x, x, x, x}; }

/* Lanes of a where mask is set (all ones), of b elsewhere. */
static inline v8f select8(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }

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

#endif
