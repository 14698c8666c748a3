/* BF16C products on AMX tiles (Intel's matrix unit: TDPBF16PS sums a 16 x 32 block of bfloat16 activations
 * times a 32 x 16 block of bfloat16 weights into 16 x 16 fp32 accumulators, in one instruction).
 *
 * Why: on a Xeon with AMX, two cores compute bfloat16 products 5-10x as fast this way as with avx512_bf16's vector
 * dot product from 16 rows on (loadtest/lab/gemm.py); a batch of decodes or a prompt chunk is compute-bound there.
 * The weights keep the pair layout of the BF16C panels every other bfloat16 product reads (two consecutive k of a
 * column per 32-bit word, a panel's columns side by side), which is the layout the tiles load: a tile of weights is
 * 16 rows of k pairs, a panel's width of words apart. The engine packs BF16A panels, 32 columns, two whole tiles;
 * BF16C's 24 columns also run here, their second tile op half empty.
 *
 * Q4A, Q6A and Q8A panels (a GGUF file's Q4_0/Q4_1/Q4_K, Q6_K and Q8_0/Q5_0 weights in a bfloat16 process) hold
 * the blocks instead, 0.75, 1 and 1.125 bytes a weight: the vector units widen each k step's two tiles to bfloat16
 * just before the tile ops read them, the bits of the dequantized weight's BF16A panels. Where a batch's products
 * stream their weights from DRAM (a few to a hundred rows), fewer bytes read is the saving; the backend times them
 * against BF16A at start-up.
 *
 * NOTE: the tiles sum in their own order and precision (not avx512_bf16's, nor any sequence of fp32 adds), so their
 * bits differ from the other BF16C bodies'. linear_bf16.c runs a process's BF16C products through one body
 * (HP_BF16_BODY_AT), and here a row's result does not depend on the other rows: the same tiles and the same k order
 * for any M, the activations rounded the same way. So greedy tokens do not depend on the batch. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../ops.h"
#include "../../products.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for a state component the kernel enables only on request */
#define XFEATURE_XTILEDATA 18      /* the tiles' data */
#define TILE_K 32                  /* bfloat16 values of k a tile op sums */
#ifndef HP_AMX_PAD
/* bfloat16 values past K in each row of the rounded activations, so that a tile's 16 rows do not all fall in the
 * same few L1 sets (a row of K = 1536 is 3 KiB: 16 rows in 4 sets). NOTE: 32 (a line) took 1-4% off a SmolLM2
 * step's Q4A and BF16A products at 16-110 rows; 64 as much at 16 rows, less at 64 and 110 (python -m
 * loadtest.lab.kernel_ab --format q4a,amx). */
#define HP_AMX_PAD 32
#endif
#define LDA(K) ((K) + HP_AMX_PAD) /* the row stride of the rounded activations, in values */
#ifndef HP_AMX_AHEAD
/* How many k steps ahead the widening's blocks are prefetched. NOTE: the hardware prefetcher did not keep ahead of
 * the widening (its first load of each tile took 7-10% of the kernel's samples, served at 64 clients and alone at
 * 110 rows): 4 steps ahead took 5-14% off a SmolLM2 step's Q4A products at 1-110 rows, 2 about as much, 8 less
 * (Xeon with AMX, python -m loadtest.lab.kernel_ab --format q4a). BF16A panels, which the tile loads read straight
 * from DRAM, gained nothing from the same prefetch (within +-6%), so they go without. */
#define HP_AMX_AHEAD 4
#endif

typedef unsigned v16u __attribute__((vector_size(64), aligned(4)));

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16]; /* bytes per row of each tile */
    uint8_t rows[16];
};

/* Tiles: 0-3 accumulators (row groups 0 and 1 x column tiles 0 and 1), 4-5 activations (row groups 0 and 1),
 * 6-7 weights (column tiles 0 and 1). Column tile 0 is a panel's first 16 columns, tile 1 the other nr - 16. A tile
 * op sums `step` inputs (TILE_K; 16 for Q6S's scales per 16 inputs), 2 step bytes a row: the int8 products of ops.c
 * (bytes, four a 32-bit word) pass half the inputs they sum. */
void hp_amx_load_config(int rows, int nr, int step) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const uint16_t wide = 64, narrow = (uint16_t)((nr - 16) * 4);
    for (int t = 0; t < 4; t++) c.rows[t] = (uint8_t)rows, c.colsb[t] = t % 2 ? narrow : wide;
    c.rows[4] = c.rows[5] = (uint8_t)rows, c.colsb[4] = c.colsb[5] = (uint16_t)(step * 2);
    c.rows[6] = c.rows[7] = (uint8_t)(step / 2), c.colsb[6] = wide, c.colsb[7] = narrow;
    /* NOTE: GCC's _tile_loadconfig tells the compiler it reads 8 bytes of c, so inlined where the stores to the rest
     * could be dropped (they were: ldtilecfg faulted on a config of zeros); the barrier keeps every store. */
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

static int permitted = -1;

