/* Paged decode attention: one query per token over its sequence's KV blocks, read in place from the pool (no
 * gather), for a whole batch of decodes and the tokens of prompt chunks; split-KV over chunks of positions so even
 * one sequence keeps every thread busy. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "arch/simd.h"
#include "ops.h"
#include "vec.h"

/* The largest of n floats (n >= 1), eight lanes at a time. */
static float max_of(const float *x, int n) {
    v8f m = splat8(x[0]);
    int i = 0;
    for (; i + 8 <= n; i += 8) m = select8(load8(x + i) > m, load8(x + i), m);
    float mx = m[0];
    for (int j = 1; j < 8; j++) mx = m[j] > mx ? m[j] : mx;
    for (; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    return mx;
}

/* x[i] = e^(x[i] - sub) for n floats, returning their sum: a softmax's numerators. */
static float exp_sub_sum(float *x, int n, float sub) {
    v8f acc = {0}, s = splat8(sub);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f e = exp8(load8(x + i) - s);
        store8(x + i, e);
        acc += e;
    }
    if (i < n) { /* the tail through the same function, so every position is computed alike */
        v8f tail = s;
        memcpy(&tail, x + i, sizeof(float) * (n - i));
        v8f e = exp8(tail - s);
        for (int j = 0; j < n - i; j++) {
            x[i + j] = e[j];
            acc[j] += e[j];
        }
    }
    return hsum8(acc);
}

/* Lane i of the result is the sum of the lanes of a[i]: eight horizontal sums in three shuffle-and-add levels. */
static inline v8f sum_lanes8(const v8f a[8]) {
    const v8i even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
    v8f t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], even) + __builtin_shuffle(a[2 * i], a[2 * i + 1], odd);
    /* t[i] = [a2i 0+1, 2+3, a2i+1 0+1, 2+3 | a2i 4+5, 6+7, a2i+1 4+5, 6+7] */
    for (int i = 0; i < 2; i++)
        u[i] = __builtin_shuffle(t[2 * i], t[2 * i + 1], even) + __builtin_shuffle(t[2 * i], t[2 * i + 1], odd);
    /* u[0] = [low halves of a0..a3 | high halves of a0..a3], u[1] the same for a4..a7 */
    const v8i lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = {4, 5, 6, 7, 12, 13, 14, 15};
    return __builtin_shuffle(u[0], u[1], lo) + __builtin_shuffle(u[0], u[1], hi);
}

/* Where the attention's prefetches go. */
#ifndef HP_PREFETCH_LOCALITY
#define HP_PREFETCH_LOCALITY 2 /* to L2 (T1): 3-12% less decode attention than to L1 at 1-64 sequences of 192-1024
                                * positions, every pool type, on a Xeon with AMX (python -m loadtest.lab.kernel_ab) */
#endif
/* The cache block holding positions p0..end of a chunk, every line of it asked for into L1. NOTE: the pool is cold
 * in a decode step (every weight streams through the caches between two layers), and from DRAM the attention read it
 * at ~10 GB/s where the same block order streams at ~25: its few loads in flight per 8 positions left the memory
 * idle while it computed. Asking for every line first puts them all in flight at once; with the block that comes
 * next prefetched to L2 under this one's arithmetic (struct trickle), they arrive from L2. A prefetch rather than a
 * load of each line (as this did before) lets the arithmetic start on the first lines while the last are on their
 * way: 2-11% less decode attention at 4-64 sequences of 192-1024 positions, int8, bfloat16 and fp32 pools, the same
 * at one sequence of 192 (Xeon with AMX, python -m loadtest.lab.kernel_ab). */
static inline const char *fetch_block(const void *cache, const int32_t *table, int p0, int end, int block_size,
                                      int64_t row) {
    const char *block = (const char *)cache + table[p0 / block_size] * (block_size * row);
    for (int64_t i = 0; i < (end - p0) * row; i += 64) __builtin_prefetch(block + i, 0, 3);
    return block;
}

/* The block read after the current one, prefetched to L2 a few lines per tile of arithmetic. NOTE: prefetching a
 * whole block in one burst (as this kernel did) stalled: a core has 16 line-fill buffers, a 3-12 KiB block is 51-192
 * lines, so the burst waited out the memory's latency several times over while no arithmetic ran. Spread over the
 * block's tiles, the requests stay within the buffers and the arithmetic hides them. */
