/* The product bodies that linear.c's hp_linear_packed dispatches to, each in the file of its format or ISA. Internal
 * to the library: Python calls hp_linear_packed (ops.h), which picks one of these by the panels' format. */
#ifndef HARPOON_PRODUCTS_H
#define HARPOON_PRODUCTS_H
#include <stdint.h>

#include "arch/simd.h"
#include "ops.h"

/* The bodies a product word names (ops.h), each field's 0 resolved to this build's default. */
static inline int hp_bf16_body(int word) {
    const int b = word >> HP_BF16_BODY_AT & 3;
    return b ? b - 1 : HP_NATIVE_BF16 ? HP_BF16_DPBF16 : HP_BF16_FMA;
}
static inline int hp_f32_body(int word, int wide) { /* wide: the build has the paired body (HP_F32_WIDE) */
    const int b = word >> HP_F32_BODY_AT & 3;
    return b ? b - 1 : wide ? HP_F32_PAIRS : HP_F32_PANELS;
}
static inline int hp_q8x_dot(int word) {
    const int b = word >> HP_Q8X_DOT_AT & 3;
    return b ? b - 1 : HP_DOT_U8S8 ? HP_Q8X_VNNI : HP_Q8X_MADDUBS;
}
static inline int hp_q8x_tile_rows(int word) { return word >> HP_Q8X_TILE_ROWS_AT & 255; }

/* arch/x86/f32_avx512.c: rows m0..m1 of y (+)= x . an fp32 panel slice (kc x NR), 8 rows at a time, and the same
 * over two whole panels side by side; only where HP_F32_WIDE (panels.h). */
void hp_f32w_rows(int m0, int m1, const float *x, int64_t ldx, const float *panel, int kc, float *y, int64_t ldy,
                  int cols, const float *b, int first);
void hp_f32w2_rows(int m0, int m1, const float *x, int64_t ldx, const float *s0, const float *s1, int kc, float *y,
                   int64_t ldy, const float *b, int first);

/* linear_bf16.c: BF16C products (K even) through ``body`` (enum hp_bf16_dot). */
void hp_linear_bf16c(int body, const float *x, int64_t ldx, const void *packed, const float *bias, float *y,
                     int64_t ldy, int M, int N, int K);

/* linear_q8x.c: a block format's products with the activations rounded to int8, through the dot product and the
 * AMX tiles' rows the product word names (``word``: the format and the body fields). */
void hp_linear_q8x(int word, const float *x, int64_t ldx, const void *packed, const float *bias, float *y,
                   int64_t ldy, int M, int N, int K);

/* arch/x86/amx_bf16.c: the products on AMX tiles. hp_amx_bf16_available: the CPU has them and the kernel let this
 * process use them. BF16C panels nr columns wide, BF16A panels (nr 32), or Q4A, Q6A or Q8A panels (nr 32, widened
 * their format; else 0); -1 where it cannot. */
int hp_amx_bf16_available(void);
int hp_linear_bf16c_amx(const float *x, int64_t ldx, const void *packed, int nr, int widened, const float *bias,
                        float *y, int64_t ldy, int M, int N, int K);
/* Q4A, Q6A or Q8A panels computed in fp32 on AMX tiles (format HP_Q4S, HP_Q6S or HP_Q8S: the activations split
 * into three bfloat16 parts); -1 where it cannot. */
int hp_linear_split_amx(int format, const float *x, int64_t ldx, const void *packed, const float *bias, float *y,
                        int64_t ldy, int M, int N, int K);
/* ids [M] = each row's argmax over the N columns of the same product, without writing it; -1 where it cannot. */
int hp_argmax_bf16c_amx(const float *x, int64_t ldx, const void *packed, int nr, int widened, int M, int N, int K,
                        int64_t *ids);
/* The tile configuration of the products (tiles 0-3 accumulators of `rows` rows, 16 and nr - 16 columns wide; 4-5
 * activations, 6-7 weights, a tile op summing `step` pairs of bytes); only where the build has AMX. */
void hp_amx_load_config(int rows, int nr, int step);

#endif