int hp_amx_bf16_available(void) {
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

/* Rows [r0, r1) of x rounded to bfloat16 (nearest even; NaN to a quiet NaN, as pack_rows_bf16 in ops.c) into a,
 * row-major [rows, K] with rows LDA(K) apart; 16 values a vector. */
static void round_rows(const float *x, int64_t ldx, uint16_t *a, int r0, int r1, int M, int K) {
    for (int m = r0; m < r1; m++) {
        uint16_t *out = a + (int64_t)m * LDA(K);
        if (m >= M) {
            memset(out, 0, (size_t)K * 2);
            continue;
        }
        const float *row = x + m * ldx;
        for (int k = 0; k < K; k += 16) {
            v16u u;
            memcpy(&u, row + k, sizeof u);
            v16u nan = (u & 0x7fffffff) > 0x7f800000;
            v16u r = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
            r = (nan & 0x7fc0) | (~nan & r);
            for (int i = 0; i < 16; i++) out[k + i] = (uint16_t)r[i];
        }
    }
}

/* Where a panel's tiles of weights lie: the first of each 32 k at panel + (k / 32) step, the second `second` bytes
 * after it, each tile's rows `stride` bytes apart. */
struct tiles {
    int64_t step, second, stride;
};

static inline struct tiles tiles_of(int nr) { /* BF16C and BF16A: a tile's row is part of a panel's row */
    return (struct tiles){(int64_t)TILE_K / 2 * nr * 4, 64, nr * 4};
}

static const struct tiles WIDENED = {2 * 1024, 1024, 64}; /* a Q4A panel widened: each tile one run of 1 KiB */


/* The 16 floats at p, one per column of a tile, spread over a row of widened values: lane j of lo is column j / 2's
 * (the lanes of columns 0-7, each column's k then k + 1), of hi column 8 + j / 2's. */
static inline __attribute__((always_inline)) void per_lane(const char *p, __m512 *lo, __m512 *hi) {
    const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512 v = _mm512_loadu_ps(p);
    *lo = _mm512_permutexvar_ps(lo_idx, v);
    *hi = _mm512_permutexvar_ps(_mm512_add_epi32(lo_idx, _mm512_set1_epi32(8)), v);
}

/* Tiles t0 .. t1 of a Q4A panel (two per 32 k) widened to bfloat16 in WIDENED's layout at out: each row's 32
 * nibbles (16 columns x a pair of k) as d q + m in fp32 (d q exact, so one rounding: the dequantized weight's
 * bits), rounded to bfloat16, nearest even: the bits of that weight's BF16A panels. */
static inline __attribute__((always_inline)) void widen_q4a(const char *panel, int t0, int t1, uint16_t *out) {
    const __m512i low = _mm512_set1_epi32(15);
    for (int t = t0; t < t1; t++) {
        const char *b = panel + (int64_t)t * HP_Q4A_TILE_BYTES;
        __m512 dlo, dhi, mlo, mhi;
        per_lane(b, &dlo, &dhi), per_lane(b + 64, &mlo, &mhi);
        const char *nib = b + 128;
        uint16_t *o = out + (int64_t)t * 512;
        for (int r = 0; r < 16; r++) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(nib + 16 * r)));
            const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), dlo, mlo);
            const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), dhi, mhi);
            _mm512_store_si512(o + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* Tiles t0 .. t1 of a Q6A panel (two per 32 k) widened to bfloat16 as widen_q4a does: each value q (0..63, the
 * file's q + 32) as d q - 32 d in fp32 (both products exact, and so their sum: a d of at most 18 significant bits),
 * d that of its 16 k. A tile holds its 16 columns' d for k 0-15 and 16-31 (fp32), the values' low four bits as Q4A's
 * nibbles, then per two rows (pairs of k) 16 bytes: bits 0-1 and 2-3 the high bits of the low and high nibble of
 * the first row's byte, bits 4-5 and 6-7 of the second's. */
static inline __attribute__((always_inline)) void widen_q6(const char *panel, int t0, int t1, uint16_t *out) {
    const __m512i low = _mm512_set1_epi32(15), two = _mm512_set1_epi32(3);
    const __m512 offset = _mm512_set1_ps(-32.0f);
    for (int t = t0; t < t1; t++) {
        const char *b = panel + (int64_t)t * HP_Q6A_TILE_BYTES, *nib = b + 128, *high = nib + 256;
        uint16_t *o = out + (int64_t)t * 512;
        for (int half = 0; half < 2; half++) {
            __m512 dlo, dhi;
            per_lane(b + 64 * half, &dlo, &dhi);
            const __m512 mlo = _mm512_mul_ps(dlo, offset), mhi = _mm512_mul_ps(dhi, offset);
            for (int r = 8 * half; r < 8 * half + 8; r += 2) {
                const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(high + 8 * r)));
                for (int j = 0; j < 2; j++) {
                    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(nib + 16 * (r + j))));
                    const __m512i hj = _mm512_srli_epi32(h, 4 * j);
                    const __m512i qlo = _mm512_or_si512(_mm512_and_si512(v, low),
                                                        _mm512_slli_epi32(_mm512_and_si512(hj, two), 4));
                    const __m512i hhi = _mm512_and_si512(_mm512_srli_epi32(hj, 2), two);
                    const __m512i qhi = _mm512_or_si512(_mm512_srli_epi32(v, 4), _mm512_slli_epi32(hhi, 4));
                    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qlo), dlo, mlo);
                    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qhi), dhi, mhi);
                    _mm512_store_si512(o + 32 * (r + j), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                }
            }
        }
    }
}

/* Tiles t0 .. t1 of a Q8A panel (two per 32 k) widened to bfloat16 as widen_q4a does: each value q (-128..127) as
 * d q in fp32 (exact), d that of its column's 32 k. Per pair of k a tile holds 32 bytes: columns 0-7's (each
 * column's k then k + 1), then columns 8-15's. Not ``scaled``: q itself (exact), for Q8S. */
static inline __attribute__((always_inline)) void widen_q8(const char *panel, int t0, int t1, uint16_t *out,
                                                           int scaled) {
    for (int t = t0; t < t1; t++) {
        const char *b = panel + (int64_t)t * HP_Q8A_TILE_BYTES, *bytes = b + 64;
        __m512 dlo, dhi;
        per_lane(b, &dlo, &dhi);
        uint16_t *o = out + (int64_t)t * 512;
        for (int r = 0; r < 16; r++) {
            const __m512i vlo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(bytes + 32 * r)));
            const __m512i vhi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(bytes + 32 * r + 16)));
            __m512 lo = _mm512_cvtepi32_ps(vlo), hi = _mm512_cvtepi32_ps(vhi);
            if (scaled) lo = _mm512_mul_ps(lo, dlo), hi = _mm512_mul_ps(hi, dhi);
            _mm512_store_si512(o + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* What a panel's tile loop also does: widen a Q4A, Q6A or Q8A panel (src, NULL for none) into dst, each k step's two
 * tiles just before the tile loads that read them. */
struct widening {
    const char *src;
    uint16_t *dst;
    int format; /* HP_Q4A, HP_Q6A or HP_Q8A */
};

/* The tiles' sums of one row group (or two, ``two``), stored at out (row stride ldo floats). */
static inline __attribute__((always_inline)) void panel_groups(const uint16_t *a0, const char *panel, struct tiles w,
                                                               int K, int two, float *out, int64_t ldo,
                                                               struct widening widen) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const int lda = LDA(K) * 2;
    const uint16_t *a1 = a0 + 16 * (int64_t)LDA(K);
    const int64_t blocks_step = widen.src ? 2 * hp_widened_tile_bytes(widen.format) : 0; /* a k step's two tiles */
    for (int k = 0; k < K; k += TILE_K) {
        if (widen.src) /* the blocks HP_AMX_AHEAD k steps on, into L1 (past the last panel: a prefetch never faults) */
            for (int64_t i = 0; i < blocks_step; i += 64)
                __builtin_prefetch(widen.src + (k / TILE_K + HP_AMX_AHEAD) * blocks_step + i, 0, 3);
        if (widen.src && widen.format == HP_Q6A)
            widen_q6(widen.src, k / TILE_K * 2, k / TILE_K * 2 + 2, widen.dst);
        else if (widen.src && widen.format == HP_Q8A)
            widen_q8(widen.src, k / TILE_K * 2, k / TILE_K * 2 + 2, widen.dst, 1);
        else if (widen.src)
            widen_q4a(widen.src, k / TILE_K * 2, k / TILE_K * 2 + 2, widen.dst);
        const char *b = panel + (int64_t)(k / TILE_K) * w.step;
        _tile_loadd(6, b, w.stride);
        _tile_loadd(7, b + w.second, w.stride);
        _tile_loadd(4, a0 + k, lda);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a1 + k, lda);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, out, ldo * 4);
    _tile_stored(1, out + 16, ldo * 4);
    if (two) {
        _tile_stored(2, out + 16 * ldo, ldo * 4);
        _tile_stored(3, out + 16 * ldo + 16, ldo * 4);
    }
}

