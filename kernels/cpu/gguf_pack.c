/* A GGUF file's blocks packed straight from the file's bytes into the panels the kernels read (ops.c documents each
 * layout; kernels/cpu/blocks.py packs the same panels from decoded blocks, and tests compare the two bit for bit).
 *
 * Why: an 8B Q4_K_M file is 4.9 GB of blocks. Decoding them into per-row tensors and then permuting those into
 * panels in torch took ~30 s and held two transient copies of the largest tensor; here each panel is written once
 * from the mapped file, on every core, so loading costs about one pass over the file.
 *
 * A weight [N, K] is given as N row addresses (row r's K / block-size blocks, in the file's layout), so a fused
 * projection or a reordering of rows (llama.cpp's q/k interleave undone) costs nothing; the last panel's columns
 * past N are zero. */
#include <stdint.h>
#include <string.h>

#include "ops.h"

/* The types of ggml's enum ggml_type this file packs. */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

#define GROUP 32 /* inputs per block of the per-32 panels, and per group of a K-quant super-block */
#define SUPER 256

/* An fp16 value (IEEE half, little-endian bytes) as a float, exactly. */
static inline float half_at(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 31) {
        bits = sign | 0x7F800000u | man << 13;
    } else if (exp) {
        bits = sign | (exp + 112) << 23 | man << 13;
    } else { /* zero or subnormal: man 2^-24 */
        float f = (float)man * 0x1p-24f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Where the panel formats keep a column's values: per 32 inputs, in nibbles (Q4, Q4K: lane c of word k / 8 holds
 * eight consecutive k, k % 8 in bits 4 (k % 8)) or in bytes (the others: word k / 4, byte k % 4). */
static inline void put_word(uint8_t *weights, int nr, int c, int w, uint32_t word) {
    memcpy(weights + ((int64_t)w * nr + c) * 4, &word, 4);
}

/* The low (high = 0) or high nibbles of eight bytes as one nibble word: byte i's in bits 4 i. Why: the file and the
 * panels both hold nibbles, paired differently; in 64-bit steps this runs at several GB/s, where a value at a time
 * ran at ~1. */
static inline uint32_t nibble_word(const uint8_t *bytes, int high) {
    uint64_t x;
    memcpy(&x, bytes, 8);
    x = (high ? x >> 4 : x) & 0x0F0F0F0F0F0F0F0Full;
    x = (x | x >> 4) & 0x00FF00FF00FF00FFull;
    x = (x | x >> 8) & 0x0000FFFF0000FFFFull;
    return (uint32_t)(x | x >> 16);
}

/* The bits 2 t, 2 t + 1 of 16 bytes of Q6_K's qh as one Q6_HIGH word: in byte i, field b (bits 2 b) from byte
 * 8 (b / 2) + 2 i + b % 2. In 64-bit steps, as nibble_word: a value at a time, Q6_K packed at ~1.7 GB/s. */
static inline uint32_t q6_high_word(const uint8_t *qh, int t) {
    uint64_t a, b;
    memcpy(&a, qh, 8), memcpy(&b, qh + 8, 8);
    const uint64_t x = (a >> (2 * t) & 0x0303030303030303ull) | (b >> (2 * t) & 0x0303030303030303ull) << 4;
    uint64_t z = (x | x >> 6) & 0x00FF00FF00FF00FFull; /* byte 2 i: fields of bytes 2 i and 2 i + 1 */
    z = (z | z >> 8) & 0x0000FFFF0000FFFFull;
    return (uint32_t)(z | z >> 16);
}

/* 16 bytes of nibbles, input i low and i + 16 high (Q4_0, Q4_1), as a Q4 block's four words. */
static void put_split_nibbles(uint8_t *weights, int nr, int c, const uint8_t *qs) {
    for (int w = 0; w < 4; w++) put_word(weights, nr, c, w, nibble_word(qs + 8 * (w % 2), w / 2));
}

static void put_bytes(uint8_t *weights, int nr, int c, const uint8_t v[GROUP]) {
    for (int w = 0; w < GROUP / 4; w++) memcpy(weights + ((int64_t)w * nr + c) * 4, v + 4 * w, 4);
}

static inline void put_float(uint8_t *vector, int c, float x) { memcpy(vector + 4 * c, &x, 4); }