struct trickle {
    const char *next; /* NULL: nothing to prefetch */
    int64_t bytes, done, step;
};

static inline struct trickle trickle_of(const char *next, int64_t bytes, int tiles) {
    const int64_t lines = (bytes + 63) / 64, per_tile = (lines + tiles - 1) / tiles; /* tiles >= 1 */
    return (struct trickle){next, bytes, 0, per_tile * 64};
}

/* Block b + 1 of a chunk's pass over cache, or NULL after its last block. */
static inline const char *block_after(const void *cache, const int32_t *table, int b, int last, int64_t block_bytes) {
    return b < last ? (const char *)cache + table[b + 1] * block_bytes : NULL;
}

static inline void trickle_some(struct trickle *t) {
    if (!t->next) return;
    const int64_t end = t->done + t->step < t->bytes ? t->done + t->step : t->bytes;
    for (; t->done < end; t->done += 64) __builtin_prefetch(t->next + t->done, 0, HP_PREFETCH_LOCALITY);
}

static inline void trickle_rest(struct trickle *t) {
    t->step = t->bytes;
    trickle_some(t);
}

/* Eight consecutive K/V values from element i of a head's row, as fp32: loaded, for a bfloat16 pool widened in the
 * register (exact), for an int8 pool widened without its scale (kv_scale). NOTE: widening each block into an fp32
 * copy first (the old staging) was half the attention's time: GCC split the widening into three shuffles and a store
 * per eight values. */
static inline v8f kv8(const void *base, int64_t i, int kv_format) {
    if (kv_format == HP_KV_F32) return load8((const float *)base + i);
    if (kv_format == HP_KV_I8) return widen8_i8((const int8_t *)base + i);
    return widen8_bf16((const uint16_t *)base + i);
}

/* kv8(a, i) and kv8(b, i) side by side, a's in the low lanes: the same values, widened in one register. */
static inline v16f kv8x2(const char *a, const char *b, int64_t i, int kv_format) {
    if (kv_format == HP_KV_F32) return pair8(load8((const float *)a + i), load8((const float *)b + i));
    if (kv_format == HP_KV_I8) return widen8x2_i8((const int8_t *)a + i, (const int8_t *)b + i);
    return widen8x2_bf16((const uint16_t *)a + i, (const uint16_t *)b + i);
}

/* Sixteen consecutive K/V values from element i of a head's row: kv8(base, i) and kv8(base, i + 8), one register. */
static inline v16f kv16(const void *base, int64_t i, int kv_format) {
    if (kv_format == HP_KV_F32) return *(const v16f *)((const float *)base + i);
    if (kv_format == HP_KV_I8) return widen16_i8((const int8_t *)base + i);
    return widen16_bf16((const uint16_t *)base + i);
}

/* The factor a head's row of D values carries: its scale in an int8 pool, else 1. */
static inline float kv_scale(const void *base, int D, int kv_format) {
    if (kv_format != HP_KV_I8) return 1.0f;
    float d;
    memcpy(&d, (const int8_t *)base + D, sizeof d);
    return d;
}

/* A position's weight s in the sum of V: with an int8 row's scale (that of row v) folded in. */
static inline float weight_of(float s, const char *v, int D, int kv_format) {
    return kv_format == HP_KV_I8 ? s * kv_scale(v, D, kv_format) : s;
}

/* dot(q, row) for a K row of any format (an int8 row without its scale), summed exactly as dot() sums fp32 rows. */
static inline float dot_kv(const float *q, const void *k, int n, int kv_format) {
    if (kv_format == HP_KV_F32) return dot(q, (const float *)k, n);
    v8f acc0 = {0}, acc1 = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 += load8(q + i) * kv8(k, i, kv_format);
        acc1 += load8(q + i + 8) * kv8(k, i + 8, kv_format);
    }
    for (; i + 8 <= n; i += 8) acc0 += load8(q + i) * kv8(k, i, kv_format);
    return hsum8(acc0 + acc1); /* n is a multiple of 8 */
}

/* Query heads of a group per register tile: with 32 registers 3 (3 x 8 accumulators + 3 + 1), with 16 one head at a
 * time. */
#define ATT_GT (HP_AVX512 ? 3 : 1)