/* Panel p's columns of y for every row, two row groups of 16 at a time, its weights at panel (laid out as w says;
 * a Q4A panel widened there during the first pair); yp is where the panel's first column of row 0 goes (y + p nr,
 * or a buffer of the panel's own). A pair of groups whose rows and columns all lie in y is stored there straight
 * from the tiles; the last, partial one goes through a buffer. */
static void panel_product(int p, const uint16_t *a, const char *panel, struct tiles w, struct widening widen, int nr,
                          const float *bias, float *yp, int64_t ldy, int M, int N, int K, int groups) {
    const int n0 = p * nr, cols = N - n0 < nr ? N - n0 : nr;
    float buffer[32 * 32] __attribute__((aligned(64)));
    for (int g = 0; g < groups; g += 2) {
        const int two = g + 1 < groups, m0 = g * 16, rows = M - m0 < 32 ? M - m0 : 32;
        const int direct = cols == nr && rows == (two ? 32 : M < 16 ? M : 16); /* a tile holds min(M, 16) rows */
        float *out = direct ? yp + m0 * ldy : buffer;
        const int64_t ldo = direct ? ldy : 32;
        if (two)
            panel_groups(a + (int64_t)m0 * LDA(K), panel, w, K, 1, out, ldo, widen);
        else
            panel_groups(a + (int64_t)m0 * LDA(K), panel, w, K, 0, out, ldo, widen);
        widen.src = NULL;
        for (int r = 0; r < rows; r++) {
            float *yr = yp + (m0 + r) * ldy;
            const float *o = out + r * ldo;
            if (bias)
                for (int c = 0; c < cols; c++) yr[c] = o[c] + bias[n0 + c];
            else if (!direct)
                for (int c = 0; c < cols; c++) yr[c] = o[c];
        }
    }
}

/* Panel p of Q4A, Q6A or Q8A weights (``format``): widened into this thread's buffer a k step at a time just ahead of
 * the first row pair's tile loads, then read as it is by the other pairs. NOTE: widening the next panel under this
 * one's tile ops (two buffers taking turns) measured no faster at 1-256 rows (docs/benchmarks.md). */
static void widened_panel_product(int p, int format, const uint16_t *a, const void *packed, const float *bias,
                                  float *yp, int64_t ldy, int M, int N, int K, int groups) {
    static __thread uint16_t *widened = 0;
    static __thread int64_t widened_k = 0;
    if (K > widened_k) {
        free(widened);
        widened = (uint16_t *)aligned_alloc(64, (size_t)K * 32 * 2);
        widened_k = K;
    }
    const struct widening here = {(const char *)packed + (int64_t)p * (K / TILE_K) * 2 * hp_widened_tile_bytes(format),
                                  widened, format};
    panel_product(p, a, (const char *)widened, WIDENED, here, HP_BF16A_WIDTH, bias, yp, ldy, M, N, K, groups);
}

/* Panel p of BF16C/BF16A panels nr wide, or of Q4A, Q6A or Q8A panels (widened: that format, else 0), for every
 * row, into yp (row stride ldy) as panel_product says. */
static inline void any_panel_product(int p, int widened, const uint16_t *a, const void *packed, int nr,
                                     const float *bias, float *yp, int64_t ldy, int M, int N, int K, int groups) {
    const struct widening none = {NULL, NULL, 0};
    if (widened)
        widened_panel_product(p, widened, a, packed, bias, yp, ldy, M, N, K, groups);
    else
        panel_product(p, a, (const char *)packed + (int64_t)p * K * nr * 2, tiles_of(nr), none, nr, bias, yp, ldy, M,
                      N, K, groups);
}

static int amx_fits(int nr, int widened, int K) {
    return hp_amx_bf16_available() && K % TILE_K == 0 && nr > 16 && nr <= 32 && nr % 8 == 0 &&
           (!widened || (nr == HP_BF16A_WIDTH && (widened == HP_Q4A || widened == HP_Q6A || widened == HP_Q8A)));
}

/* This thread's buffer of at least `values` bfloat16 values, grown as needed and kept. */
static uint16_t *thread_buffer(int64_t values) {
    static __thread uint16_t *buffer = 0;
    static __thread int64_t buffer_size = 0;
    if (values > buffer_size) {
        free(buffer);
        buffer_size = values;
        buffer = (uint16_t *)aligned_alloc(64, (size_t)values * 2);
    }
    return buffer;
}

/* This thread's buffer for M rows of K rounded to bfloat16 (rows LDA(K) apart, whole groups of 16), grown as needed
 * and kept: a decode step asks for it ~4 times a layer. */
static uint16_t *rows_buffer(int M, int K) { return thread_buffer((int64_t)((M + 15) / 16) * 16 * LDA(K)); }

/* The rows of x rounded into a, the groups shared out among the threads of the enclosing parallel region; then each
 * thread's tiles configured. */
static void start_tiles(const float *x, int64_t ldx, uint16_t *a, int M, int K, int nr) {
#pragma omp for schedule(static)
    for (int g = 0; g < (M + 15) / 16; g++) round_rows(x, ldx, a, g * 16, g * 16 + 16, M, K);
    hp_amx_load_config(M < 16 ? M : 16, nr, TILE_K);
}

