/* Every test of the CPU's instruction set outside the ISA-named files beside this one: what the build has, as
 * constants (HP_AVX512, HP_VREGS, HP_NATIVE_BF16, HP_DOT_U8S8, HP_DOT_S8S8), and each small operation that has an
 * intrinsic body on one ISA and a portable one elsewhere (the role of ggml-cpu's simd-mappings.h). The kernels test
 * the constants with a plain `if`, so both paths compile everywhere and the one not taken is dropped; where a body
 * exists only for one ISA its twin here is never called and says so.
 *
 * Built with -march=native: the compiler's predefined macros are the CPU's features. */
#ifndef HARPOON_ARCH_SIMD_H
#define HARPOON_ARCH_SIMD_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../vec.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

/* AVX-512 (foundation): sixteen-float registers. */
#ifdef __AVX512F__
#define HP_AVX512 1
#else
#define HP_AVX512 0
#endif
/* Vector registers an eight-float vector may live in: 32 with AVX-512's VL (ymm16-31), else 16. The register-tile
 * sizes (MRF, MRB, MRQ, ATT_GT) follow from it. */
#if defined(__AVX512F__) && defined(__AVX512VL__)
#define HP_VREGS 32
#else
#define HP_VREGS 16
#endif
/* vdpbf16ps: 16 bfloat16 products summed per 8 lanes per instruction. */
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define HP_NATIVE_BF16 1
#else
#define HP_NATIVE_BF16 0
#endif

/* c + the pair products of a's two bfloat16 (the odd k in its high half) and w's, per lane: avx512_bf16's dot
 * product. Only where HP_NATIVE_BF16. */
static inline v8f dpbf16(v8f c, uint32_t a, v8i w) {
#if HP_NATIVE_BF16
    return (v8f)_mm256_dpbf16_ps((__m256)c, (__m256bh)_mm256_set1_epi32((int)a), (__m256bh)w);
#else
    (void)a, (void)w;
    return c; /* never called */
#endif
}

/* u8 x s8 dot products, four a 32-bit lane (the Q8X products, linear_q8x.c) */
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

/* Eight fp16 values at p as floats (exact). NOTE: GCC 12 converts a vector of _Float16 one element at a time (a
 * 1-row Q4K product took 1.5x as long), so F16C's instruction is named where the CPU has it. */
#if defined(__AVX2__) && defined(__F16C__)
static inline v8f half8(const void *p) { return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
static inline v8f half8(const void *p) {
    v8f r;
    for (int i = 0; i < 8; i++) r[i] = (float)((const _Float16 *)p)[i];
    return r;
}
#endif

/* Eight int8 values at p as floats (exact). */
static inline v8f widen8_i8(const int8_t *p) {
#ifdef __AVX2__
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    typedef int8_t v8b __attribute__((vector_size(8), aligned(1)));
    return __builtin_convertvector(*(const v8b *)p, v8f);
#endif
}

/* Eight bfloat16 values at p as floats (exact). */
static inline v8f widen8_bf16(const uint16_t *p) {
#ifdef __AVX2__
    return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
    typedef uint32_t v8u __attribute__((vector_size(32)));
    return (v8f)(__builtin_convertvector(*(const v8h *)p, v8u) << 16);
#endif
}

/* Sixteen floats as two halves (the attention's pairs of positions, attention.c): [lo | hi], x in every lane, the
 * eight at q twice, and each half back. One AVX-512 register where HP_AVX512; two AVX registers elsewhere. */
static inline v16f pair8(v8f lo, v8f hi) {
#ifdef __AVX512F__
    return (v16f)_mm512_insertf64x4(_mm512_castpd256_pd512((__m256d)lo), (__m256d)hi, 1);
#else
    v16f r;
    memcpy(&r, &lo, sizeof lo);
    memcpy((char *)&r + sizeof lo, &hi, sizeof hi);
    return r;
#endif
}
static inline v16f splat16(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline v16f q8x2(const float *q) { /* [q 0..7 | q 0..7] */
#ifdef __AVX512F__
    return (v16f)_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)q));
#else
    return pair8(load8(q), load8(q));