/* The values 0..15 of a 16-byte run of nibbles: input i low, i + 16 high (Q4_0, Q4_1, Q5_0, Q5_1). */
static void split_nibbles(const uint8_t *qs, uint8_t v[GROUP]) {
    for (int i = 0; i < 16; i++) v[i] = qs[i] & 15, v[i + 16] = qs[i] >> 4;
}

/* Bit i of the 32 little-endian bits at qh, as bit 4 of v[i]. */
static void add_high_bits(const uint8_t *qh, uint8_t v[GROUP]) {
    for (int i = 0; i < GROUP; i++) v[i] |= ((qh[i / 8] >> (i % 8)) & 1) << 4;
}

/* A Q5_0 block's values as int8: q - 16, q in 0..31 (its low nibbles and the 32 bits of its high bits). */
static void q5_0_values(const uint8_t *src, uint8_t v[GROUP]) {
    split_nibbles(src + 6, v), add_high_bits(src + 2, v);
    for (int i = 0; i < GROUP; i++) v[i] = (uint8_t)(int8_t)(v[i] - 16);
}

/* One per-32 block (Q4_0 ... Q8_0) of column c into its place of a Q4, Q8 or Q5 panel block: the scale vectors
 * (d; Q4 and Q5: d, m), then the weights. A zero block where src is NULL (a padding column). */
static void put_block32(int type, const uint8_t *src, uint8_t *block, int nr, int c) {
    uint8_t v[GROUP] = {0};
    float d = 0.0f, m = 0.0f;
    int scales = type == T_Q8_0 || type == T_Q5_0 ? 1 : 2;
    if (src) {
        switch (type) {
        case T_Q4_0: d = half_at(src), m = -8 * d; break;
        case T_Q4_1: d = half_at(src), m = half_at(src + 2); break;
        case T_Q5_0: d = half_at(src), q5_0_values(src, v); break; /* d (q - 16): Q8 panels' int8 */
        case T_Q5_1:
            d = half_at(src), m = half_at(src + 2), split_nibbles(src + 8, v), add_high_bits(src + 4, v);
            break;
        default: d = half_at(src), memcpy(v, src + 2, GROUP); break; /* Q8_0 */
        }
    }
    put_float(block, c, d);
    if (scales == 2) put_float(block + 4 * nr, c, m);
    uint8_t *weights = block + (int64_t)scales * 4 * nr;
    if (type == T_Q4_0 || type == T_Q4_1) {
        static const uint8_t zeros[16];
        put_split_nibbles(weights, nr, c, src ? src + (type == T_Q4_0 ? 2 : 4) : zeros);
    } else {
        put_bytes(weights, nr, c, v);
    }
}