int hp_linear_bf16c_amx(const float *x, int64_t ldx, const void *packed, int nr, int widened, const float *bias,
                        float *y, int64_t ldy, int M, int N, int K) {
    if (!amx_fits(nr, widened, K)) return -1;
    if (M <= 0 || N <= 0) return 0; /* nothing to compute, and a tile of no rows is no valid configuration */
    const int groups = (M + 15) / 16, panels = (N + nr - 1) / nr;
    uint16_t *a = rows_buffer(M, K); /* NOTE: a local: inside the parallel region, each thread would see its own */
#pragma omp parallel
    {
        start_tiles(x, ldx, a, M, K, nr);
        /* NOTE: guided, as ops.c's products (long runs of consecutive panels a thread): single panels taking turns
         * between the threads (dynamic) made a step's products 11-18% slower at 16-110 rows (Q4A), 7-19% (BF16A). */
#pragma omp for schedule(guided)
        for (int p = 0; p < panels; p++)
            any_panel_product(p, widened, a, packed, nr, bias, y + (int64_t)p * nr, ldy, M, N, K, groups);
        _tile_release();
    }
    return 0;
}

/* The running argmax of a row over the columns one thread has seen: per lane (a column's place in its panel) the
 * largest value and the first column that held it (-1: none yet), and the row's first NaN column (INT32_MAX: none). */
struct lane_max {
    __m512 v[2];
    __m512i at[2];
    int32_t nan;
};

/* Whether (v, i) comes before (w, j) in torch's argmax: a NaN first (the first NaN), then the larger, then the
 * first column. */
static inline int ahead(float v, int64_t i, float w, int64_t j) {
    if ((v != v) != (w != w)) return v != v;
    if (v != v || v == w) return i < j;
    return v > w;
}

/* The first column of the largest value in a row's lanes (or its first NaN), as (value, column). */
static inline void lanes_argmax(const struct lane_max *s, float *value, int64_t *at) {
    float bv = NAN;
    int64_t bi = -1;
    for (int h = 0; h < 2; h++) {
        float v[16];
        int32_t i[16];
        _mm512_storeu_ps(v, s->v[h]);
        _mm512_storeu_si512(i, s->at[h]);
        for (int l = 0; l < 16; l++)
            if (i[l] >= 0 && (bi < 0 || ahead(v[l], i[l], bv, bi))) bv = v[l], bi = i[l];
    }
    if (s->nan != INT32_MAX) bv = NAN, bi = s->nan;
    *value = bv, *at = bi;
}

/* ids [M] = the argmax over the N columns of x . w^T, x's rows [M, K], as torch's argmax of hp_linear_bf16c_amx's
 * y would give (the first of equal maxima, a NaN the largest), without y: each thread keeps its panels' products in
 * a buffer of its own and a running maximum per row. Why: a greedy step's LM head writes y [M, vocab] and numpy's
 * argmax then reads it on one core: 1.1 ms at 58 rows of SmolLM2's 49152 columns, a quarter of the head's product
 * (Xeon with AMX). */
int hp_argmax_bf16c_amx(const float *x, int64_t ldx, const void *packed, int nr, int widened, int M, int N, int K,
                        int64_t *ids) {
    if (!amx_fits(nr, widened, K)) return -1;
    if (M <= 0) return 0;
    if (N <= 0) return -1;
    const int groups = (M + 15) / 16, panels = (N + nr - 1) / nr;
    uint16_t *a = rows_buffer(M, K);
    const int threads = omp_get_max_threads();
    float *best = (float *)malloc(sizeof(float) * (size_t)threads * M);
    int64_t *best_at = (int64_t *)malloc(sizeof(int64_t) * (size_t)threads * M);
    for (int64_t i = 0; i < (int64_t)threads * M; i++) best_at[i] = -1; /* a thread the region did not get: none */
#pragma omp parallel
    {
        const int me = omp_get_thread_num();
        float *out = (float *)aligned_alloc(64, sizeof(float) * (size_t)groups * 16 * 32);
        struct lane_max *lanes = (struct lane_max *)aligned_alloc(64, sizeof(struct lane_max) * (size_t)M);
        for (int m = 0; m < M; m++) {
            for (int h = 0; h < 2; h++)
                lanes[m].v[h] = _mm512_set1_ps(-INFINITY), lanes[m].at[h] = _mm512_set1_epi32(-1);
            lanes[m].nan = INT32_MAX;
        }
        start_tiles(x, ldx, a, M, K, nr);
#pragma omp for schedule(guided)
        for (int p = 0; p < panels; p++) {
            any_panel_product(p, widened, a, packed, nr, NULL, out, 32, M, N, K, groups);
            const int n0 = p * nr, cols = N - n0 < nr ? N - n0 : nr;
            const __mmask16 valid[2] = {(__mmask16)(cols >= 16 ? 0xffff : (1u << cols) - 1),
                                        (__mmask16)(cols >= 32 ? 0xffff : cols > 16 ? (1u << (cols - 16)) - 1 : 0)};
            for (int m = 0; m < M; m++) {
                struct lane_max *s = &lanes[m];
                for (int h = 0; h < 2; h++) {
                    const __m512 v = _mm512_maskz_loadu_ps(valid[h], out + m * 32 + 16 * h);
                    const __mmask16 nan = _mm512_mask_cmp_ps_mask(valid[h], v, v, _CMP_UNORD_Q);
                    if (nan && n0 + 16 * h + __builtin_ctz(nan) < s->nan) s->nan = n0 + 16 * h + __builtin_ctz(nan);
                    /* a column is taken where it is larger than its lane's best, or where the lane has none yet (so
                     * a -inf counts); a NaN never: the row's first NaN is kept apart */
                    const __mmask16 empty = _mm512_cmp_epi32_mask(s->at[h], _mm512_set1_epi32(-1), _MM_CMPINT_EQ);
                    const __mmask16 take = (_mm512_mask_cmp_ps_mask(valid[h], v, s->v[h], _CMP_GT_OQ) |
                                            (empty & valid[h] & ~nan));
                    const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(n0 + 16 * h),
                                                        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                                                         1, 0));
                    s->v[h] = _mm512_mask_mov_ps(s->v[h], take, v);
                    s->at[h] = _mm512_mask_mov_epi32(s->at[h], take, at);
                }
            }
        }
        _tile_release();
        for (int m = 0; m < M; m++) lanes_argmax(&lanes[m], &best[me * M + m], &best_at[me * M + m]);
        free(lanes);
        free(out);
    }
    for (int m = 0; m < M; m++) {
        float bv = NAN;
        int64_t bi = -1;
        for (int t = 0; t < threads; t++)
            if (best_at[t * M + m] >= 0 && (bi < 0 || ahead(best[t * M + m], best_at[t * M + m], bv, bi)))
                bv = best[t * M + m], bi = best_at[t * M + m];
        ids[m] = bi;
    }
    free(best);
    free(best_at);
    return 0;
}