/* acc[g][i] = the lane sums of query head g against the K vectors KV (of i < N, dims j .. j + 7), in VEC registers;
 * Q loads dims j .. j + 7 of a query head into one. */
#define SCORE_SUMS(VEC, N, acc, Q, KV)                                                                             \
    do {                                                                                                           \
        _Pragma("GCC unroll 3") for (int g = 0; g < ATT_GT; g++) for (int i = 0; i < (N); i++) acc[g][i] = (VEC){0}; \
        for (int j = 0; j < D; j += 8) {                                                                           \
            VEC qv[ATT_GT];                                                                                        \
            _Pragma("GCC unroll 3") for (int g = 0; g < ATT_GT; g++) if (g < G) qv[g] = Q(qg + g * D + j);         \
            for (int i = 0; i < (N); i++) {                                                                        \
                const VEC kv = KV;                                                                                 \
                _Pragma("GCC unroll 3") for (int g = 0; g < ATT_GT; g++) if (g < G) acc[g][i] += qv[g] * kv;       \
            }                                                                                                      \
        }                                                                                                          \
    } while (0)

/* Scores of positions p .. p+7 (head rows k, k + row, ... bytes) for G <= ATT_GT query heads qg (D apart): each K
 * vector is loaded once for all G heads. Per (head, position) the sum runs over the same 8-dim chunks and lane tree
 * as a single head's, so the bits do not depend on the tiling; an int8 row's scale multiplies its sum. With
 * AVX-512 a register holds two positions' 8 dims side by side (the same lanes, summed in the same order), so one
 * widening and one FMA serve two positions; with value_tile's 16 dims a register, a step's decode attention took
 * 7-15% less time at 16 and 64 sequences of 192 positions, every pool type, the same bits (Xeon with AMX, python -m
 * loadtest.lab.kernel_ab HEAD~1 HEAD --rows 1 --seqs 16,64 --context 192 --kv-dtype int8,bfloat16,float32). */
static inline __attribute__((always_inline)) void score_tile(const int D, int G, const float *qg, const char *k,
                                                             int64_t row, float *sg, int split, float scale,
                                                             const int kv_format) {
    v8f sums[ATT_GT][8];
    if (HP_AVX512) {
        v16f acc[ATT_GT][4];
        SCORE_SUMS(v16f, 4, acc, q8x2, kv8x2(k + 2 * i * row, k + (2 * i + 1) * row, j, kv_format));
#pragma GCC unroll 3
        for (int g = 0; g < ATT_GT; g++)
            for (int i = 0; i < 4; i++) sums[g][2 * i] = low8(acc[g][i]), sums[g][2 * i + 1] = high8(acc[g][i]);
    } else {
        SCORE_SUMS(v8f, 8, sums, load8, kv8(k + i * row, j, kv_format));
    }
    v8f scales = splat8(scale);
    if (kv_format == HP_KV_I8)
        for (int i = 0; i < 8; i++) scales[i] = kv_scale(k + i * row, D, kv_format) * scale;
#pragma GCC unroll 3
    for (int g = 0; g < ATT_GT; g++)
        if (g < G) store8(sg + g * split, sum_lanes8(sums[g]) * scales);
}
#undef SCORE_SUMS

/* The body of value_tile in VEC registers of LANES floats, KV widening a row's values into one. */
#define VALUE_TILE(VEC, LANES, KV, SPLAT)                                                                          \
    do {                                                                                                           \
        const int nv = DV * 8 / (LANES);                                                                           \
        VEC acc[ATT_GT][8];                                                                                        \
        _Pragma("GCC unroll 3") for (int g = 0; g < ATT_GT; g++) if (g < G) for (int j = 0; j < nv; j++)           \
            acc[g][j] = *(const VEC *)(o + g * o_stride + (LANES) * j);                                            \
        for (int p = 0; p < n; p++) {                                                                              \
            VEC wv[ATT_GT];                                                                                        \
            _Pragma("GCC unroll 3") for (int g = 0; g < ATT_GT; g++) if (g < G)                                    \
                wv[g] = SPLAT(weight_of(sg[g * split + p], v + p * row, D, kv_format));                            \
            for (int j = 0; j < nv; j++) {                                                                         \
                const VEC vv = KV(v + p * row, d0 + (LANES) * j, kv_format);                                       \
                _Pragma("GCC unroll 3") for (int g = 0; g < ATT_GT; g++) if (g < G) acc[g][j] += wv[g] * vv;       \
            }                                                                                                      \
        }                                                                                                          \
        _Pragma("GCC unroll 3") for (int g = 0; g < ATT_GT; g++) if (g < G) for (int j = 0; j < nv; j++)           \
            *(VEC *)(o + g * o_stride + (LANES) * j) = acc[g][j];                                                  \
    } while (0)

