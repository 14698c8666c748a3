#ifndef HP_MOE_H
#define HP_MOE_H

#include <stdint.h>

#include "ops.h"

/* One mixture-of-experts block's packed weights (kernels/cpu/moe.py's MoeWeights, field for field). Every *_format is
 * a product word (ops.h); the experts' are per expert. No shared expert: shared_intermediate 0. */
struct hp_moe {
    const void *router; /* hidden -> num_experts */
    const void *const *gate_up; /* [num_experts] panels, hidden -> 2 intermediate */
    const void *const *down;    /* [num_experts] panels, intermediate -> hidden */
    const int32_t *gate_up_format, *down_format; /* [num_experts] */
    const void *shared_gate_up, *shared_down, *shared_gate;
    int router_format, shared_gate_up_format, shared_down_format, shared_gate_format;
    int hidden, num_experts, top_k, norm_topk, intermediate, shared_intermediate;
    int split; /* 1: each thread whole experts; 0: each product across the threads (moe.c) */
};

/* experts/weights [T, top_k]: each token's chosen experts, largest probability first, and their weights
 * (renormalised to sum 1 where norm_topk). scratch: T * hp_moe_scratch floats. Returns how many tokens had a tie
 * at the k-th place (the caller routes those as torch.topk does). */
int hp_moe_route(const struct hp_moe *m, const float *x, int64_t ldx, int T, int32_t *experts, float *weights,
                 float *scratch);
/* out [T, hidden] (rows ldo apart) = the weighted sum of each token's experts (+ the gated shared expert). */
void hp_moe_experts(const struct hp_moe *m, const float *x, int64_t ldx, int T, const int32_t *experts,
                    const float *weights, float *out, int64_t ldo, float *scratch);
/* Floats of scratch per token that hp_moe_route and hp_moe_experts need. */
int64_t hp_moe_scratch(const struct hp_moe *m);

#endif