/* fp32 products of a GGUF file's blocks on AMX tiles: Q4S, Q6S and Q8S panels (the bytes of Q4A, Q6A and Q8A
 * panels), and Q4KS and Q6KS panels (a Q4_K or Q6_K weight's values as Q4S's or Q6S's, its scales kept per
 * super-block as the file keeps them), to fp32's accuracy, not bfloat16's.
 *
 * Why: a block's weight is d q + m with an integer q (Q4: 0..15 and an m; Q6: -32..31, a d per 16 inputs, no m;
 * Q8: -128..127, no m), which bfloat16 holds exactly, and an fp32 activation x is exactly the sum of three
 * bfloat16 values (its 24 significant bits, 8 at a time, truncated). So per block of inputs
 *     sum_k x_k (d q_k + m) = d (S_1 + S_2 + S_3) + m X,   S_i = sum_k x_i,k q_k,   X = sum_k x_k
 * where every product in a tile op is exact and its sums round in fp32, as an fp32 product's sums do. Three tile
 * ops on each block's weights, and a vector fused multiply-add or two per block for d and m, then outrun the FMA
 * units: on a Xeon with AMX, two cores' fp32 FMAs peak near 340 GFLOP/s, their tiles near 2 TFLOP/s in bfloat16.
 * NOTE: these are not the bits of the fp32 panels' FMA chain (ops.c): a weight here is d q + m unrounded, and the
 * sums run per block. A row's result still does not depend on the other rows (the same tile ops and the same
 * order for any M), and a process computes each weight format through one body, so tokens do not depend on the
 * batch. The backend takes these bodies only where start-up times them faster. */
#define SPLIT_PARTS 3

/* Inputs per scale (d, m) of a format: its blocks, the tile ops' k step (Q6: two steps of 16 a tile). */
static inline int split_group(int format) { return format == HP_Q6S || format == HP_Q6KS ? 16 : TILE_K; }

/* Rows [r0, r1) of x as three bfloat16 parts (part i of row m at a + i part + m LDA(K); x = the three parts' sum,
 * exactly, for normal x whose last part is not subnormal), and each row's sum per `group` inputs (sums + m K / group,
 * fp32, one fixed order; none where group is 0); rows past M zero. */
static void split_rows(const float *x, int64_t ldx, uint16_t *a, int64_t part, float *sums, int group, int r0, int r1,
                       int M, int K) {
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    const int per_row = group ? K / group : 0;
    for (int m = r0; m < r1; m++) {
        uint16_t *out = a + (int64_t)m * LDA(K);
        float *s = sums + (int64_t)m * per_row;
        if (m >= M) {
            for (int i = 0; i < SPLIT_PARTS; i++) memset(out + i * part, 0, (size_t)K * 2);
            memset(s, 0, sizeof(float) * (size_t)per_row);
            continue;
        }
        const float *row = x + m * ldx;
        for (int k = 0; k < K; k += 16) {
            __m512 rest = _mm512_loadu_ps(row + k);
            if (group) {
                if (k % group == 0) s[k / group] = 0.0f;
                s[k / group] += _mm512_reduce_add_ps(rest);
            }
            for (int i = 0; i < SPLIT_PARTS; i++) {
                const __m512i bits = _mm512_and_si512(_mm512_castps_si512(rest), top);
                rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(bits)); /* exact: the bits below the top 8 */
                const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
                _mm256_storeu_si256((__m256i *)(out + i * part + k), half);
            }
        }
    }
}

/* The look-up tables of the tiles' widening: bfloat16 of 0..15, twice (a 32-word table whose index bit 4 is
 * ignored), and of -32..31 as two 32-word halves (q - 32 for a 6-bit q: the first half for q 0..31). */
static inline __attribute__((always_inline)) __m512i q4_table(void) {
    return _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0,
                            0x4080, 0x4040, 0x4000, 0x3f80, 0, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110,
                            0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0);
}
static inline __attribute__((always_inline)) void q6_tables(__m512i *first, __m512i *second) {
    const __m512 ramp = _mm512_cvtepi32_ps(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    *first = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(ramp, _mm512_set1_ps(16.0f)),
                                          _mm512_sub_ps(ramp, _mm512_set1_ps(32.0f)));
    *second = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(ramp, _mm512_set1_ps(16.0f)), ramp);
}

/* A tile's nibbles (16 columns x 32 inputs, Q4A's 16 rows of 16 bytes at nib) as its q (0..15) in bfloat16, exact,
 * in WIDENED's layout at out: each row's low nibbles then its high nibbles, as widen_q4a places them (a table
 * look-up, not widen_q4a's conversions). */
static inline __attribute__((always_inline)) void widen_q4_values(const char *nib, uint16_t *out) {
    const __m512i values = q4_table(); /* bfloat16 of 0..15, twice */
    const __m128i low = _mm_set1_epi8(15);
    for (int r = 0; r < 16; r++) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(nib + 16 * r));
        const __m256i both = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
        _mm512_store_si512(out + 32 * r, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(both), values));
    }
}

/* Where block b (of K / 32) of a panel keeps its two tiles' q: Q4KS's and Q6KS's inside their super-block, past
 * its headers; the other formats' whole tiles (their scales first). */
static inline __attribute__((always_inline)) const char *split_block(int format, const char *panel, int b) {
    if (hp_ksplit_format(format))
        return panel + (int64_t)(b / 8) * hp_ksplit_super_bytes(format) + 2 * hp_ksplit_head_bytes(format) +
               (b % 8) * 2 * hp_ksplit_tile_bytes(format);
    return panel + (int64_t)b * 2 * hp_widened_tile_bytes(format);
}

/* The bytes of a block's q at split_block (a super-block's headers aside) and of one panel of K inputs. */
static inline int split_block_bytes(int format) {
    return 2 * (hp_ksplit_format(format) ? hp_ksplit_tile_bytes(format) : (int)hp_widened_tile_bytes(format));
}
static inline int64_t split_panel_bytes(int format, int K) {
    return hp_ksplit_format(format) ? (int64_t)(K / 256) * hp_ksplit_super_bytes(format)
                                    : (int64_t)(K / TILE_K) * split_block_bytes(format);
}

/* A tile's q of a Q6A layout (nibbles at nib, high bits at high: widen_q6) as q - 32 (the file's q, -32..31) in
 * bfloat16, exact, in WIDENED's layout at out: each row's six bits formed in bytes, then a look-up in a table of
 * 64 bfloat16 values (where converting each value through fp32 took twice the instructions). */