/* o[g] (+)= sum over positions p0..end of s[g][p] v[p], for G <= ATT_GT query heads sharing the KV head of v (its
 * head rows v, v + row, ... bytes, D values each), the dims d0 .. d0 + 8 DV of each: each V vector is loaded once for
 * all G heads, and each (head, dim) sums the positions in order, as one head at a time would. An int8 row's scale
 * joins its weight s[g][p]. With AVX-512 (and DV even) the dims go 16 to a register: the same sums, per lane. */
static inline __attribute__((always_inline)) void value_tile(const int D, const int DV, int d0, int G, const float *sg,
                                                             int split, const char *v, int64_t row, int n, float *o,
                                                             int64_t o_stride, const int kv_format) {
    if (HP_AVX512 && DV % 2 == 0) {
        VALUE_TILE(v16f, 16, kv16, splat16);
        return;
    }
    VALUE_TILE(v8f, 8, kv8, splat8);
}
#undef VALUE_TILE

/* Queries a task of decode attention takes at most: a prompt chunk's consecutive tokens over the same block table
 * share each cache block's loads (one sequence, each token's context one position longer than the one before).
 * NOTE: a prompt token rides along as a decode query over its prefix (decoder.c); one at a time, each read the
 * whole prefix from memory again, though its arithmetic is that of a decode. Runs of up to 8 took 32% / 36% / 42%
 * off a 64-client step's attention (54 decodes of 192 positions and 54 prompt tokens from position 64; int8,
 * bfloat16 and fp32 pools), 4 a little less, 16 less (its last tasks ran long on one thread); decodes alone the
 * same (Xeon with AMX, python -m loadtest.lab.kernel_ab --prompt 54@64). */
#ifndef HP_ATT_QUERIES
#define HP_ATT_QUERIES 8
#endif

/* A task's queries (a decode alone, or consecutive tokens of a prompt chunk) over one chunk of their sequence: query
 * m's heads at q + m q_stride, its len[m] positions of the chunk (<= 0: the chunk is past its context), its scores
 * at scores + m num_heads split, its (max, sum, acc) per head at mine[m]. */
struct chunk_queries {
    int n, longest, reach; /* queries; the most positions one reaches; how many reach any */
    const float *q;
    int64_t q_stride;
    const int *len;
    float *scores;
    float *const *mine;
};

/* Scores of every query head against K, block by block and, inside a block, query by query and KV head by KV head,
 * the query heads of its group a few at a time (score_tile): each cache row (all KV heads of a position,
 * contiguous) is read whole while it is in cache, each of its vectors once per tile of query heads, and the block
 * stays in L1 for every query of the task. */
