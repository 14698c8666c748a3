/* Reads of a packed weight's values rather than products of it: rows back out of its panels (an embedding table
 * tied to the LM head), the norms of its rows (the LM head's int8 screen), and compact panels widened to fp32 ones.
 * Every read gives the very fp32 values the products use, from any format of panels.h (and the AMX layouts). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "panels.h"

/* An fp16 value at p as a float (exact). */
static inline float half_float(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

/* Column n of Q4KS or Q6KS panels as split_column gives it: the scales from the super-block's header (amx.c's
 * split_scales), the q where ops.h's hp_ksplit_low_at and hp_ksplit_high_at place them. */
static void ksplit_column(int format, const char *packed, int64_t n, int K, float *row) {
    const int64_t p = n / HP_BF16A_WIDTH, half = n % HP_BF16A_WIDTH / 16, c = n % 16;
    for (int b = 0; b < K / 32; b++) {
        float scales[32];
        const int64_t head_bytes = hp_ksplit_head_bytes(format), tile_bytes = hp_ksplit_tile_bytes(format);
        const char *super = packed + (p * (K / 256) + b / 8) * hp_ksplit_super_bytes(format);
        const uint8_t *head = (const uint8_t *)super + half * head_bytes;
        const float d = half_float(head + 2 * c);
        if (format == HP_Q4KS) {
            scales[c] = d * (float)head[HP_Q4KS_SCALES_AT + 16 * (b % 8) + c];
            scales[16 + c] = -(half_float(head + HP_Q4KS_DMIN_AT + 2 * c) *
                               (float)head[HP_Q4KS_MINS_AT + 16 * (b % 8) + c]);
        } else {
            scales[c] = d * (float)(int8_t)head[HP_Q6KS_SCALES_AT + 16 * (2 * (b % 8)) + c];
            scales[16 + c] = d * (float)(int8_t)head[HP_Q6KS_SCALES_AT + 16 * (2 * (b % 8) + 1) + c];
        }
        const uint8_t *q = (const uint8_t *)super + 2 * head_bytes + ((b % 8) * 2 + half) * tile_bytes;
        for (int kk = 0; kk < 32; kk++) {
            const int r = kk / 2, pos = 2 * (int)c + kk % 2; /* the tile's row (a pair of k), the value's place */
            int v = q[hp_ksplit_low_at(r, pos) + r % 4 / 2] >> 4 * (r % 2) & 15;
            if (format == HP_Q4KS) {
                row[b * 32 + kk] = fmaf(scales[c], (float)v, scales[16 + c]);
            } else {
                v |= (q[HP_Q6KS_HIGH_AT + hp_ksplit_high_at(r, pos)] >> 2 * (r % 4) & 3) << 4;
                row[b * 32 + kk] = scales[16 * (kk / 16) + c] * (float)(v - 32);
            }
        }
    }
}

/* Column n of Q4S, Q6S, Q8S, Q4KS or Q6KS panels (the tiles' layouts: kernels/cpu/__init__.py's
 * pack_weight_q4a/q6a/q8a, ops.h's Q4KS and Q6KS) as its K weights in fp32: Q4S and Q4KS d q + m in one rounding,
 * as the Q4 panels' lanes; Q6S and Q6KS d (q - 32) and Q8S d q, exact. */
static void split_column(int format, const char *packed, int64_t n, int K, float *row) {
    if (hp_ksplit_format(format)) {
        ksplit_column(format, packed, n, K, row);
        return;
    }
    const int64_t tile = hp_widened_tile_bytes(format), half = n % HP_BF16A_WIDTH / 16;
    const int64_t p = n / HP_BF16A_WIDTH, high = n % HP_BF16A_WIDTH / 8 % 2, c = n % 16, at = 2 * (c % 8);
    for (int b = 0; b < K / 32; b++) {
        const char *t = packed + ((p * (K / 32) + b) * 2 + half) * tile;
        float scales[32];
        memcpy(scales, t, sizeof scales);
        for (int kk = 0; kk < 32; kk++) {
            const int r = kk / 2, e = kk % 2; /* the tile's row (a pair of k) and the pair's element */
            float v;
            if (format == HP_Q8S) {
                v = scales[c] * (float)(int8_t)t[64 + 32 * r + 16 * high + at + e];
            } else {
                const uint8_t byte = (uint8_t)t[128 + 16 * r + at + e];
                int q = high ? byte >> 4 : byte & 15;
                if (format == HP_Q4S) {
                    v = fmaf(scales[c], (float)q, scales[16 + c]);
                } else {
                    const uint8_t bits = (uint8_t)t[384 + 16 * (r / 2) + at + e];
                    q |= (bits >> (4 * (r % 2) + 2 * high) & 3) << 4;
                    v = scales[16 * (kk / 16) + c] * (float)(q - 32);
                }
            }
            row[b * 32 + kk] = v;
        }
    }
}

/* Rows of a weight [N, K] held as panels of any format of enum hp_weight_format but HP_I8: out[t] = w[ids[t]], the
 * very fp32 values the products use. Why: a tied LM head is also the embedding table, and reading the lookups from
 * its panels spares an fp32 row-major copy of the table (113 MB for SmolLM2-135M, 3.6 times its Q8 panels' 32 MB).
 * Returns the first t whose id is outside 0..N-1 (no row of out written from it on), or -1. */
/* The format whose bytes a read of a weight's values (hp_embed_rows, hp_row_norms) takes ``format``'s panels as. */
static int read_format(int format) {
    if (format == HP_BF16C) return BF16_PANELS; /* the same bytes; a lookup is the weight's bfloat16 value */
    /* Q4A, Q6A and Q8A panels are Q4S's, Q6S's and Q8S's bytes: a lookup is the fp32 value the tiles round to
     * bfloat16 (a tied LM head widened on AMX; the caller rounds the rows as the products do) */
    if (format == HP_Q4A || format == HP_Q6A || format == HP_Q8A) return format + HP_Q4S - HP_Q4A;
    return format;
}

int hp_embed_rows(int format, const void *packed, int N, int K, const int64_t *ids, int T, float *out) {
    format = read_format(format);
    for (int t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return t;
#pragma omp parallel for schedule(static) if (T >= 64)
    for (int t = 0; t < T; t++) {
        const int64_t p = ids[t] / NR, col = ids[t] % NR;
        float *row = out + (int64_t)t * K;
        if (hp_split_format(format)) {
            split_column(format, (const char *)packed, ids[t], K, row);
            continue;
        }
        if (format == HP_BF16A) { /* [panels, K / 2, width, 2] bfloat16 */
            const int64_t w = HP_BF16A_WIDTH, pa = ids[t] / w, ca = ids[t] % w;
            const uint16_t *panel = (const uint16_t *)packed + pa * K * w;
            for (int k = 0; k < K; k++) {
                const uint32_t bits = (uint32_t)panel[((int64_t)(k / 2) * w + ca) * 2 + k % 2] << 16;
                memcpy(row + k, &bits, sizeof bits);
            }
            continue;
        }
        if (format == F32_PANELS) {
            const float *panel = (const float *)packed + p * K * NR;
            for (int k = 0; k < K; k++) row[k] = panel[(int64_t)k * NR + col];
            continue;
        }
        float slice[KC * NR] __attribute__((aligned(64)));
        for (int k0 = 0; k0 < K; k0 += KC) {
            int kc = K - k0 < KC ? K - k0 : KC;
            unpack((const char *)packed + panel_bytes(p * K + k0, format), kc, slice, format);
            for (int k = 0; k < kc; k++) row[k0 + k] = slice[(int64_t)k * NR + col];
        }
    }
    return -1;
}

/* The Euclidean norm, in double, of each of the N rows of a weight [N, K] held as fp32, BF16 or block panels (the
 * formats hp_embed_rows unpacks): norms[j] = ||w[j]|| of the very fp32 values the products use. Each panel's slices
 * are unpacked once for all its NR rows, where reading the rows back one by one (hp_embed_rows) unpacks a whole
 * slice for each. Why: the LM head's int8 screen bounds its errors by these norms, and an 8B model's 128k-row Q8_0
 * head took 2.4 s of every start read back a row at a time. Returns 0, or -1 for a format it does not read. */
int hp_row_norms(int format, const void *packed, int N, int K, double *norms) {
    format = read_format(format); /* the split formats' columns are not NR-wide panels of slices: not read here */
    if (format == HP_BF16A || format == I8_PANELS || hp_split_format(format)) return -1;
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        double sums[NR] = {0};
        float slice[KC * NR] __attribute__((aligned(64)));
        for (int k0 = 0; k0 < K; k0 += KC) {
            const int kc = K - k0 < KC ? K - k0 : KC;
            const float *values = slice;
            if (format == F32_PANELS)
                values = (const float *)packed + (p * K + k0) * NR;
            else
                unpack((const char *)packed + panel_bytes(p * K + k0, format), kc, slice, format);
            for (int k = 0; k < kc; k++)
                for (int c = 0; c < NR; c++) sums[c] += (double)values[k * NR + c] * values[k * NR + c];
        }
        for (int c = 0; c < NR && p * NR + c < N; c++) norms[p * NR + c] = sqrt(sums[c]);
    }
    return 0;
}

/* The fp32 panels [panels, K, NR] of a weight held as compact panels (BF16, or blocks of Q4, Q8, Q5, Q6M and the
 * K-quants): the very fp32 slices the products unpack from them once they take more than MRF rows (panel_product),
 * so a product over either gives the same bits. Why: a step of many rows pays that widening at every step; a small
 * model can keep both, the compact panels for the few rows bound by their bytes, these for the many
 * (engine/backends/wide_panels.py). Returns 0, or -1 for a format whose products are not fp32 panels' (BF16C and
 * the AMX formats) or that is not compact (fp32, int8). */
int hp_widen_panels(int format, const void *packed, int N, int K, float *out) {
    if (format != BF16_PANELS && format != Q4_PANELS && format != Q8_PANELS && format != Q5_PANELS &&
        format != Q6M_PANELS && format != Q4K_PANELS && format != Q5K_PANELS && format != Q6K_PANELS)
        return -1;
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int k0 = 0; k0 < K; k0 += KC)
            unpack((const char *)packed + panel_bytes(p * K + k0, format), K - k0 < KC ? K - k0 : KC,
                   out + (p * K + k0) * NR, format);
    return 0;
}
