/* What turns the last hidden states into tokens without every logit: the greedy screen (exact argmax from approximate
 * logits and a bound, hp_screened_argmax), the argmax taken as AMX tiles produce the logits (hp_argmax_packed), and
 * a grammar's token mask applied in place (hp_apply_token_bitmask). */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "micro_kernel.h"
#include "products.h"

/* ids [M] = each row's argmax (torch's: the first of equal maxima, a NaN the largest) over the N columns of
 * hp_linear_packed(format, x, packed) without bias, from the same products, where AMX computes them (amx.c); else -1
 * and nothing written. */
int hp_argmax_packed(int word, const float *x, int64_t ldx, const void *packed, int M, int N, int K, int64_t *ids) {
    const int format = word & HP_FORMAT_BITS;
    if (format == HP_BF16C && hp_bf16_body(word) == HP_BF16_AMX)
        return hp_argmax_bf16c_amx(x, ldx, packed, NR, 0, M, N, K, ids);
    if (format == HP_BF16A || format == HP_Q4A || format == HP_Q6A || format == HP_Q8A)
        return hp_argmax_bf16c_amx(x, ldx, packed, HP_BF16A_WIDTH, format == HP_BF16A ? 0 : format, M, N, K, ids);
    return -1;
}

typedef double v4d __attribute__((vector_size(32), aligned(8)));
typedef float v4f __attribute__((vector_size(16), aligned(4)));
typedef long long v4l __attribute__((vector_size(32)));

/* Column j of hp_linear_packed's y = x . w^T for one row x and panels of ``format`` (fp32 or a block format),
 * computed as that product computes it: the same micro-kernel over j's panel, the same k blocks, the same store path
 * for a partial last panel (every row count gives a row the same bits). */
static float linear_column(const float *x, const void *packed, int N, int K, int j, int format) {
    int p = j / NR, n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR;
    float y[NR];
    for (int k0 = 0; k0 < K; k0 += KC) {
        int kc = K - k0 < KC ? K - k0 : KC;
        micro_kernel(1, x + k0, 0, (const char *)packed + panel_bytes((int64_t)p * K + k0, format), kc, y, NR, cols,
                     0, 0, k0 == 0, format, 0);
    }
    return y[j - n0];
}

/* Greedy tokens from approximate logits (engine/backends/greedy_head.py explains the bound): for row m of h [M, K],
 * every column j with approx_j + r_j >= max_i (approx_i - r_i), where r_j = s_m err_j bounds |approx_j - logit_j|,
 * may hold the argmax of the exact logits; each is recomputed as hp_linear_packed would (format, packed, N, K), and
 * the largest, lowest j on a tie, is tokens[m]. s_m is row_scale[m], or where row_scale is NULL ||h_m|| rounded up by
 * a relative 2^-20. In double, with a slack of 2^-30 of the magnitudes in the comparison, far above double's
 * rounding here. tokens[m] = -1 where a value is not finite or more than max_cand columns qualify: the caller then
 * computes all logits. */
void hp_screened_argmax(const float *h, int64_t ldh, int M, int K, const float *approx, const double *err,
                        const double *row_scale, int format, const void *packed, int N, int max_cand,
                        int64_t *tokens) {
    /* rows on both cores: each row reads every column's bound (49152 on SmolLM2), and a screened step may have
     * hundreds of rows (Int8ScreenedHead) */
#pragma omp parallel for schedule(dynamic) if (M > 1)
    for (int m = 0; m < M; m++) {
        const float *a = approx + (int64_t)m * N, *x = h + m * ldh;
        double sq = 0.0;
        if (!row_scale)
            for (int k = 0; k < K; k++) sq += (double)x[k] * x[k];
        const double norm = row_scale ? row_scale[m] : sqrt(sq) * (1.0 + 0x1p-20);
        const v4d vnorm = {norm, norm, norm, norm};
        v4d floor4 = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, widest4 = {0}, nan4 = {0};
        int j = 0;
        for (; j + 4 <= N; j += 4) {
            v4d aj = __builtin_convertvector(*(const v4f *)(a + j), v4d), r = vnorm * *(const v4d *)(err + j);
            v4d lo = aj - r;
            nan4 += aj - aj; /* NaN once any a_j is infinite or NaN */
            floor4 = (v4d)(((v4l)lo & (v4l)(lo > floor4)) | ((v4l)floor4 & ~(v4l)(lo > floor4)));
            widest4 = (v4d)(((v4l)r & (v4l)(r > widest4)) | ((v4l)widest4 & ~(v4l)(r > widest4)));
        }
        double floor = -INFINITY, widest = 0.0, nan = nan4[0] + nan4[1] + nan4[2] + nan4[3];
        for (int i = 0; i < 4; i++) {
            floor = floor4[i] > floor ? floor4[i] : floor;
            widest = widest4[i] > widest ? widest4[i] : widest;
        }
        for (; j < N; j++) {
            double r = norm * err[j];
            nan += a[j] - a[j];
            floor = a[j] - r > floor ? a[j] - r : floor;
            widest = r > widest ? r : widest;
        }
        tokens[m] = -1;
        if (!isfinite(norm) || nan != 0.0) continue;
        const double threshold = floor - 0x1p-30 * (1.0 + fabs(floor) + widest);
        int count = 0;
        float best = -INFINITY;
        for (j = 0; j < N && count <= max_cand; j++) {
            if (a[j] + norm * err[j] < threshold) continue;
            count++;
            float logit = linear_column(x, packed, N, K, j, format);
            if (tokens[m] < 0 || logit > best) best = logit, tokens[m] = j;
        }
        if (count > max_cand) tokens[m] = -1;
    }
}

/* Structured outputs: logits[rows[i]][t] = -inf wherever bit t of bitmask row i is clear (xgrammar's layout: word
 * t / 32, bit t % 32). NOTE: most words of a grammar's mask are all ones or all zeros, so those cost one compare;
 * torch's bit unpacking over the whole vocabulary took ~130 us a row of SmolLM2's 49152 tokens here. */
void hp_apply_token_bitmask(float *logits, int64_t ld, const int64_t *rows, const int32_t *bitmask, int num_rows,
                            int words, int vocab) {
    for (int i = 0; i < num_rows; i++) {
        float *row = logits + rows[i] * ld;
        const uint32_t *mask = (const uint32_t *)bitmask + (int64_t)i * words;
        for (int w = 0; w < words && w * 32 < vocab; w++) {
            const uint32_t m = mask[w];
            const int base = w * 32, n = vocab - base < 32 ? vocab - base : 32;
            if (m == 0xffffffffu) continue;
            for (int b = 0; b < n; b++) /* no branch on the bit: a mixed word's bits are unpredictable */
                row[base + b] = (m >> b) & 1u ? row[base + b] : -INFINITY;
        }
    }
}