static inline __attribute__((always_inline)) void chunk_scores(const int D, int num_kv_heads, int group,
                                                               struct chunk_queries c, const void *k_cache,
                                                               const void *v_cache, const int32_t *table,
                                                               int block_size, float scale, int split,
                                                               const int kv_format) {
    const int tiles = num_kv_heads * ((group + ATT_GT - 1) / ATT_GT), last = (c.longest - 1) / block_size;
    const int64_t hb = kv_head_bytes(D, kv_format), row = num_kv_heads * hb; /* bytes of a head's row, a position's */
    const int64_t block_bytes = block_size * row, per_query = (int64_t)num_kv_heads * group * split;
    for (int p0 = 0; p0 < c.longest; p0 += block_size) {
        const int top = p0 + block_size < c.longest ? p0 + block_size : c.longest, b = p0 / block_size;
        const char *kb = fetch_block(k_cache, table, p0, top, block_size, row);
        const char *next = block_after(k_cache, table, b, last, block_bytes); /* after K's last block, V's first */
        struct trickle t = trickle_of(next ? next : (const char *)v_cache + table[0] * block_bytes, block_bytes,
                                      c.reach * tiles * ((top - p0 + 7) / 8));
        for (int m = 0; m < c.n; m++) {
            const int end = p0 + block_size < c.len[m] ? p0 + block_size : c.len[m];
            for (int h = 0; h < num_kv_heads && end > p0; h++)
                for (int g0 = 0; g0 < group; g0 += ATT_GT) {
                    const int G = group - g0 < ATT_GT ? group - g0 : ATT_GT;
                    const float *qg = c.q + m * c.q_stride + (int64_t)(h * group + g0) * D;
                    float *sg = c.scores + m * per_query + (int64_t)(h * group + g0) * split;
                    int p = p0;
                    for (; p + 8 <= end; p += 8) {
                        trickle_some(&t);
                        if (G == ATT_GT) /* a constant: no test of G in the loops */
                            score_tile(D, ATT_GT, qg, kb + (p - p0) * row + h * hb, row, sg + p, split, scale,
                                       kv_format);
                        else
                            score_tile(D, G, qg, kb + (p - p0) * row + h * hb, row, sg + p, split, scale, kv_format);
                    }
                    for (; p < end; p++) {
                        const char *k = kb + (p - p0) * row + h * hb;
                        const float s = kv_format == HP_KV_I8 ? kv_scale(k, D, kv_format) * scale : scale;
                        for (int g = 0; g < G; g++) sg[g * split + p] = dot_kv(qg + g * D, k, D, kv_format) * s;
                    }
                }
        }
        trickle_rest(&t);
    }
}

/* Each query head's weighted sum of V into its acc (mine), block by block and query by query as chunk_scores goes,
 * each V vector loaded once for the tile of query heads sharing it (value_tile). */
static inline __attribute__((always_inline)) void chunk_values(const int D, int num_kv_heads, int group,
                                                               struct chunk_queries c, const void *v_cache,
                                                               const int32_t *table, int block_size, int split,
                                                               const int kv_format) {
    const int tiles = num_kv_heads * ((group + ATT_GT - 1) / ATT_GT), last = (c.longest - 1) / block_size;
    const int64_t hb = kv_head_bytes(D, kv_format), row = num_kv_heads * hb;
    const int64_t block_bytes = block_size * row, per_query = (int64_t)num_kv_heads * group * split;
    for (int p0 = 0; p0 < c.longest; p0 += block_size) {
        const int top = p0 + block_size < c.longest ? p0 + block_size : c.longest, b = p0 / block_size;
        const char *vb = fetch_block(v_cache, table, p0, top, block_size, row);
        struct trickle t = trickle_of(block_after(v_cache, table, b, last, block_bytes), block_bytes,
                                      c.reach * tiles * ((D + 63) / 64));
        for (int m = 0; m < c.n; m++) {
            const int end = p0 + block_size < c.len[m] ? p0 + block_size : c.len[m];
            for (int h = 0; h < num_kv_heads && end > p0; h++)
                for (int g0 = 0; g0 < group; g0 += ATT_GT) {
                    const int G = group - g0 < ATT_GT ? group - g0 : ATT_GT, hg = h * group + g0;
                    for (int d0 = 0; d0 < D; d0 += 64) { /* 64 dims (8 vectors) a tile, or what remains of the head */
                        trickle_some(&t);
                        const int DV = D - d0 < 64 ? (D - d0) / 8 : 8;
                        const float *sv = c.scores + m * per_query + (int64_t)hg * split + p0;
                        float *o = c.mine[m] + hg * (D + 2) + 2 + d0;
                        if (G == ATT_GT)
                            value_tile(D, DV, d0, ATT_GT, sv, split, vb + h * hb, row, end - p0, o, D + 2,
                                       kv_format);
                        else
                            value_tile(D, DV, d0, G, sv, split, vb + h * hb, row, end - p0, o, D + 2, kv_format);
                    }
                }
        }
        trickle_rest(&t);
    }
}

/* One chunk of decode attention for a task's queries, every head: scores against the cached positions
 * (chunk_scores), then exp and sum (kept unnormalised with their max, for the merge), then the weighted sum of V
 * (chunk_values). Each query's sums run in the order they run for it alone, so its bits do not depend on the other
 * queries. NOTE: reading one head's 256 bytes out of every 768-byte row (a task per KV head) ran at a third of the
 * memory bandwidth on the development machines (~10 GB/s of used bytes vs ~30), as the lines in between were
 * fetched anyway. Sharing each K and V vector across the heads of a group took the hot attention from one load per
 * FMA (load-bound) to ~3 FMAs per load. Inlined with a constant head_dim (64, 128). */
