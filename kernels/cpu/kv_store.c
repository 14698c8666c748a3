/* The KV pool's writes: each token's K and V rows into its slot, in the pool's element type (fp32, bfloat16 or
 * int8 with a scale per head, kernels/kv_int8.py). */
#include <stdint.h>
#include <string.h>

#include "arch/simd.h"
#include "ops.h"
#include "vec.h"

/* fp32 -> bfloat16, rounded to nearest even, NaN kept a (quiet) NaN: the bits torch's conversion gives. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* One head's D values (a multiple of 8) as int8 and their scale: d = max |x| / 127, q = x / d rounded to nearest
 * even (x times the rounded 1 / d, as kernels/kv_int8.py computes it), d after the D bytes. */
static void store_head_i8(const float *x, int8_t *dst, int D) {
    const float d = abs_max(x, D) / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < D; i += 8) store8_i8(load8(x + i) * splat8(inv), dst + i);
    memcpy(dst + D, &d, sizeof d);
}

static void store_row(const float *src, void *cache, int64_t slot, int heads, int D, int kv_format) {
    const int row = heads * D;
    if (kv_format == HP_KV_F32) {
        memcpy((float *)cache + slot * row, src, sizeof(float) * row);
    } else if (kv_format == HP_KV_BF16) {
        uint16_t *dst = (uint16_t *)cache + slot * row;
        for (int i = 0; i < row; i++) dst[i] = to_bf16(src[i]);
    } else {
        const int64_t hb = kv_head_bytes(D, kv_format);
        for (int h = 0; h < heads; h++) store_head_i8(src + h * D, (int8_t *)cache + (slot * heads + h) * hb, D);
    }
}

/* Copies each token's K and V rows ([num_kv_heads, head_dim], row strides ldk and ldv) into its cache slot, in the
 * pools' element type (enum hp_kv_format). */
void hp_store_kv(const float *k, int64_t ldk, const float *v, int64_t ldv, void *k_cache, void *v_cache,
                 const int64_t *slots, int T, int num_kv_heads, int head_dim, int kv_format) {
    for (int t = 0; t < T; t++) {
        store_row(k + t * ldk, k_cache, slots[t], num_kv_heads, head_dim, kv_format);
        store_row(v + t * ldv, v_cache, slots[t], num_kv_heads, head_dim, kv_format);
    }
}