#endif
}
static inline v8f low8(v16f v) {
#ifdef __AVX512F__
    return (v8f)_mm512_castps512_ps256((__m512)v);
#else
    v8f r;
    memcpy(&r, &v, sizeof r);
    return r;
#endif
}
static inline v8f high8(v16f v) {
#ifdef __AVX512F__
    return (v8f)_mm512_extractf64x4_pd((__m512d)v, 1);
#else
    v8f r;
    memcpy(&r, (const char *)&v + sizeof r, sizeof r);
    return r;
#endif
}

/* Eight int8 values at a and eight at b as one register of floats, a's in the low lanes (exact). */
static inline v16f widen8x2_i8(const int8_t *a, const int8_t *b) {
#ifdef __AVX512F__
    const __m128d x = _mm_loadh_pd(_mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)a)), (const double *)b);
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_castpd_si128(x)));
#else
    return pair8(widen8_i8(a), widen8_i8(b));
#endif
}

/* Eight bfloat16 values at a and eight at b as one register of floats, a's in the low lanes (exact). */
static inline v16f widen8x2_bf16(const uint16_t *a, const uint16_t *b) {
#ifdef __AVX512F__
    const __m128i lo = _mm_loadu_si128((const __m128i *)a), hi = _mm_loadu_si128((const __m128i *)b);
    const __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16);
#else
    return pair8(widen8_bf16(a), widen8_bf16(b));
#endif
}

/* Sixteen consecutive int8 or bfloat16 values at p as floats (exact). */
static inline v16f widen16_i8(const int8_t *p) {
#ifdef __AVX512F__
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return pair8(widen8_i8(p), widen8_i8(p + 8));
#endif
}
static inline v16f widen16_bf16(const uint16_t *p) {
#ifdef __AVX512F__
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    return pair8(widen8_bf16(p), widen8_bf16(p + 8));
#endif
}

/* One 32-value group of a row rounded to int8 as the Q8X products take it (linear_q8x.c): d = max |x| / 127, q =
 * round(x / d) to nearest even in -127..127, the sums of q over values 0..15 and 16..31, and the bytes in nibble
 * order (word 2 j the even values of 8 j .. 8 j + 7, word 2 j + 1 the odd) or in order. */
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
    for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(xb[k]));
    const float db = amax / 127.0f, inv = db > 0.0f ? 1.0f / db : 0.0f;
    int32_t s0 = 0, s1 = 0;
    for (int k = 0; k < 32; k++) {
        long r = lrintf(xb[k] * inv);
        int8_t q = (int8_t)(r > 127 ? 127 : r < -127 ? -127 : r);
        if (k < 16) s0 += q; else s1 += q;
        out[nibbles ? (k / 8 * 2 + k % 2) * 4 + k % 8 / 2 : k] = q; /* nibble order: k = 8 j + 2 i + o: word 2 j + o */
    }
    *d = db;
    sums[0] = s0, sums[1] = s1;
#endif
}

/* The largest |x| of D values (a multiple of 8). */
static inline float abs_max(const float *x, int D) {
    float m = 0.0f;
#ifdef __AVX2__
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) amax = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), load8(x + i)), amax);
    for (int i = 0; i < 8; i++) m = fmaxf(m, amax[i]);
#else
    for (int i = 0; i < D; i++) m = fmaxf(m, fabsf(x[i]));
#endif
    return m;
}

/* Eight values, each within a rounding of -127..127, as int8 at dst: rounded to nearest even, clamped. */
static inline void store8_i8(v8f y, int8_t *dst) {
#ifdef __AVX2__
    /* cvtps rounds to nearest even, as lrintf does; |y| <= 127 up to a rounding, which the clamp takes back */
    __m256i q = _mm256_cvtps_epi32((__m256)y);
    q = _mm256_min_epi32(_mm256_max_epi32(q, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64((__m128i *)dst, _mm_packs_epi16(w, w));
#else
    for (int j = 0; j < 8; j++) {
        const long r = lrintf(y[j]);
        dst[j] = (int8_t)(r > 127 ? 127 : r < -127 ? -127 : r);
    }
#endif
}

/* A spin-wait's pause: lets the other hyperthread of the core run (shm_sum.c). */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

#endif