static inline __attribute__((always_inline)) void widen_q6_values(const char *nib, const char *high, uint16_t *out) {
    __m512i values0, values1;
    q6_tables(&values0, &values1);
    const __m128i low = _mm_set1_epi8(15), top = _mm_set1_epi8(0x30);
    for (int r = 0; r < 16; r += 2) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(high + 8 * r));
        for (int j = 0; j < 2; j++) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(nib + 16 * (r + j)));
            const __m128i hj = _mm_srli_epi16(h, 4 * j); /* this row's four bits of each byte at bits 0-3 */
            const __m128i qlo = _mm_or_si128(_mm_and_si128(v, low), _mm_and_si128(_mm_slli_epi16(hj, 4), top));
            const __m128i qhi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(v, 4), low),
                                             _mm_and_si128(_mm_slli_epi16(hj, 2), top));
            const __m512i q = _mm512_cvtepu8_epi16(_mm256_set_m128i(qhi, qlo));
            _mm512_store_si512(out + 32 * (r + j), _mm512_permutex2var_epi16(values0, q, values1));
        }
    }
}

/* A Q4KS or Q6KS tile's q (ops.h's hp_ksplit_low_at, hp_ksplit_high_at) in bfloat16, exact, in WIDENED's layout at
 * out: Q4KS's q (0..15), Q6KS's q - 32 (-32..31). Per four rows one load of their low bits (and Q6KS's high bits),
 * then per row a shift (and Q6KS's merge of its high bits) and a look-up of 32 16-bit words, a table of 32 values
 * (Q4KS: 0..15 twice, index bit 4 ignored) or of 64 (Q6KS). */
static inline __attribute__((always_inline)) void widen_ksplit(int q6, const char *tile, uint16_t *out) {
    const __m512i q4_values = q4_table();
    __m512i q6_values0, q6_values1;
    q6_tables(&q6_values0, &q6_values1);
    const __m512i low = _mm512_set1_epi16(15);
    for (int g = 0; g < 4; g++) {
        const __m512i v = _mm512_loadu_si512(tile + 64 * g);
        __m512i h = _mm512_setzero_si512();
        if (q6) h = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(tile + HP_Q6KS_HIGH_AT + 32 * g)));
        for (int j = 0; j < 4; j++) {
            const __m512i bits = j ? _mm512_srli_epi16(v, 4 * j) : v; /* this row's low four bits at bits 0-3 */
            __m512i row;
            if (q6) {
                const __m512i top = j < 2 ? _mm512_slli_epi16(h, 4 - 2 * j) : _mm512_srli_epi16(h, 2 * j - 4);
                const __m512i q = _mm512_ternarylogic_epi32(bits, top, low, 0xe4); /* bits 0-3 of bits, 4-5 top's */
                row = _mm512_permutex2var_epi16(q6_values0, q, q6_values1);
            } else {
                row = _mm512_permutexvar_epi16(bits, q4_values);
            }
            _mm512_store_si512(out + 32 * (4 * g + j), row);
        }
    }
}

/* A block's two tiles (16 columns each) of q values at out (2 x 512 bfloat16). */
static inline __attribute__((always_inline)) void split_widen(int format, const char *block, uint16_t *out) {
    if (format == HP_Q6S) {
        widen_q6_values(block + 128, block + 384, out);
        widen_q6_values(block + HP_Q6A_TILE_BYTES + 128, block + HP_Q6A_TILE_BYTES + 384, out + 512);
    } else if (format == HP_Q8S) {
        widen_q8(block, 0, 2, out, 0);
    } else if (hp_ksplit_format(format)) {
        widen_ksplit(format == HP_Q6KS, block, out);
        widen_ksplit(format == HP_Q6KS, block + hp_ksplit_tile_bytes(format), out + 512);
    } else {
        widen_q4_values(block + 128, out);
        widen_q4_values(block + HP_Q4A_TILE_BYTES + 128, out + 512);
    }
}

/* 16 bytes at p as floats: unsigned, or signed (int8). */
static inline __attribute__((always_inline)) __m512 byte_floats(const char *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline __attribute__((always_inline)) __m512 int8_floats(const char *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* Block b's scales (64 floats at out): d of its first tile's 16 columns, of its second's, then m of each (Q4S,
 * Q4KS) or d of their inputs 16-31 (Q6S, Q6KS; Q8S none). Q4KS and Q6KS form them from their super-block's header
 * as gguf_pack.c forms Q4S's and Q6S's from the file, d sc and -(dmin mn), or d sc: each one exact product, the
 * same values, so the same bits. Why once a block, into a ring: a batch's row groups each take them, and forming
 * them per row group cost 6% at 64 rows. */
static inline __attribute__((always_inline)) void split_scales(int format, const char *panel, int b, float *out) {
    if (format == HP_Q6KS) {
        for (int t = 0; t < 2; t++) {
            const char *h = panel + (int64_t)(b / 8) * hp_ksplit_super_bytes(format) + t * HP_Q6KS_HEAD_BYTES;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
            const char *scales = h + HP_Q6KS_SCALES_AT + 16 * (2 * (b % 8)); /* this block's two halves */
            _mm512_store_ps(out + 16 * t, _mm512_mul_ps(d, int8_floats(scales)));
            _mm512_store_ps(out + 32 + 16 * t, _mm512_mul_ps(d, int8_floats(scales + 16)));
        }
        return;
    }
    if (format == HP_Q4KS) {
        const __m512i sign = _mm512_set1_epi32(INT32_MIN);
        for (int t = 0; t < 2; t++) {
            const char *h = panel + (int64_t)(b / 8) * hp_ksplit_super_bytes(format) + t * HP_Q4KS_HEAD_BYTES;
            const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + HP_Q4KS_DMIN_AT)));
            const __m512 dmin_mn = _mm512_mul_ps(dmin, byte_floats(h + HP_Q4KS_MINS_AT + 16 * (b % 8)));
            _mm512_store_ps(out + 16 * t, _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h)),
                                                        byte_floats(h + HP_Q4KS_SCALES_AT + 16 * (b % 8))));
            _mm512_store_ps(out + 32 + 16 * t, _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dmin_mn),
                                                                                    sign)));
        }
        return;
    }
    const char *t0 = split_block(format, panel, b), *t1 = t0 + hp_widened_tile_bytes(format);
    _mm512_store_ps(out, _mm512_loadu_ps(t0)), _mm512_store_ps(out + 16, _mm512_loadu_ps(t1));
    if (format != HP_Q8S)
        _mm512_store_ps(out + 32, _mm512_loadu_ps(t0 + 64)), _mm512_store_ps(out + 48, _mm512_loadu_ps(t1 + 64));
}

