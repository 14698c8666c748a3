/* Q8X products on AMX tiles: per 32 k (16 for Q6K and Q6M, whose scales are per 16) of a panel, one tile op sums
 * 16 rows' int8 activations times the panel's 24 columns of weights as integers (TDPBSUD for nibbles, which are
 * unsigned, Q6K's q + 32 among them; TDPBSSD for signed bytes, with no offset to take back off), and the vector
 * units fold each sum into the float sums with q8x_fix_up's operations (q8x_fix_up_row). An integer sum is exact in
 * any order, and each float sum takes the same fix-ups in the same order, the same KC slices, as Q8X_SUMS gives it,
 * so a row's outputs are those of the VNNI body to the bit, whichever rows share its batch. Why: vpdpbusd sums 32
 * products an instruction, a tile op 8192. Tiles as amx.c configures them: 0-1 and 2-3 a row group's sums (columns
 * 0-15, 16-23) for alternate blocks, 4 and 5 its activations, 6 and 7 the weights. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "../../products.h"
#include "../../q8x.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__linux__) && NV == 3
#define Q8X_TILE_ROW (NR * 4)                   /* bytes of a row of weights as the tiles take them: k / 4 */
#define Q8X_TILE_BLOCK (Q8_GROUP / 4 * Q8X_TILE_ROW) /* a 32-k block of them */

/* A block's scales (block_at's d and m of both halves, for the NV vectors of columns: 24 floats in a row). */
struct q8x_scales {
    v8f d[2][NV], m[2][NV];
};

/* One row's tile sums s (24 columns) of a run of k with one weight scale folded into its float sums c: q8x_fix_up's
 * operations, lane by lane the same (so the same bits), 16 columns a register and the last 8 in a half. */
static inline __attribute__((always_inline)) void q8x_fix_up_row(float *c, const int32_t *s, const struct q8x_row *a,
                                                                 int b, int h, const struct q8x_scales *sc, int fold,
                                                                 float offset, int format) {
    const int32_t *sums = a->sums + 2 * b;
    const float sum = (float)(scales_per_half(format) ? sums[h] : sums[0] + sums[1]), dx = a->d[b], dsum = dx * sum;
    const int with_m = format != Q6K_PANELS && block_with_m(format); /* Q6K's m is taken off in the integers */
    const float *d = (const float *)sc->d[fold], *m = (const float *)sc->m[fold];
    __m512 lo = _mm512_cvtepi32_ps(_mm512_load_si512(s));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)(s + 16)));
    if (offset != 0.0f) {
        lo = _mm512_sub_ps(lo, _mm512_set1_ps(offset * sum));
        hi = _mm256_sub_ps(hi, _mm256_set1_ps(offset * sum));
    }
    __m512 clo = _mm512_fmadd_ps(_mm512_loadu_ps(d), _mm512_mul_ps(lo, _mm512_set1_ps(dx)), _mm512_load_ps(c));
    __m256 chi = _mm256_fmadd_ps(_mm256_loadu_ps(d + 16), _mm256_mul_ps(hi, _mm256_set1_ps(dx)),
                                 _mm256_load_ps(c + 16));
    if (with_m) {
        clo = _mm512_fmadd_ps(_mm512_loadu_ps(m), _mm512_set1_ps(dsum), clo);
        chi = _mm256_fmadd_ps(_mm256_loadu_ps(m + 16), _mm256_set1_ps(dsum), chi);
    }
    _mm512_store_ps(c, clo);
    _mm256_store_ps(c + 16, chi);
}

/* The KC slice of panel p from block b0 on (kc k), every row: its weights widened once into the tiles' layout (row
 * 4 h + t: the NV vectors q8x_weights gives for activation word 4 h + t, raw bytes for byte formats) and its scales
 * read, then each row group's sums, fix-ups and stores. ``format`` constant per instance. */