static inline __attribute__((always_inline)) void attend_chunk_d(
    const int D, int num_kv_heads, int group, int n, const float *q, int64_t q_stride, const void *k_cache,
    const void *v_cache, const int32_t *table, int block_size, const int *len, float scale, float *scores, int split,
    float *const *mine, const int kv_format) {
    struct chunk_queries c = {n, 0, 0, q, q_stride, len, scores, mine};
    for (int m = 0; m < n; m++) c.longest = len[m] > c.longest ? len[m] : c.longest, c.reach += len[m] > 0;
    if (c.longest <= 0) return;
    chunk_scores(D, num_kv_heads, group, c, k_cache, v_cache, table, block_size, scale, split, kv_format);
    const int num_heads = num_kv_heads * group;
    for (int m = 0; m < n; m++)
        for (int hg = 0; len[m] > 0 && hg < num_heads; hg++) {
            float *sg = scores + (m * num_heads + hg) * (int64_t)split, mx = max_of(sg, len[m]);
            float *stats = mine[m] + hg * (D + 2);
            stats[0] = mx;
            stats[1] = exp_sub_sum(sg, len[m], mx);
            memset(stats + 2, 0, sizeof(float) * D);
        }
    chunk_values(D, num_kv_heads, group, c, v_cache, table, block_size, split, kv_format);
}

static void attend_chunk(int head_dim, int num_kv_heads, int group, int n, const float *q, int64_t q_stride,
                         const void *k_cache, const void *v_cache, const int32_t *table, int block_size,
                         const int *len, float scale, float *scores, int split, float *const *mine, int kv_format) {
#define ATTEND_D(D, FORMAT)                                                                                        \
    attend_chunk_d(D, num_kv_heads, group, n, q, q_stride, k_cache, v_cache, table, block_size, len, scale, scores, \
                   split, mine, FORMAT)
#define ATTEND(FORMAT)                                                                                             \
    (head_dim == 64 ? ATTEND_D(64, FORMAT) : head_dim == 128 ? ATTEND_D(128, FORMAT) : ATTEND_D(head_dim, FORMAT))
    if (kv_format == HP_KV_BF16)
        ATTEND(HP_KV_BF16);
    else if (kv_format == HP_KV_I8)
        ATTEND(HP_KV_I8);
    else
        ATTEND(HP_KV_F32);
#undef ATTEND
#undef ATTEND_D
}

/* Whether token t's query continues the run of queries that token `lead` starts: its context one position longer
 * than token t - 1's, over the blocks of lead's table (the one every query of the run reads). */
static int continues(const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, int t, int lead,
                     int block_size) {
    if (seq_lens[t] != seq_lens[t - 1] + 1) return 0;
    const int blocks = (seq_lens[t] + block_size - 1) / block_size;
    return memcmp(tables + t * table_stride, tables + lead * table_stride, sizeof(int32_t) * blocks) == 0;
}

/* Attention of one query token per sequence over its paged context, for a whole batch of decodes.
 *   q:      [num_seqs, num_heads, head_dim] (token stride q_stride)
 *   cache:  [num_blocks, block_size, num_kv_heads, head_dim] for K and for V, of the type kv_format names
 *   tables: [num_seqs, table_stride] int32 block ids; seq_lens: [num_seqs] int32 context lengths
 *   out:    [num_seqs, num_heads, head_dim] (token stride out_stride)
 * A task is one chunk of up to `split` positions of a run of queries (a decode alone, or up to HP_ATT_QUERIES
 * consecutive tokens of a prompt chunk), with all their heads. Long contexts split into chunks keep both cores busy
 * even for one sequence; each chunk keeps its max and sum per head, and a second pass merges the chunks (split-KV,
 * as the Triton kernel does). Within a chunk the softmax is exact: scores kept, max subtracted. Small batches get
 * short chunks, so even a single sequence makes enough tasks for every thread.
 *
 *     tokens    t0 t1 t2 t3 | t4 t5 t6 t7       (t3..t7 one prompt chunk: contexts 97, 98, ..., 101)
 *     runs      t0 t1 t2 t3..t7                  (run = tokens sharing each block's loads)
 *     tasks     (run, chunk of positions 0..255), (run, 256..511), ...; a query's chunks: those its context reaches */