/* One job's tile sums (a row group, one k step: three parts, two tiles) into accumulator tiles ACC0 and ACC1, the
 * parts' activations loaded into tiles 4 and 5 in turn; tiles 6 and 7 hold the step's weights. */
#define SPLIT_JOB(ACC0, ACC1, ag, part, lda)                                                                          \
    do {                                                                                                              \
        _tile_zero(ACC0);                                                                                             \
        _tile_zero(ACC1);                                                                                             \
        _tile_loadd(4, (ag), (lda));                                                                                  \
        _tile_dpbf16ps(ACC0, 4, 6);                                                                                   \
        _tile_dpbf16ps(ACC1, 4, 7);                                                                                   \
        _tile_loadd(5, (ag) + (part), (lda));                                                                         \
        _tile_dpbf16ps(ACC0, 5, 6);                                                                                   \
        _tile_dpbf16ps(ACC1, 5, 7);                                                                                   \
        _tile_loadd(4, (ag) + 2 * (part), (lda));                                                                     \
        _tile_dpbf16ps(ACC0, 4, 6);                                                                                   \
        _tile_dpbf16ps(ACC1, 4, 7);                                                                                   \
    } while (0)
_Static_assert(SPLIT_PARTS == 3, "SPLIT_JOB sums three parts");

/* A job's sums (accumulator tiles 2 set, 2 set + 1) stored at s [16, 32]. */
static inline __attribute__((always_inline)) void split_store(int set, float *s) {
    if (set) {
        _tile_stored(2, s, 128);
        _tile_stored(3, s + 16, 128);
    } else {
        _tile_stored(0, s, 128);
        _tile_stored(1, s + 16, 128);
    }
}

/* A job's stored sums s (row group g, scale group j of the row, its block's scales at sc: split_scales) into the
 * rows' accumulators: acc += d S (+ m X for Q4S and Q4KS), per row of group g that is one of M's. */
static inline __attribute__((always_inline)) void split_epilogue(int format, const float *s, const float *sc,
                                                                 const float *sums, int j, int per_row, int g, int M,
                                                                 float *acc) {
    const int at = split_group(format) == 16 ? 32 * (j % 2) : 0;
    const __m512 d0 = _mm512_load_ps(sc + at), d1 = _mm512_load_ps(sc + at + 16);
    const __m512 m0 = _mm512_load_ps(sc + 32), m1 = _mm512_load_ps(sc + 48); /* unused but by Q4S, Q4KS */
    const int rows = M - 16 * g < 16 ? M - 16 * g : 16;
    for (int r = 0; r < rows; r++) {
        float *ar = acc + 32 * (16 * g + r);
        __m512 lo = _mm512_fmadd_ps(d0, _mm512_load_ps(s + 32 * r), j ? _mm512_load_ps(ar) : _mm512_setzero_ps());
        __m512 hi = _mm512_fmadd_ps(d1, _mm512_load_ps(s + 32 * r + 16),
                                    j ? _mm512_load_ps(ar + 16) : _mm512_setzero_ps());
        if (format == HP_Q4S || format == HP_Q4KS) {
            const __m512 x = _mm512_set1_ps(sums[(int64_t)(16 * g + r) * per_row + j]);
            lo = _mm512_fmadd_ps(m0, x, lo), hi = _mm512_fmadd_ps(m1, x, hi);
        }
        _mm512_store_ps(ar, lo);
        _mm512_store_ps(ar + 16, hi);
    }
}

#define SPLIT_RING 4  /* widened blocks in flight: block b + SPLIT_AHEAD is widened while block b's tiles load */
#define SPLIT_AHEAD 2
#define SCALE_RING 8 /* blocks' scales in flight: from their widening SPLIT_AHEAD blocks on to the epilogue's */

/* Panel p of Q4S, Q6S, Q8S, Q4KS or Q6KS products for every row. Per 32 inputs, the panel's q widened to bfloat16
 * and its scales formed (two blocks ahead, so a tile load does not wait on the vector stores that wrote it); then
 * per k step (one, or Q6's two) the
 * step's weights into tiles 6 and 7 and one job of tile sums per row group. Each job's sums are stored once the next
 * job's tile ops are issued, and taken into the accumulators one job later still (two sets of accumulator tiles, two
 * buffers, in turn), so the vectors' work overlaps the tiles' and no load waits on the tile store it reads. */
