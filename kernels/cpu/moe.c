/* A mixture-of-experts block over packed panels: the router's softmax top-k and the chosen experts' SwiGLU MLPs,
 * each expert once over just the tokens that chose it.
 *
 * Why: run from Python, a decode step of a 48-layer, 8-of-128-expert model made ~60 module and kernel calls a layer
 * (Qwen3-30B-A3B: 134 ms a token served, against ~80 ms for its ~1.9 GB of active weights at the machine's read
 * bandwidth). Here one call runs the block, or the decoder runs it inside its one call (decoder.c). The experts'
 * panels are the layer's own (a GGUF file's blocks, packed as for any dense layer), read only where chosen.
 *
 * Two ways to share the experts between the threads (struct hp_moe's split, chosen by timing at start-up):
 *   0: one expert at a time, each product split across the threads by its panels (few experts, many rows each);
 *   1: each thread whole experts, its products single-threaded (a decode step: many experts of a row or two,
 *      whose products are too small to split without the threads waiting on each other).
 * Either way every product is the same call on the same rows, so the outputs are the same bits. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe.h"

/* Softmax over the E logits, then the top k: ascending index among equals. Returns 1 where the k-th and the
 * (k+1)-th probabilities are equal (which of them is chosen is then torch.topk's business: the caller re-routes). */
static int route_row(const float *logits, int E, int k, int norm, int32_t *experts, float *weights, float *probs) {
    float max = logits[0], sum = 0.0f;
    for (int e = 1; e < E; e++) max = logits[e] > max ? logits[e] : max;
    for (int e = 0; e < E; e++) sum += probs[e] = expf(logits[e] - max);
    for (int e = 0; e < E; e++) probs[e] /= sum;
    for (int j = 0; j < k; j++) { /* insertion into the sorted top k: k is small (8 of 128) */
        experts[j] = -1;
        weights[j] = -INFINITY;
    }
    for (int e = 0; e < E; e++) {
        const float p = probs[e];
        if (p <= weights[k - 1]) continue;
        int j = k - 1;
        for (; j > 0 && p > weights[j - 1]; j--) {
            weights[j] = weights[j - 1];
            experts[j] = experts[j - 1];
        }
        weights[j] = p;
        experts[j] = e;
    }
    int tie = 0;
    if (k < E) { /* is any probability left out equal to the k-th? */
        for (int e = 0; e < E && !tie; e++) {
            int chosen = 0;
            for (int j = 0; j < k; j++) chosen |= experts[j] == e;
            tie = !chosen && probs[e] == weights[k - 1];
        }
    }
    if (norm) {
        float total = 0.0f;
        for (int j = 0; j < k; j++) total += weights[j];
        for (int j = 0; j < k; j++) weights[j] /= total;
    }
    return tie;
}

int hp_moe_route(const struct hp_moe *m, const float *x, int64_t ldx, int T, int32_t *experts, float *weights,
                 float *scratch) {
    float *logits = scratch, *probs = logits + (int64_t)T * m->num_experts;
    hp_linear_packed(m->router_format, x, ldx, m->router, 0, logits, m->num_experts, T, m->num_experts, m->hidden);
    int ties = 0;
    for (int t = 0; t < T; t++)
        ties += route_row(logits + (int64_t)t * m->num_experts, m->num_experts, m->top_k, m->norm_topk,
                          experts + (int64_t)t * m->top_k, weights + (int64_t)t * m->top_k, probs);
    return ties;
}

int64_t hp_moe_scratch(const struct hp_moe *m) {
    const int64_t H = m->hidden, I = m->intermediate, S = m->shared_intermediate;
    return m->top_k * (2 * H + 3 * I) + 2 * (int64_t)m->num_experts + 3 * S + H + 1;
}