void hp_paged_decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                               const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, float *out,
                               int64_t out_stride, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                               int block_size, float scale, int kv_format) {
    int group = num_heads / num_kv_heads;
    int split = num_seqs >= 8 ? 256 : 64;
    split = (split + block_size - 1) / block_size * block_size; /* chunks start on block boundaries */
    /* first chunk of each sequence (its partials' index), and the runs of queries: run r is tokens
     * run0[r] .. run0[r + 1] - 1, its tasks task0[r] .. task0[r + 1] - 1 (the last token's chunks) */
    int *chunk0 = malloc(sizeof(int) * (num_seqs + 1)), *run0 = malloc(sizeof(int) * (num_seqs + 1));
    int *task0 = malloc(sizeof(int) * (num_seqs + 1)), runs = 0;
    chunk0[0] = 0, task0[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        chunk0[s + 1] = chunk0[s] + (seq_lens[s] + split - 1) / split;
        if (s == 0 || s - run0[runs - 1] >= HP_ATT_QUERIES ||
            !continues(tables, table_stride, seq_lens, s, run0[runs - 1], block_size))
            run0[runs++] = s;
    }
    run0[runs] = num_seqs;
    int widest = 1; /* the most queries of a run: the scores each thread holds at once */
    for (int r = 0; r < runs; r++) {
        task0[r + 1] = task0[r] + (seq_lens[run0[r + 1] - 1] + split - 1) / split;
        widest = run0[r + 1] - run0[r] > widest ? run0[r + 1] - run0[r] : widest;
    }
    int num_chunks = chunk0[num_seqs], num_tasks = task0[runs];
    /* per chunk and query head: (max, sum, acc[head_dim]) */
    int64_t part = (int64_t)num_heads * (head_dim + 2);
    float *partial = malloc(sizeof(float) * (size_t)num_chunks * part);
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)widest * num_heads * split);
        int r = 0;
        /* NOTE: guided, as the products' panels: a thread's tasks in runs of consecutive ones took 2-7% off a
         * step's attention against one task at a time (dynamic, 1), at 1-64 sequences and 192-4096 positions. */
#pragma omp for schedule(guided)
        for (int c = 0; c < num_tasks; c++) {
            while (task0[r + 1] <= c) r++;
            while (task0[r] > c) r--;
            const int s0 = run0[r], n = run0[r + 1] - s0, first = (c - task0[r]) * split;
            int len[HP_ATT_QUERIES];
            float *mine[HP_ATT_QUERIES];
            for (int m = 0; m < n; m++) {
                const int rest = seq_lens[s0 + m] - first;
                len[m] = rest < split ? rest : split;
                mine[m] = partial + (int64_t)(chunk0[s0 + m] + c - task0[r]) * part; /* unused where len <= 0 */
            }
            attend_chunk(head_dim, num_kv_heads, group, n, q + (int64_t)s0 * q_stride, q_stride, k_cache, v_cache,
                         tables + (int64_t)s0 * table_stride + first / block_size, block_size, len, scale, scores,
                         split, mine, kv_format);
        }
        free(scores);
        /* merge: out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c */
#pragma omp for schedule(static)
        for (int t = 0; t < num_seqs * num_heads; t++) {
            int seq = t / num_heads, hg = t % num_heads;
            float mx = -INFINITY, sum = 0.0f;
            for (int c = chunk0[seq]; c < chunk0[seq + 1]; c++) {
                float m = partial[(int64_t)c * part + hg * (head_dim + 2)];
                mx = m > mx ? m : mx;
            }
            float *o = out + (int64_t)seq * out_stride + (int64_t)hg * head_dim;
            memset(o, 0, sizeof(float) * head_dim);
            for (int c = chunk0[seq]; c < chunk0[seq + 1]; c++) {
                const float *stats = partial + (int64_t)c * part + hg * (head_dim + 2);
                float w = expf(stats[0] - mx);
                sum += w * stats[1];
                for (int d = 0; d < head_dim; d++) o[d] += w * stats[2 + d];
            }
            float inv = 1.0f / sum;
            for (int d = 0; d < head_dim; d++) o[d] *= inv;
        }
    }
    free(partial);
    free(chunk0);
    free(run0);
    free(task0);
}