static inline __attribute__((always_inline)) void split_panel_product(int format, int p, const uint16_t *a,
                                                                      int64_t part, const float *sums,
                                                                      const char *packed, const float *bias,
                                                                      float *yp, int64_t ldy, int M, int N, int K,
                                                                      int groups) {
    static __thread uint16_t *ring_ = 0;
    static __thread float *scales_ = 0; /* SCALE_RING blocks' split_scales */
    static __thread float *acc_ = 0;
    static __thread int64_t acc_rows = 0;
    if (!ring_) ring_ = (uint16_t *)aligned_alloc(64, SPLIT_RING * 1024 * 2);
    if (!scales_) scales_ = (float *)aligned_alloc(64, SCALE_RING * 64 * sizeof(float));
    if (groups * 16 > acc_rows) {
        free(acc_);
        acc_rows = groups * 16;
        acc_ = (float *)aligned_alloc(64, sizeof(float) * 32 * (size_t)acc_rows);
    }
    /* NOTE: locals: the loop's stores might alias a thread variable, so each use of one looked it up again, a call
     * (and a vzeroupper) a block: 3% of an 8B model's one-row step (perf); as locals a 1B step's Q4KS products took
     * 0.95x the time at 1 and 16 rows (Xeon with AMX, loadtest.lab.kernel_ab --format q4_ks) */
    uint16_t *const ring = ring_;
    float *const scales = scales_, *const acc = acc_;
    float s[2][16 * 32] __attribute__((aligned(64)));
    const int step = split_group(format), steps = TILE_K / step, block_bytes = split_block_bytes(format);
    const int blocks = K / TILE_K, per_row = K / step, n0 = p * HP_BF16A_WIDTH, lda = LDA(K) * 2;
    const int cols = N - n0 < 32 ? N - n0 : 32;
    const char *panel = packed + (int64_t)p * split_panel_bytes(format, K);
#define BLOCK_AT(b) split_block(format, panel, b)
#define SCALES(b) (scales + (b) % SCALE_RING * 64)
    for (int b = 0; b < SPLIT_AHEAD && b < blocks; b++)
        split_widen(format, BLOCK_AT(b), ring + (b % SPLIT_RING) * 1024), split_scales(format, panel, b, SCALES(b));
    int j = 0, job_k[3] = {0, 0, 0}, job_g[3] = {0, 0, 0}; /* job j's k step and row group at [j % 3] */
#define EPILOGUE(i)                                                                                                   \
    split_epilogue(format, s[(i) % 2], SCALES(job_k[(i) % 3] / steps), sums, job_k[(i) % 3], per_row,              \
                   job_g[(i) % 3], M, acc)
    for (int b = 0; b < blocks; b++) {
        const int ahead = b + SPLIT_AHEAD;
        if (ahead < blocks) {
            for (int i = 0; i < block_bytes; i += 64) __builtin_prefetch(BLOCK_AT(ahead + 2) + i, 0, 3);
            if (hp_ksplit_format(format) && (ahead + 2) % 8 == 0) /* its super-block's headers */
                for (int i = 0; i < 2 * hp_ksplit_head_bytes(format); i += 64)
                    __builtin_prefetch(panel + (int64_t)(ahead + 2) / 8 * hp_ksplit_super_bytes(format) + i, 0, 3);
            split_widen(format, BLOCK_AT(ahead), ring + (ahead % SPLIT_RING) * 1024);
            split_scales(format, panel, ahead, SCALES(ahead));
        }
        for (int h = 0; h < steps; h++) { /* a Q6S tile's rows 0-7 are inputs 0-15, rows 8-15 inputs 16-31 */
            const uint16_t *w = ring + (b % SPLIT_RING) * 1024 + h * 256;
            _tile_loadd(6, w, 64);
            _tile_loadd(7, w + 512, 64);
            for (int g = 0; g < groups; g++, j++) {
                const uint16_t *ag = a + (int64_t)g * 16 * LDA(K) + b * TILE_K + h * step;
                if (j % 2)
                    SPLIT_JOB(2, 3, ag, part, lda);
                else
                    SPLIT_JOB(0, 1, ag, part, lda);
                job_k[j % 3] = b * steps + h, job_g[j % 3] = g;
                if (j >= 2) EPILOGUE(j - 2); /* its sums stored an iteration ago */
                if (j >= 1) split_store((j - 1) % 2, s[(j - 1) % 2]);
            }
        }
    }
    if (j >= 2) EPILOGUE(j - 2);
    split_store((j - 1) % 2, s[(j - 1) % 2]);
    EPILOGUE(j - 1);
#undef EPILOGUE
#undef BLOCK_AT
#undef SCALES
    for (int r = 0; r < M; r++) {
        float *yr = yp + (int64_t)r * ldy;
        for (int c = 0; c < cols; c++) yr[c] = acc[32 * r + c] + (bias ? bias[n0 + c] : 0.0f);
    }
}

/* One body per format, its constants folded. */
#define SPLIT_BODY(NAME, FORMAT)                                                                                      \
    static __attribute__((noinline)) void NAME(int p, const uint16_t *a, int64_t part, const float *sums,            \
                                               const char *packed, const float *bias, float *yp, int64_t ldy, int M, \
                                               int N, int K, int groups) {                                            \
        split_panel_product(FORMAT, p, a, part, sums, packed, bias, yp, ldy, M, N, K, groups);                       \
    }
SPLIT_BODY(split_q4s, HP_Q4S)
SPLIT_BODY(split_q6s, HP_Q6S)
SPLIT_BODY(split_q8s, HP_Q8S)
SPLIT_BODY(split_q4ks, HP_Q4KS)
SPLIT_BODY(split_q6ks, HP_Q6KS)

int hp_linear_split_amx(int format, const float *x, int64_t ldx, const void *packed, const float *bias, float *y,
                        int64_t ldy, int M, int N, int K) {
    if (!hp_amx_bf16_available() || K % (hp_ksplit_format(format) ? 256 : TILE_K) || !hp_split_format(format))
        return -1;
    if (M <= 0 || N <= 0) return 0;
    const int groups = (M + 15) / 16, panels = (N + HP_BF16A_WIDTH - 1) / HP_BF16A_WIDTH;
    const int group = format == HP_Q4S || format == HP_Q4KS ? TILE_K : 0; /* m takes the rows' sums per block */
    const int per_row = group ? K / group : 0;
    const int64_t part = (int64_t)groups * 16 * LDA(K);
    /* the parts, then the sums; NOTE: a local: inside the parallel region, each thread would see its own buffer */
    uint16_t *a = thread_buffer(SPLIT_PARTS * part + 2 * (int64_t)groups * 16 * per_row);
    float *sums = (float *)(a + SPLIT_PARTS * part);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++) split_rows(x, ldx, a, part, sums, group, g * 16, g * 16 + 16, M, K);
        hp_amx_load_config(M < 16 ? M : 16, HP_BF16A_WIDTH, split_group(format)); /* accumulator sets take turns */
        /* NOTE: guided, as the other products */
#pragma omp for schedule(guided)
        for (int p = 0; p < panels; p++) {
            float *yp = y + (int64_t)p * HP_BF16A_WIDTH;
            if (format == HP_Q6S)
                split_q6s(p, a, part, sums, (const char *)packed, bias, yp, ldy, M, N, K, groups);
            else if (format == HP_Q8S)
                split_q8s(p, a, part, sums, (const char *)packed, bias, yp, ldy, M, N, K, groups);
            else if (format == HP_Q4KS)
                split_q4ks(p, a, part, sums, (const char *)packed, bias, yp, ldy, M, N, K, groups);
            else if (format == HP_Q6KS)
                split_q6ks(p, a, part, sums, (const char *)packed, bias, yp, ldy, M, N, K, groups);
            else
                split_q4s(p, a, part, sums, (const char *)packed, bias, yp, ldy, M, N, K, groups);
        }
        _tile_release();
    }
    return 0;
}

#else
int hp_linear_split_amx(int format, const float *x, int64_t ldx, const void *packed, const float *bias, float *y,
                        int64_t ldy, int M, int N, int K) {
    (void)format, (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K;
    return -1;
}
int hp_amx_bf16_available(void) { return 0; }
int hp_argmax_bf16c_amx(const float *x, int64_t ldx, const void *packed, int nr, int widened, int M, int N, int K,
                        int64_t *ids) {
    (void)x, (void)ldx, (void)packed, (void)nr, (void)widened, (void)M, (void)N, (void)K, (void)ids;
    return -1;
}
int hp_linear_bf16c_amx(const float *x, int64_t ldx, const void *packed, int nr, int widened, const float *bias,
                        float *y, int64_t ldy, int M, int N, int K) {
    (void)x, (void)ldx, (void)packed, (void)nr, (void)widened, (void)bias, (void)y, (void)ldy, (void)M, (void)N;
    (void)K;
    return -1;
}
#endif
