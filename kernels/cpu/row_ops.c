#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "ops.h"
#include "vec.h"

/* The small per-layer operations, each one pass over its rows. Work below ~16k elements stays on the calling
 * thread: waking the other OpenMP thread costs more than a decode row's arithmetic. */
#define PAR_MIN 16384

static void rms_row(const float *x, const float *w, float *out, int D, float eps) {
    v8f acc = {0};
    int d = 0;
    for (; d + 8 <= D; d += 8) acc += load8(x + d) * load8(x + d);
    float ss = hsum8(acc);
    for (; d < D; d++) ss += x[d] * x[d];
    float r = 1.0f / sqrtf(ss / D + eps);
    for (d = 0; d < D; d++) out[d] = w[d] * (x[d] * r);
}

/* out = w * x / rms(x), row by row (transformers' order: normalise, then scale). */
void hp_rms_norm(const float *x, int64_t ldx, const float *w, float *out, int M, int D, float eps) {
#pragma omp parallel for schedule(static) if ((int64_t)M * D >= PAR_MIN)
    for (int m = 0; m < M; m++) rms_row(x + m * ldx, w, out + (int64_t)m * D, D, eps);
}

/* residual += x, then out = rms_norm(residual): the residual add of one sublayer fused with the next norm. */
void hp_add_rms_norm(const float *x, float *residual, const float *w, float *out, int M, int D, float eps) {
#pragma omp parallel for schedule(static) if ((int64_t)M * D >= PAR_MIN)
    for (int m = 0; m < M; m++) {
        float *r = residual + (int64_t)m * D;
        const float *xm = x + (int64_t)m * D;
        for (int d = 0; d < D; d++) r[d] += xm[d];
        rms_row(r, w, out + (int64_t)m * D, D, eps);
    }
}

/* Rotary embedding in place on num_heads heads of each token row (the q heads and the k heads that follow them in
 * a fused qkv row): x * cos + rotate_half(x) * sin with tables [max_position, head_dim]. */
void hp_rotary(float *x, int64_t ldx, const int64_t *positions, const float *cos_cache, const float *sin_cache,
               int T, int num_heads, int head_dim) {
    int half = head_dim / 2;
#pragma omp parallel for schedule(static) if ((int64_t)T * num_heads * head_dim >= PAR_MIN)
    for (int t = 0; t < T; t++) {
        const float *c = cos_cache + positions[t] * head_dim, *s = sin_cache + positions[t] * head_dim;
        for (int h = 0; h < num_heads; h++) {
            float *v = x + t * ldx + (int64_t)h * head_dim;
            for (int i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* out [M, I] = silu(gate) * up for gate_up rows [M, 2I]. */
void hp_silu_mul(const float *gate_up, float *out, int M, int I) {
#pragma omp parallel for schedule(static) if ((int64_t)M * I >= PAR_MIN)
    for (int m = 0; m < M; m++) {
        const float *g = gate_up + (int64_t)m * 2 * I, *u = g + I;
        float *o = out + (int64_t)m * I;
        int i = 0;
        for (; i + 8 <= I; i += 8) {
            v8f gv = load8(g + i), y = gv / (splat8(1.0f) + exp8(-gv)) * load8(u + i);
            store8(o + i, y);
        }
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
