/* The whole decoder stack for a batch of decode tokens in one call from Python.
 *
 * Why: a decode step of a small model is ~11 kernel calls per layer. From Python each costs a module call, argument
 * checks and an output allocation (~4-5 ms a step at batch 1 for SmolLM2's 30 layers, a tenth of the step), and
 * the OpenMP threads fall asleep in the gaps. Here the same kernels run back to back, in the same order and with
 * the same arithmetic as the per-module path (engine/models/llama.py), so both give bit-identical hidden states.
 * Prompt tokens ride along as decode queries over their prefix; the model sends long chunks deep into a prompt to
 * the module path instead (engine/models/llama.py says when). */
#include <stddef.h>

#include "moe.h"
#include "ops.h"

/* One decoder layer's weights (linear weights in the packed format its *_format field names, enum hp_weight_format;
 * absent biases and norms are NULL) and its K/V pools [num_blocks, block_size, num_kv_heads, head_dim]. Field
 * order: LayerWeights in decoder.py, then the pools, then the flags. */
struct hp_layer {
    const float *input_norm;
    const void *qkv, *o;
    const float *post_norm;
    const void *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias, *q_norm, *k_norm;
    /* A fused projection of two formats (a GGUF file's Q6_K attn_v after Q4_K q and k): its first *_head_rows
     * outputs in qkv/gate_up, the rest in these; NULL where one format holds it all. */
    const void *qkv_tail, *gate_up_tail;
    void *k_cache, *v_cache;
    int qkv_format, o_format, gate_up_format, down_format, qkv_tail_format, gate_up_tail_format;
    int qkv_head_rows, gate_up_head_rows;
    const struct hp_moe *moe; /* a mixture-of-experts layer's block, in place of gate_up/down (NULL: dense) */
};

/* y [T, N] = x [T, K] . w + bias for a projection held whole or as a head and a tail of different formats. */
static void fused_product(const void *w, int format, const void *tail, int tail_format, int head_rows,
                          const float *x, int64_t ldx, const float *bias, float *y, int T, int N, int K) {
    if (!tail) {
        hp_linear_packed(format, x, ldx, w, bias, y, N, T, N, K);
        return;
    }
    hp_linear_packed(format, x, ldx, w, bias, y, N, T, head_rows, K);
    hp_linear_packed(tail_format, x, ldx, tail, bias ? bias + head_rows : 0, y + head_rows, N, T, N - head_rows, K);
}

struct hp_decoder {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    int kv_format; /* the pools' element type, enum hp_kv_format */
    float eps, scale;
    const float *cos_cache, *sin_cache, *final_norm; /* rotary tables [max_position, head_dim] */
    const struct hp_layer *layers;
};

/* Floats of scratch per token that a mixture-of-experts layer needs beyond the dense layers' (the most of any). */
static int64_t moe_scratch(const struct hp_decoder *m) {
    int64_t most = 0;
    for (int l = 0; l < m->num_layers; l++) {
        const struct hp_moe *moe = m->layers[l].moe;
        if (moe && hp_moe_scratch(moe) + 2 * moe->top_k > most) most = hp_moe_scratch(moe) + 2 * moe->top_k;
    }
    return most;
}

/* Floats of scratch per token that hp_decode_forward needs. */
int64_t hp_decode_scratch(const struct hp_decoder *m) {
    int64_t q = (int64_t)m->num_heads * m->head_dim, kv = (int64_t)m->num_kv_heads * m->head_dim;
    return 2 * (int64_t)m->hidden + (q + 2 * kv) + q + 3 * (int64_t)m->intermediate + moe_scratch(m);
}

/* x [T, hidden]: the embeddings of the T decode tokens on entry, the residual stream after (clobbered).
 * hidden_out [T, hidden]: the final norm's output. positions/slots [T] int64; tables [T, table_stride] int32;
 * seq_lens [T] int32 (context including this token); scratch: T * hp_decode_scratch floats. Returns how many
 * tokens' routing had a tie at the k-th expert (then the step is to be run again the way transformers routes). */
int hp_decode_forward(const struct hp_decoder *m, float *x, float *hidden_out, int T, const int64_t *positions,
                       const int64_t *slots, const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                       float *scratch) {
    const int H = m->hidden, D = m->head_dim, I = m->intermediate;
    const int q_size = m->num_heads * D, kv_size = m->num_kv_heads * D, qkv_size = q_size + 2 * kv_size;
    float *h = scratch, *qkv = h + (int64_t)T * H, *attn = qkv + (int64_t)T * qkv_size;
    float *gate_up = attn + (int64_t)T * q_size, *act = gate_up + (int64_t)T * 2 * I, *out = act + (int64_t)T * I;
    float *residual = x, *moe = out + (int64_t)T * H;
    int ties = 0;
    for (int l = 0; l < m->num_layers; l++) {
        const struct hp_layer *L = &m->layers[l];
        if (l == 0)
            hp_rms_norm(x, H, L->input_norm, h, T, H, m->eps);
        else /* the previous layer's MLP output joins the residual stream */
            hp_add_rms_norm(out, residual, L->input_norm, h, T, H, m->eps);
        fused_product(L->qkv, L->qkv_format, L->qkv_tail, L->qkv_tail_format, L->qkv_head_rows, h, H, L->qkv_bias, qkv,
                      T, qkv_size, H);
        if (L->q_norm) /* Qwen3: RMSNorm over each head of q and of k, in place */
            for (int t = 0; t < T; t++) {
                float *row = qkv + (int64_t)t * qkv_size;
                hp_rms_norm(row, D, L->q_norm, row, m->num_heads, D, m->eps);
                hp_rms_norm(row + q_size, D, L->k_norm, row + q_size, m->num_kv_heads, D, m->eps);
            }
        hp_rotary(qkv, qkv_size, positions, m->cos_cache, m->sin_cache, T, m->num_heads + m->num_kv_heads, D);
        hp_store_kv(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, L->k_cache, L->v_cache, slots, T,
                    m->num_kv_heads, D, m->kv_format);
        hp_paged_decode_attention(qkv, qkv_size, L->k_cache, L->v_cache, tables, table_stride, seq_lens, attn, q_size,
                                  T, m->num_heads, m->num_kv_heads, D, m->block_size, m->scale, m->kv_format);
        hp_linear_packed(L->o_format, attn, q_size, L->o, L->o_bias, out, H, T, H, q_size);
        hp_add_rms_norm(out, residual, L->post_norm, h, T, H, m->eps);
        if (L->moe) {
            const int k = L->moe->top_k;
            int32_t *experts = (int32_t *)moe;
            float *weights = moe + (int64_t)T * k, *work = weights + (int64_t)T * k;
            ties += hp_moe_route(L->moe, h, H, T, experts, weights, work);
            hp_moe_experts(L->moe, h, H, T, experts, weights, out, H, work);
            continue;
        }
        fused_product(L->gate_up, L->gate_up_format, L->gate_up_tail, L->gate_up_tail_format, L->gate_up_head_rows, h,
                      H, L->gate_up_bias, gate_up, T, 2 * I, H);
        hp_silu_mul(gate_up, act, T, I);
        hp_linear_packed(L->down_format, act, I, L->down, L->down_bias, out, H, T, H, I);
    }
    hp_add_rms_norm(out, residual, m->final_norm, hidden_out, T, H, m->eps);
    return ties;
}