/* Q4_K's and Q5_K's 6-bit scale and min of group j from their 12 packed bytes (ggml's get_scale_min_k4). */
static void k4_scale_min(const uint8_t *q, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63, *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One K-quant super-block of column c into a Q4K, Q5K or Q6K panel super-block: Q6K's d as a float, its sixteen
 * int8 scales four to a 32-bit lane (byte j of word i: the 16-input half 4 i + j); Q4K's and Q5K's d and dmin as the
 * file's fp16, its 12 bytes of packed 6-bit scales and mins four to a lane (byte j of word i: byte 4 i + j); then
 * eight groups of weights. */
static void put_super(int type, const uint8_t *src, uint8_t *sb, int nr, int c) {
    static const uint8_t zeros[210];
    const int q6 = type == T_Q6_K;
    const uint8_t *s = src ? src : zeros;
    uint8_t *lanes = sb + 4 * nr, *weights = sb + (q6 ? 4 + 16 : 4 + 12) * nr;
    const int64_t group_bytes = (int64_t)(type == T_Q4_K ? GROUP / 2 : q6 ? GROUP * 3 / 4 : GROUP) * nr;
    uint8_t v[GROUP];
    if (q6) { /* ql [128], qh [64], int8 scales [16], d: group 4 n + t from ql's run n, qh's bits 2 t */
        put_float(sb, c, half_at(s + 208));
        for (int i = 0; i < 16; i++) lanes[((int64_t)(i / 4) * nr + c) * 4 + i % 4] = s[192 + i];
        for (int g = 0; g < 8; g++) {
            const int n = g / 4, t = g % 4;
            const uint8_t *ql = s + 64 * n + 32 * (t % 2), *qh = s + 128 + 32 * n;
            uint8_t *group = weights + g * group_bytes;
            /* q + 32 as the file has it: the low four bits as nibble words, the high two as Q6_HIGH words */
            for (int w = 0; w < 4; w++) put_word(group, nr, c, w, nibble_word(ql + 8 * w, t / 2));
            for (int j = 0; j < 2; j++) put_word(group + 16 * nr, nr, c, j, q6_high_word(qh + 16 * j, t));
        }
        return;
    }
    /* Q4_K: d, dmin, 12 bytes of scales, qs [128]; Q5_K: the same, then qh [32] before qs. Group 2 j + h: nibble h of
     * qs's run j (and bit 2 j + h of qh) */
    memcpy(sb + 2 * c, s, 2), memcpy(sb + 2 * (nr + c), s + 2, 2);
    for (int i = 0; i < 12; i++) lanes[((int64_t)(i / 4) * nr + c) * 4 + i % 4] = s[4 + i];
    const uint8_t *qs = s + (type == T_Q5_K ? 48 : 16), *qh = s + 16;
    for (int g = 0; g < 8; g++) {
        if (type == T_Q4_K) {
            for (int w = 0; w < 4; w++)
                put_word(weights + g * group_bytes, nr, c, w, nibble_word(qs + 32 * (g / 2) + 8 * w, g % 2));
            continue;
        }
        for (int i = 0; i < GROUP; i++) v[i] = ((qs[32 * (g / 2) + i] >> (4 * (g % 2))) & 15) | ((qh[i] >> g) & 1) << 4;
        put_bytes(weights + g * group_bytes, nr, c, v);
    }
}

static int block_bytes_of(int type) {
    switch (type) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

/* Bytes of one panel block (32 inputs; K-quants: 256) of the panel format that `type` packs into. */
static int64_t panel_block_bytes(int type, int nr) {
    switch (type) {
    case T_Q4_0: case T_Q4_1: return 2 * 4 * nr + GROUP / 2 * nr; /* Q4 */
    case T_Q5_0: case T_Q8_0: return 4 * nr + GROUP * nr;         /* Q8 */
    case T_Q5_1: return 2 * 4 * nr + GROUP * nr;                  /* Q5 */
    case T_Q4_K: return (4 + 12) * nr + SUPER / 2 * nr;
    case T_Q5_K: return (4 + 12) * nr + SUPER * nr;
    default: return (4 + 16) * nr + SUPER * 3 / 4 * nr; /* Q6_K */
    }
}

/* Panels [ceil(N / nr), K / (32 or 256), panel_block_bytes] of the weight whose row r's blocks start at rows[r]
 * (ggml type `type`, K inputs a row). Returns the bytes written, or -1 for a type this file does not pack. */
int64_t hp_pack_gguf(int type, const int64_t *rows, int N, int K, int nr, void *out) {
    const int bytes = block_bytes_of(type), per = type >= T_Q4_K ? SUPER : GROUP;
    if (!bytes || K % per || nr % 8) return -1;
    const int blocks = K / per, panels = (N + nr - 1) / nr;
    const int64_t panel_bytes = panel_block_bytes(type, nr), total = (int64_t)panels * blocks * panel_bytes;
#pragma omp parallel for schedule(dynamic, 1)
    for (int p = 0; p < panels; p++)
        for (int b = 0; b < blocks; b++) {
            uint8_t *block = (uint8_t *)out + ((int64_t)p * blocks + b) * panel_bytes;
            for (int c = 0; c < nr; c++) {
                const int n = p * nr + c;
                const uint8_t *src = n < N ? (const uint8_t *)(intptr_t)rows[n] + (int64_t)b * bytes : 0;
                if (per == SUPER)
                    put_super(type, src, block, nr, c);
                else
                    put_block32(type, src, block, nr, c);
            }
        }
    return total;
}

/* ---- Q4A, Q6A and Q8A panels (amx.c) ------------------------------------------------------------------------
 * The values of one column's 32 inputs at block kb (of K / 32) and their scales, from the file's blocks: d and m
 * (Q4_0, Q4_1, Q4_K: d q + m, q in 0..15, a K-quant's scales formed as gguf-py forms them, exact products), d of
 * inputs 0-15 and of 16-31 (Q6_K: q + 32 in 0..63, valued d q - 32 d), or d (Q8_0, Q5_0: d q, q an int8). */
static void widened_values(int type, const uint8_t *row, int kb, uint8_t v[GROUP], float *s0, float *s1) {
    if (type == T_Q8_0 || type == T_Q5_0) { /* d q, q int8 (bytes); Q5_0: d (q - 16), q in 0..31 */
        const uint8_t *b = row + (int64_t)kb * block_bytes_of(type);
        *s0 = half_at(b), *s1 = 0.0f;
        if (type == T_Q8_0)
            memcpy(v, b + 2, GROUP);
        else
            q5_0_values(b, v);
        return;
    }
    if (type == T_Q4_0 || type == T_Q4_1) {
        const uint8_t *b = row + (int64_t)kb * block_bytes_of(type);
        *s0 = half_at(b), *s1 = type == T_Q4_0 ? -8 * *s0 : half_at(b + 2);
        split_nibbles(b + (type == T_Q4_0 ? 2 : 4), v);
        return;
    }
    const uint8_t *s = row + (int64_t)(kb / 8) * block_bytes_of(type);
    const int g = kb % 8;
    if (type == T_Q4_K) { /* group 2 j + h: nibble h of qs's run j */
        uint8_t sc, mn;
        k4_scale_min(s + 4, g, &sc, &mn);
        *s0 = half_at(s) * (float)sc, *s1 = -(half_at(s + 2) * (float)mn);
        for (int i = 0; i < GROUP; i++) v[i] = (s[16 + 32 * (g / 2) + i] >> (4 * (g % 2))) & 15;
        return;
    }
    /* Q6_K: group 4 n + t from ql's run n (nibble t / 2 of ql[32 (t % 2) + i]) and qh's bits 2 t; int8 scales
     * 2 g and 2 g + 1 for its two halves */
    const int n = g / 4, t = g % 4;
    const uint8_t *ql = s + 64 * n + 32 * (t % 2), *qh = s + 128 + 32 * n;
    const float d = half_at(s + 208);
    *s0 = d * (float)(int8_t)s[192 + 2 * g], *s1 = d * (float)(int8_t)s[192 + 2 * g + 1];
    for (int i = 0; i < GROUP; i++) v[i] = ((ql[i] >> (4 * (t / 2))) & 15) | ((qh[i] >> (2 * t)) & 3) << 4;
}

/* Q4A's nibbles of 16 columns' values: per pair of inputs (row r: k = 2 r, 2 r + 1) 16 bytes, byte 2 c + k % 2
 * holding column c's low four bits and column 8 + c's in its high nibble. */
static void put_nibbles(uint8_t *nibbles, const uint8_t v[16][GROUP]) {
    for (int r = 0; r < 16; r++)
        for (int j = 0; j < 16; j++) {
            const int c = j / 2, k = 2 * r + j % 2;
            nibbles[16 * r + j] = (uint8_t)((v[c][k] & 15) | (v[8 + c][k] & 15) << 4);
        }
}

/* Q6A's high two bits of the same values: per two rows 16 bytes, bits 0-1 and 2-3 for the first row's low and high
 * nibble of that byte, 4-5 and 6-7 for the second row's. */
static void put_high(uint8_t *high, const uint8_t v[16][GROUP]) {
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 16; j++) {
            const int c = j / 2, k = 4 * i + j % 2; /* the first row's k; the second's is k + 2 */
            high[16 * i + j] = (uint8_t)((v[c][k] >> 4) | (v[8 + c][k] >> 4) << 2 | (v[c][k + 2] >> 4) << 4 |
                                         (v[8 + c][k + 2] >> 4) << 6);
        }
}

/* The even bytes' fields (each `bits` wide, at bit 0 of its byte) of a 64-bit word of eight, side by side: byte 2 j's
 * at bit `bits` j. */
static inline uint32_t even_fields(uint64_t x, int bits) {
    const uint64_t mask = bits == 4 ? 0x000F000F000F000Full : 0x0003000300030003ull;
    x &= mask;                 /* field j at bit 16 j */
    x |= x >> (16 - bits);     /* fields 0, 1 at bits 0 and `bits` (and 2, 3 at 32 and 32 + bits) */
    const uint32_t two = 2 * bits, low = (1u << two) - 1;
    return (uint32_t)(x & low) | ((uint32_t)(x >> (32 - two)) & (low << two));
}

/* Column c's values (of 16) in a Q4KS or Q6KS tile (ops.h's hp_ksplit_low_at and hp_ksplit_high_at), from the
 * file's bytes of its 32 values: value k's low four bits at bit `low_shift` of low[k], and (Q6KS, high not NULL) its
 * high two at bit `high_shift` of high[k]. Tile rows 4 g .. 4 g + 3 (k = 8 g .. 8 g + 7) take one 32-bit word of
 * low bits a column (position 2 c: its even k, 2 c + 1: its odd k) and one 16-bit word of high bits: eight bytes
 * of the file read as one 64-bit word. Why: a value at a time through a table of values first, an 8B Q4_K_M's
 * panels packed at 1.6 GB/s of the file on two cores. */
static void put_ksplit_column(uint8_t *tile, int c, const uint8_t *low, int low_shift, const uint8_t *high,
                              int high_shift) {
    for (int g = 0; g < 4; g++) {
        uint64_t x;
        memcpy(&x, low + 8 * g, 8);
        x >>= low_shift;
        const uint32_t word = even_fields(x, 4) | even_fields(x >> 8, 4) << 16;
        memcpy(tile + hp_ksplit_low_at(4 * g, 2 * c), &word, 4);
        if (!high) continue;
        memcpy(&x, high + 8 * g, 8);
        x >>= high_shift;
        const uint16_t bits = (uint16_t)(even_fields(x, 2) | even_fields(x >> 8, 2) << 8);
        memcpy(tile + HP_Q6KS_HIGH_AT + hp_ksplit_high_at(4 * g, 2 * c), &bits, 2);
    }
}

/* put_ksplit_column of group g (32 inputs of a super-block s of Q4_K or Q6_K; the file's layout as
 * widened_values reads it). */
static void put_ksplit_group(uint8_t *tile, int c, int q6, const uint8_t *s, int g) {
    if (!q6) { /* group 2 j + h: nibble h of qs's run j */
        put_ksplit_column(tile, c, s + 16 + 32 * (g / 2), 4 * (g % 2), NULL, 0);
        return;
    }
    const int n = g / 4, t = g % 4; /* ql's run n, nibble t / 2 of ql[32 (t % 2) + i]; qh's bits 2 t */
    put_ksplit_column(tile, c, s + 64 * n + 32 * (t % 2), 4 * (t / 2), s + 128 + 32 * n, 2 * t);
}

/* One Q4A or Q6A tile from its 16 columns' values and scales: d (or d of inputs 0-15) and m (or d of 16-31) as
 * floats, then the values' nibbles, then (Q6A) their high bits. */
static void put_tile(uint8_t *tile, const uint8_t v[16][GROUP], const float s0[16], const float s1[16], int q6) {
    memcpy(tile, s0, 64), memcpy(tile + 64, s1, 64);
    put_nibbles(tile + 128, v);
    if (q6) put_high(tile + 128 + 256, v);
}

/* One Q8A tile from its 16 columns' values and d: d as floats, then per pair of inputs (row r) 32 bytes, byte
 * 2 c + k % 2 column c's value at k = 2 r + k % 2 and byte 16 + 2 c + k % 2 column 8 + c's. */
static void put_tile_q8(uint8_t *tile, const uint8_t v[16][GROUP], const float d[16]) {
    memcpy(tile, d, 64);
    uint8_t *bytes = tile + 64;
    for (int r = 0; r < 16; r++)
        for (int j = 0; j < 16; j++) {
            const int c = j / 2, k = 2 * r + j % 2;
            bytes[32 * r + j] = v[c][k], bytes[32 * r + 16 + j] = v[8 + c][k];
        }
}

/* Q4A panels (Q4_0, Q4_1, Q4_K), Q6A panels (Q6_K) or Q8A panels (Q8_0, Q5_0) [ceil(N / 32), K / 32, 2 tiles] of
 * the weight whose row r's blocks start at rows[r], as kernels/cpu/__init__.py's pack_weight_q4a, _q6a and _q8a
 * pack its decoded blocks. Returns the bytes written, or -1 for a type none holds. */
int64_t hp_pack_gguf_widened(int type, const int64_t *rows, int N, int K, void *out) {
    const int q6 = type == T_Q6_K, q8 = type == T_Q8_0 || type == T_Q5_0, per = type >= T_Q4_K ? SUPER : GROUP;
    if ((type != T_Q4_0 && type != T_Q4_1 && type != T_Q4_K && !q6 && !q8) || K % per) return -1;
    const int64_t tile = hp_widened_tile_bytes(q6 ? HP_Q6A : q8 ? HP_Q8A : HP_Q4A), blocks = K / GROUP;
    const int panels = (N + HP_BF16A_WIDTH - 1) / HP_BF16A_WIDTH;
#pragma omp parallel for schedule(dynamic, 1)
    for (int p = 0; p < panels; p++)
        for (int kb = 0; kb < blocks; kb++)
            for (int t = 0; t < 2; t++) {
                uint8_t v[16][GROUP];
                float s0[16], s1[16];
                for (int c = 0; c < 16; c++) {
                    const int n = p * HP_BF16A_WIDTH + 16 * t + c;
                    if (n < N) {
                        widened_values(type, (const uint8_t *)(intptr_t)rows[n], kb, v[c], &s0[c], &s1[c]);
                    } else { /* a column past N: weights of 0 */
                        memset(v[c], 0, GROUP);
                        s0[c] = s1[c] = 0.0f;
                    }
                }
                uint8_t *at = (uint8_t *)out + (((int64_t)p * blocks + kb) * 2 + t) * tile;
                if (q8)
                    put_tile_q8(at, v, s0);
                else
                    put_tile(at, v, s0, s1, q6);
            }
    return (int64_t)panels * blocks * 2 * tile;
}

/* Q4KS or Q6KS panels (ops.h) [ceil(N / 32), K / 256, super-block bytes] of a Q4_K or Q6_K weight whose row r's
 * blocks start at rows[r]: per super-block each tile's header (the columns' d, and Q4_K's dmin, as the file's two
 * bytes each; Q4_K's 6-bit scales and mins as bytes, Q6_K's int8 scales as they are), then per 32 inputs the tiles'
 * q (put_ksplit). Returns the bytes written, or -1 for another type. */
int64_t hp_pack_gguf_ksplit(int type, const int64_t *rows, int N, int K, void *out) {
    if ((type != T_Q4_K && type != T_Q6_K) || K % SUPER) return -1;
    const int q6 = type == T_Q6_K, format = q6 ? HP_Q6KS : HP_Q4KS, bytes = block_bytes_of(type);
    const int supers = K / SUPER, panels = (N + HP_BF16A_WIDTH - 1) / HP_BF16A_WIDTH;
    const int head_bytes = hp_ksplit_head_bytes(format), tile_bytes = hp_ksplit_tile_bytes(format);
    const int64_t super_bytes = hp_ksplit_super_bytes(format);
    static const uint8_t zeros[210];
#pragma omp parallel for schedule(dynamic, 1)
    for (int p = 0; p < panels; p++)
        for (int sb = 0; sb < supers; sb++) {
            uint8_t *super = (uint8_t *)out + ((int64_t)p * supers + sb) * super_bytes;
            for (int t = 0; t < 2; t++) {
                uint8_t *head = super + t * head_bytes;
                for (int c = 0; c < 16; c++) {
                    const int n = p * HP_BF16A_WIDTH + 16 * t + c;
                    const uint8_t *row = n < N ? (const uint8_t *)(intptr_t)rows[n] : zeros;
                    const uint8_t *s = row + (n < N ? (int64_t)sb * bytes : 0);
                    for (int g = 0; g < 8; g++)
                        put_ksplit_group(super + 2 * head_bytes + (2 * g + t) * tile_bytes, c, q6, s, g);
                    if (q6) {
                        memcpy(head + 2 * c, s + 208, 2);
                        for (int i = 0; i < 16; i++) head[HP_Q6KS_SCALES_AT + 16 * i + c] = s[192 + i];
                        continue;
                    }
                    memcpy(head + 2 * c, s, 2), memcpy(head + HP_Q4KS_DMIN_AT + 2 * c, s + 2, 2);
                    for (int g = 0; g < 8; g++)
                        k4_scale_min(s + 4, g, head + HP_Q4KS_SCALES_AT + 16 * g + c,
                                     head + HP_Q4KS_MINS_AT + 16 * g + c);
                }
            }
        }
    return (int64_t)panels * supers * super_bytes;
}