/* One expert's SwiGLU over its n gathered rows xs [n, H]: ys [n, H]. */
static void expert_mlp(int gate_up_format, const void *gate_up, int down_format, const void *down, const float *xs,
                       float *gu, float *act, float *ys, int n, int H, int I) {
    hp_linear_packed(gate_up_format, xs, H, gate_up, 0, gu, 2 * I, n, 2 * I, H);
    hp_silu_mul(gu, act, n, I);
    hp_linear_packed(down_format, act, I, down, 0, ys, H, n, H, I);
}

void hp_moe_experts(const struct hp_moe *m, const float *x, int64_t ldx, int T, const int32_t *experts,
                    const float *weights, float *out, int64_t ldo, float *scratch) {
    const int E = m->num_experts, k = m->top_k, H = m->hidden, I = m->intermediate, S = m->shared_intermediate;
    const int64_t pairs = (int64_t)T * k;
    float *xs = scratch, *ys = xs + pairs * H, *gu = ys + pairs * H, *act = gu + pairs * 2 * I;
    float *shared = act + pairs * I; /* the shared expert's: gate_up [T, 2S], act [T, S], out [T, H], gate [T] */
    int32_t *count = calloc(E + 1, sizeof(int32_t)), *order = malloc(pairs * sizeof(int32_t));
    int32_t *hit = malloc(E * sizeof(int32_t));
    /* (token, slot) pairs grouped by expert, tokens ascending within each: a counting sort */
    for (int64_t i = 0; i < pairs; i++) count[experts[i] + 1]++;
    int num_hit = 0;
    for (int e = 0; e < E; e++) {
        if (count[e + 1]) hit[num_hit++] = e;
        count[e + 1] += count[e];
    }
    {
        int32_t *next = malloc(E * sizeof(int32_t));
        memcpy(next, count, E * sizeof(int32_t));
        for (int64_t i = 0; i < pairs; i++) order[next[experts[i]]++] = (int32_t)i;
        free(next);
    }
    for (int64_t p = 0; p < pairs; p++) memcpy(xs + p * H, x + (order[p] / k) * ldx, H * sizeof(float));
    /* split: the threads take whole experts, each product inside on its thread; else the region is inactive and each
     * product splits across the threads itself */
#pragma omp parallel for schedule(dynamic, 1) if (m->split)
    for (int h = 0; h < num_hit; h++) {
        const int e = hit[h], first = count[e], n = count[e + 1] - first;
        expert_mlp(m->gate_up_format[e], m->gate_up[e], m->down_format[e], m->down[e], xs + (int64_t)first * H,
                   gu + (int64_t)first * 2 * I, act + (int64_t)first * I, ys + (int64_t)first * H, n, H, I);
    }
    /* each token's experts added in ascending expert order onto zeros, as transformers adds them */
    for (int t = 0; t < T; t++) memset(out + t * ldo, 0, H * sizeof(float));
    for (int64_t p = 0; p < pairs; p++) {
        float *o = out + (order[p] / k) * ldo;
        const float w = weights[order[p]], *y = ys + p * H;
        for (int j = 0; j < H; j++) o[j] += y[j] * w;
    }
    if (S) { /* Qwen2-MoE's shared expert, scaled by sigmoid(x . gate) */
        float *sgu = shared, *sact = sgu + (int64_t)T * 2 * S, *sout = sact + (int64_t)T * S, *g = sout + (int64_t)T * H;
        hp_linear_packed(m->shared_gate_up_format, x, ldx, m->shared_gate_up, 0, sgu, 2 * S, T, 2 * S, H);
        hp_silu_mul(sgu, sact, T, S);
        hp_linear_packed(m->shared_down_format, sact, S, m->shared_down, 0, sout, H, T, H, S);
        hp_linear_packed(m->shared_gate_format, x, ldx, m->shared_gate, 0, g, 1, T, 1, H);
        for (int t = 0; t < T; t++) {
            const float s = 1.0f / (1.0f + expf(-g[t]));
            for (int j = 0; j < H; j++) out[t * ldo + j] += s * sout[(int64_t)t * H + j];
        }
    }
    free(count);
    free(order);
    free(hit);
}