static inline __attribute__((always_inline)) void q8x_amx_slice(const struct q8x_row *rows, int M, int K, int b0,
                                                                const void *panel, int kc, float *y, int64_t ldy,
                                                                int cols, const float *bias, int first, int format) {
    int8_t weights[KC / Q8_GROUP * Q8X_TILE_BLOCK] __attribute__((aligned(64)));
    struct q8x_scales scales[KC / Q8_GROUP];
    int32_t sums[2 * 16 * 32] __attribute__((aligned(64))); /* two jobs' tile sums, rows 32 apart */
    float c[16 * 32] __attribute__((aligned(64)));      /* its float sums, the same layout */
    const int blocks = kc / Q8_GROUP, halves = scales_per_half(format), step = halves ? 16 : Q8_GROUP;
    const int64_t lda = K; /* a row's int8 words, K bytes, the next row's after them (linear_q8x) */
    const float offset = format == Q6K_PANELS ? 32.0f : 0.0f;
    for (int i = 0; i < blocks; i++) {
        struct q8x_scales *sc = scales + i;
        const v8iu *words = 0;
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            words = block_at(panel, i * Q8_GROUP, format, v, &sc->d[0][v], &sc->d[1][v], &sc->m[0][v], &sc->m[1][v]);
        for (int j = 0; j < 8; j++) {
            v8i u[NV];
            q8x_weights(words, j / 4, j % 4, format, splat8i(0), u);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) memcpy(weights + i * Q8X_TILE_BLOCK + j * Q8X_TILE_ROW + 32 * v, &u[v], 32);
        }
    }
    const int jobs = blocks * (1 + halves); /* job j: half j % 2 of block j / 2 (halves), or block j */
    for (int g = 0; g < M; g += 16) {
        const int group = M - g < 16 ? M - g : 16;
        memset(c, 0, sizeof c);
        /* Job j's tile ops go to accumulator set j % 2 (tiles 0-1 or 2-3); its sums are stored once job j + 1's ops
         * are issued, and folded in one job later still, so the vector units' fix-ups overlap the tiles' work and
         * no load waits on the tile store it reads (as amx.c's split products do). */
#define Q8X_JOB_OPS(ACC0, ACC1, A, j)                                                                                 \
    do {                                                                                                              \
        const int i_ = halves ? (j) / 2 : (j), h_ = halves ? (j) % 2 : 0;                                            \
        const int8_t *w_ = weights + i_ * Q8X_TILE_BLOCK + h_ * (step / 4) * Q8X_TILE_ROW;                          \
        _tile_zero(ACC0);                                                                                             \
        _tile_zero(ACC1);                                                                                             \
        _tile_loadd(6, w_, Q8X_TILE_ROW);                                                                             \
        _tile_loadd(7, w_ + 64, Q8X_TILE_ROW);                                                                        \
        _tile_loadd(A, (const char *)(rows[g].words + (int64_t)(b0 + i_) * 8) + h_ * step, lda);                      \
        if (block_nibbles(format)) {                                                                                  \
            _tile_dpbsud(ACC0, A, 6);                                                                                 \
            _tile_dpbsud(ACC1, A, 7);                                                                                 \
        } else {                                                                                                      \
            _tile_dpbssd(ACC0, A, 6);                                                                                 \
            _tile_dpbssd(ACC1, A, 7);                                                                                 \
        }                                                                                                             \
    } while (0)
        for (int j = 0; j <= jobs + 1; j++) {
            if (j < jobs && j % 2)
                Q8X_JOB_OPS(2, 3, 5, j);
            else if (j < jobs)
                Q8X_JOB_OPS(0, 1, 4, j);
            if (j >= 1 && j <= jobs) { /* job j - 1's sums, into buffer (j - 1) % 2 */
                int32_t *s = sums + ((j - 1) % 2) * 16 * 32;
                if ((j - 1) % 2) {
                    _tile_stored(2, s, 128);
                    _tile_stored(3, s + 16, 128);
                } else {
                    _tile_stored(0, s, 128);
                    _tile_stored(1, s + 16, 128);
                }
            }
            if (j >= 2) { /* job j - 2's fix-ups */
                const int e = j - 2, i = halves ? e / 2 : e, h = halves ? e % 2 : 0;
                const int fold = halves ? h : 1; /* Q8X_SUMS folds a whole block at its second half */
                const int32_t *s = sums + (e % 2) * 16 * 32;
                for (int r = 0; r < group; r++)
                    q8x_fix_up_row(c + 32 * r, s + 32 * r, rows + g + r, b0 + i, h, scales + i, fold, offset, format);
            }
        }
#undef Q8X_JOB_OPS
        for (int r = 0; r < group; r++) {
            v8f cr[NV];
            memcpy(cr, c + 32 * r, sizeof cr);
            store_tile_row(y + (int64_t)(g + r) * ldy, cr, cols, bias, first);
        }
    }
}

/* Panel p of a Q8X product on the tiles, every row, KC k at a time as panel_product_q8x. */
static inline __attribute__((always_inline)) void panel_product_q8x_amx(int p, const struct q8x_row *rows, int M,
                                                                        const void *packed, const float *bias,
                                                                        float *y, int64_t ldy, int N, int K,
                                                                        int format) {
    const int n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR;
    for (int k0 = 0; k0 < K; k0 += KC) {
        const void *panel = (const char *)packed + panel_bytes((int64_t)p * K + k0, format);
        const int kc = K - k0 < KC ? K - k0 : KC, last = k0 + KC >= K;
        q8x_amx_slice(rows, M, K, k0 / Q8_GROUP, panel, kc, y + n0, ldy, cols, bias && last ? bias + n0 : 0,
                      k0 == 0, format);
    }
}

#define Q8X_AMX_LOOP(format)                                                                                          \
    _Pragma("omp parallel") {                                                                                         \
        hp_amx_load_config(M < 16 ? M : 16, NR, scales_per_half(format) ? 8 : 16);                                     \
        _Pragma("omp for schedule(guided)") for (int p = 0; p < (N + NR - 1) / NR; p++)                               \
            panel_product_q8x_amx(p, rows, M, packed, bias, y, ldy, N, K, format);                                    \
        _tile_release();                                                                                              \
    }

void hp_q8x_amx(int format, const struct q8x_row *rows, int M, const void *packed, const float *bias, float *y,
                int64_t ldy, int N, int K) {
    Q8X_FOR_FORMAT(format, Q8X_AMX_LOOP)
}

int hp_q8x_tiles_available(void) { return hp_amx_bf16_available(); }
#else
void hp_q8x_amx(int format, const struct q8x_row *rows, int M, const void *packed, const float *bias, float *y,
                int64_t ldy, int N, int K) {
    (void)format, (void)rows, (void)M, (void)packed, (void)bias, (void)y, (void)ldy, (void)N, (void)K; /* never */
}

int hp_q8x_tiles_available(void) { return 0; }
#endif
