/* quants.c: the scalar reference for every tensor format Lever computes with.
 *
 * - dequantization of F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_K, Q6_K (ggml's formulas, so the
 *   result equals gguf-py's dequantize bit for bit),
 * - quantization of activations to Q8_0 and Q8_K exactly as ggml's reference quantizers,
 * - per-block integer dot products and the scalar tile kernels, which define the canonical
 *   reduction order the SIMD files reproduce bit for bit (see quants_internal.h).
 *
 * Float steps are written as separate multiplies and adds, or as explicit fmaf where the
 * canonical order fuses them, and contraction is off here: on arm64 the compiler would
 * otherwise fuse d * q - m in dequantization and drift from gguf-py by an ulp.
 */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF /* clang (the Android NDK's compiler) ignores GCC's pragma */
#else
#pragma GCC optimize("fp-contract=off")
#endif

#include <math.h>
#include <stdlib.h>

#include "lever_kernels.h"
#include "quants_internal.h"

/* Every type Lever computes with, in the order of the LEVER_IX_* indices. The segments say
 * how the tile layout interleaves each block (quants_internal.h): fp16 scales two bytes a
 * row, quants four bytes a row, so one SIMD load holds one field of every row. */
static const lever_type_info TYPE_INFO[LEVER_N_TYPES] = {
    [LEVER_IX_F32] = {LEVER_F32, 1, 4, 1, {{0, 4, 4}}},
    [LEVER_IX_F16] = {LEVER_F16, 1, 2, 1, {{0, 2, 2}}},
    [LEVER_IX_BF16] = {LEVER_BF16, 1, 2, 1, {{0, 2, 2}}},
    [LEVER_IX_Q8_0] = {LEVER_Q8_0, QK8_0, sizeof(block_q8_0), 2, {{0, 2, 2}, {2, 32, 4}}},
    [LEVER_IX_Q4_0] = {LEVER_Q4_0, QK8_0, sizeof(block_q4_0), 2, {{0, 2, 2}, {2, 16, 4}}},
    [LEVER_IX_Q5_0] = {LEVER_Q5_0, QK8_0, sizeof(block_q5_0), 2, {{0, 2, 2}, {2, 20, 4}}},
    /* d | dmin stay one 32-bit group, as the scales that follow them */
    [LEVER_IX_Q4_K] = {LEVER_Q4_K, QK_K, sizeof(block_q4_K), 1, {{0, 144, 4}}},
    [LEVER_IX_Q6_K] = {LEVER_Q6_K, QK_K, sizeof(block_q6_K), 2, {{0, 208, 4}, {208, 2, 2}}},
};

const lever_type_info *lever_type_info_of(int type, int *index) {
    for (int i = 0; i < LEVER_N_TYPES; i++)
        if (TYPE_INFO[i].type == type) {
            if (index) *index = i;
            return &TYPE_INFO[i];
        }
    return NULL;
}

int lever_type_block(int type, int *block_bytes) {
    const lever_type_info *t = lever_type_info_of(type, NULL);
    *block_bytes = t ? t->block_bytes : 0;
    return t ? t->block : 0;
}

int lever_type_layout(int type, int *block, int *block_bytes, int *seg) {
    const lever_type_info *t = lever_type_info_of(type, NULL);
    if (!t) return LEVER_EUNSUPPORTED_TYPE;
    *block = t->block;
    *block_bytes = t->block_bytes;
    for (int i = 0; i < t->n_segments; i++) {
        seg[3 * i] = t->segments[i].offset;
        seg[3 * i + 1] = t->segments[i].bytes;
        seg[3 * i + 2] = t->segments[i].width;
    }
    return t->n_segments;
}

/* ---- element decoding, shared by dequantization and the dot products ---------------- */

static inline int q4_0_value(const block_q4_0 *b, int j) {
    return (j < 16 ? b->qs[j] & 15 : b->qs[j - 16] >> 4) - 8;
}

static inline int q5_0_value(const block_q5_0 *b, int j) {
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
    const int lo = j < 16 ? b->qs[j] & 15 : b->qs[j - 16] >> 4;
    return (lo | (int)((qh >> j) & 1) << 4) - 16;
}

/* Q4_K element e (unsigned 0..15): chunk e / 64 holds 32 bytes, low nibbles first. */
static inline int q4_K_value(const block_q4_K *b, int e) {
    const uint8_t q = b->qs[32 * (e / 64) + e % 32];
    return (e % 64) < 32 ? q & 15 : q >> 4;
}

/* Q6_K element e (signed -32..31): each 128-element half has 64 ql and 32 qh bytes; group
 * g = (e % 128) / 32 takes a nibble of ql[l] or ql[l + 32] and bits 2g..2g+1 of qh[l]. */
static inline int q6_K_value(const block_q6_K *b, int e) {
    const int h = e / 128, g = (e % 128) / 32, l = e % 32;
    const uint8_t ql = b->ql[64 * h + 32 * (g & 1) + l];
    const int lo = g < 2 ? ql & 15 : ql >> 4;
    const int hi = (b->qh[32 * h + l] >> (2 * g)) & 3;
    return (lo | hi << 4) - 32;
}

/* ---- dequantization ------------------------------------------------------------------ */

static void dequantize_f32(const void *src, float *out, int64_t n) {
    memcpy(out, src, (size_t)n * sizeof(float));
}

static void dequantize_f16(const void *src, float *out, int64_t n) {
    const uint16_t *h = src;
    for (int64_t i = 0; i < n; i++) out[i] = lever_fp16_to_fp32(h[i]);
}

static void dequantize_bf16(const void *src, float *out, int64_t n) {
    const uint16_t *h = src;
    for (int64_t i = 0; i < n; i++) out[i] = lever_bf16_to_fp32(h[i]);
}

static void dequantize_q8_0(const void *src, float *out, int64_t n) {
    const block_q8_0 *b = src;
    for (int64_t i = 0; i < n / QK8_0; i++, out += QK8_0) {
        const float d = lever_fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK8_0; j++) out[j] = (float)b[i].qs[j] * d;
    }
}

static void dequantize_q4_0(const void *src, float *out, int64_t n) {
    const block_q4_0 *b = src;
    for (int64_t i = 0; i < n / QK8_0; i++, out += QK8_0) {
        const float d = lever_fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK8_0; j++) out[j] = (float)q4_0_value(&b[i], j) * d;
    }
}

static void dequantize_q5_0(const void *src, float *out, int64_t n) {
    const block_q5_0 *b = src;
    for (int64_t i = 0; i < n / QK8_0; i++, out += QK8_0) {
        const float d = lever_fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK8_0; j++) out[j] = (float)q5_0_value(&b[i], j) * d;
    }
}

static void dequantize_q4_K(const void *src, float *out, int64_t n) {
    const block_q4_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++, out += QK_K) {
        const float d = lever_fp16_to_fp32(b[i].d), dmin = lever_fp16_to_fp32(b[i].dmin);
        for (int j = 0; j < 8; j++) {
            int sc, m;
            q4_K_scale_min(b[i].scales, j, &sc, &m);
            const float d1 = d * (float)sc, m1 = dmin * (float)m;
            for (int l = 0; l < 32; l++) out[32 * j + l] = d1 * (float)q4_K_value(&b[i], 32 * j + l) - m1;
        }
    }
}

static void dequantize_q6_K(const void *src, float *out, int64_t n) {
    const block_q6_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++, out += QK_K) {
        const float d = lever_fp16_to_fp32(b[i].d);
        for (int e = 0; e < QK_K; e++)
            out[e] = d * (float)b[i].scales[e / 16] * (float)q6_K_value(&b[i], e);
    }
}

int lever_dequantize(int type, const void *src, int64_t n_rows, int64_t n_cols, float *out) {
    int ix;
    const lever_type_info *t = lever_type_info_of(type, &ix);
    if (!t) return LEVER_EUNSUPPORTED_TYPE;
    if (n_rows < 0 || n_cols < 0 || n_cols % t->block) return LEVER_EBAD_SHAPE;
    static void (*const rows[LEVER_N_TYPES])(const void *, float *, int64_t) = {
        [LEVER_IX_F32] = dequantize_f32, [LEVER_IX_F16] = dequantize_f16, [LEVER_IX_BF16] = dequantize_bf16,
        [LEVER_IX_Q8_0] = dequantize_q8_0, [LEVER_IX_Q4_0] = dequantize_q4_0, [LEVER_IX_Q5_0] = dequantize_q5_0,
        [LEVER_IX_Q4_K] = dequantize_q4_K, [LEVER_IX_Q6_K] = dequantize_q6_K,
    };
    void (*row)(const void *, float *, int64_t) = rows[ix];
    const int64_t row_bytes = n_cols / t->block * t->block_bytes;
    for (int64_t r = 0; r < n_rows; r++)
        row((const uint8_t *)src + r * row_bytes, out + r * n_cols, n_cols);
    return LEVER_OK;
}

/* ---- activation quantization ---------------------------------------------------------- */

/* roundf (half away from zero) for |v| < 2^23, without a libm call: the truncation and the
 * remainder v - trunc(v) are both exact. */
static inline int round_half_away(float v) {
    const int i = (int)v;
    const float rest = v - (float)i;
    return i + (rest >= 0.5f) - (rest <= -0.5f);
}

/* Round to nearest even for |v| < 2^22: adding 1.5 * 2^23 leaves the integer in the low
 * mantissa bits, rounded by the float add itself. */
static inline int round_nearest_even(float v) {
    const float biased = v + 12582912.0f;
    return (int)(lever_fp32_to_bits(biased) & 0x7fffff) - 0x400000;
}

void lever_quantize_row_q8_0x(const float *x, lever_q8_0x *y, int64_t n) {
    for (int64_t b = 0; b < n / QK8_0; b++, x += QK8_0, y++) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < QK8_0; j++) {
            y->qs[j] = (int8_t)round_half_away(x[j] * id);
            sum += y->qs[j];
        }
        y->d = lever_fp16_to_fp32(lever_fp32_to_fp16(d)); /* ggml stores d as fp16 */
        y->sum = sum;
    }
}

void lever_quantize_row_q8_K(const float *x, block_q8_K *y, int64_t n) {
    for (int64_t b = 0; b < n / QK_K; b++, x += QK_K, y++) {
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < QK_K; j++) {
            if (fabsf(x[j]) > amax) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        }
        if (amax == 0.0f) {
            memset(y, 0, sizeof(*y));
            continue;
        }
        const float iscale = -127.0f / max;
        for (int j = 0; j < QK_K; j++) {
            const int v = round_nearest_even(iscale * x[j]);
            y->qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int i = 0; i < QK_K / 16; i++) {
            int sum = 0;
            for (int l = 0; l < 16; l++) sum += y->qs[16 * i + l];
            y->bsums[i] = (int16_t)sum;
        }
        y->d = 1.0f / iscale;
    }
}

/* ---- per-block integer dot products ------------------------------------------------- */

static int32_t dot_q8_0_block(const block_q8_0 *w, const int8_t *a) {
    int32_t s = 0;
    for (int j = 0; j < QK8_0; j++) s += w->qs[j] * a[j];
    return s;
}

static int32_t dot_q4_0_block(const block_q4_0 *w, const int8_t *a) {
    int32_t s = 0;
    for (int j = 0; j < QK8_0; j++) s += q4_0_value(w, j) * a[j];
    return s;
}

static int32_t dot_q5_0_block(const block_q5_0 *w, const int8_t *a) {
    int32_t s = 0;
    for (int j = 0; j < QK8_0; j++) s += q5_0_value(w, j) * a[j];
    return s;
}

/* isum = sum_j scale_j * (q . a over sub-block j); msum = sum_j min_j * (sum of a over j),
 * the part that dmin multiplies (a 4-bit weight is d * scale * q - dmin * min). */
static void dot_q4_K_block(const block_q4_K *w, const block_q8_K *a, int32_t *isum, int32_t *msum) {
    int32_t is = 0, ms = 0;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        q4_K_scale_min(w->scales, j, &sc, &m);
        int32_t s = 0;
        for (int l = 0; l < 32; l++) s += q4_K_value(w, 32 * j + l) * a->qs[32 * j + l];
        is += sc * s;
        ms += m * (a->bsums[2 * j] + a->bsums[2 * j + 1]);
    }
    *isum = is;
    *msum = ms;
}

static int32_t dot_q6_K_block(const block_q6_K *w, const block_q8_K *a) {
    int32_t is = 0;
    for (int i = 0; i < QK_K / 16; i++) {
        int32_t s = 0;
        for (int l = 0; l < 16; l++) s += q6_K_value(w, 16 * i + l) * a->qs[16 * i + l];
        is += w->scales[i] * s;
    }
    return is;
}

/* ---- row dot products in the canonical order ---------------------------------------- */

static float row_dot_f32(const uint8_t *w, const float *x, int64_t n) {
    const float *wf = (const float *)w;
    float acc = 0.0f;
    for (int64_t k = 0; k < n; k++) acc = fmaf(wf[k], x[k], acc);
    return acc;
}

static float row_dot_f16(const uint8_t *w, const float *x, int64_t n) {
    const uint16_t *wh = (const uint16_t *)w;
    float acc = 0.0f;
    for (int64_t k = 0; k < n; k++) acc = fmaf(lever_fp16_to_fp32(wh[k]), x[k], acc);
    return acc;
}

static float row_dot_bf16(const uint8_t *w, const float *x, int64_t n) {
    const uint16_t *wh = (const uint16_t *)w;
    float acc = 0.0f;
    for (int64_t k = 0; k < n; k++) acc = fmaf(lever_bf16_to_fp32(wh[k]), x[k], acc);
    return acc;
}

static float row_dot_q8_0(const uint8_t *w, const lever_q8_0x *x, int64_t nb) {
    const block_q8_0 *b = (const block_q8_0 *)w;
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++)
        acc = fmaf((float)dot_q8_0_block(&b[i], x[i].qs), lever_fp16_to_fp32(b[i].d) * x[i].d, acc);
    return acc;
}

static float row_dot_q4_0(const uint8_t *w, const lever_q8_0x *x, int64_t nb) {
    const block_q4_0 *b = (const block_q4_0 *)w;
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++)
        acc = fmaf((float)dot_q4_0_block(&b[i], x[i].qs), lever_fp16_to_fp32(b[i].d) * x[i].d, acc);
    return acc;
}

static float row_dot_q5_0(const uint8_t *w, const lever_q8_0x *x, int64_t nb) {
    const block_q5_0 *b = (const block_q5_0 *)w;
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++)
        acc = fmaf((float)dot_q5_0_block(&b[i], x[i].qs), lever_fp16_to_fp32(b[i].d) * x[i].d, acc);
    return acc;
}

static float row_dot_q4_K(const uint8_t *w, const block_q8_K *x, int64_t nb) {
    const block_q4_K *b = (const block_q4_K *)w;
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int32_t isum, msum;
        dot_q4_K_block(&b[i], &x[i], &isum, &msum);
        acc = fmaf((float)isum, lever_fp16_to_fp32(b[i].d) * x[i].d, acc);
        acc = fmaf(-(float)msum, lever_fp16_to_fp32(b[i].dmin) * x[i].d, acc);
    }
    return acc;
}

static float row_dot_q6_K(const uint8_t *w, const block_q8_K *x, int64_t nb) {
    const block_q6_K *b = (const block_q6_K *)w;
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++)
        acc = fmaf((float)dot_q6_K_block(&b[i], &x[i]), lever_fp16_to_fp32(b[i].d) * x[i].d, acc);
    return acc;
}

/* ---- scalar tile kernels: every (row, token) on its own ------------------------------ */

#define SCALAR_TILE(name, act_t, n_of)                                                       \
    static void tile_##name##_scalar(const uint8_t *w, int64_t w_stride, int n_rows,          \
                                     int64_t n_in, const uint8_t *x, int64_t x_stride,         \
                                     int n_tok, float *y, int64_t ldy) {                       \
        for (int t = 0; t < n_tok; t++)                                                        \
            for (int r = 0; r < n_rows; r++)                                                   \
                y[t * ldy + r] = row_dot_##name(w + r * w_stride,                              \
                                                (const act_t *)(x + t * x_stride), n_of);      \
    }

SCALAR_TILE(f32, float, n_in)
SCALAR_TILE(f16, float, n_in)
SCALAR_TILE(bf16, float, n_in)
SCALAR_TILE(q8_0, lever_q8_0x, n_in / QK8_0)
SCALAR_TILE(q4_0, lever_q8_0x, n_in / QK8_0)
SCALAR_TILE(q5_0, lever_q8_0x, n_in / QK8_0)
SCALAR_TILE(q4_K, block_q8_K, n_in / QK_K)
SCALAR_TILE(q6_K, block_q8_K, n_in / QK_K)

/* The tile layout, as its definition: each row of the slice is unpacked back to the row
 * layout (lever_unpack_row) and reduced by the row-layout kernel above, so both layouts are
 * the same arithmetic by construction. A slice is ROWS rows; the unpacked rows live on the
 * heap (a Q8_0 row of 8960 weights is 9.5 KB) - this is the reference, not the fast path. */
#define SCALAR_ROWS 4
#define SCALAR_PACKED(name, type_id)                                                                         \
    static void packed_##name##_scalar(const uint8_t *tile, int sub, int n_rows, int64_t n_in,              \
                                       const uint8_t *x, int64_t x_stride, int n_tok, float *y, int64_t ldy) { \
        const lever_type_info *t = lever_type_info_of(type_id, NULL);                                         \
        const int64_t row_bytes = n_in / t->block * t->block_bytes;                                           \
        uint8_t *rows = malloc((size_t)(SCALAR_ROWS * row_bytes));                                           \
        if (!rows) return; /* the driver allocated more than this already; never reached in practice */     \
        for (int r = 0; r < n_rows; r++) lever_unpack_row(t, tile, sub * SCALAR_ROWS + r, row_bytes, rows + r * row_bytes); \
        tile_##name##_scalar(rows, row_bytes, n_rows, n_in, x, x_stride, n_tok, y, ldy);                    \
        free(rows);                                                                                           \
    }

SCALAR_PACKED(f32, LEVER_F32)
SCALAR_PACKED(f16, LEVER_F16)
SCALAR_PACKED(bf16, LEVER_BF16)
SCALAR_PACKED(q8_0, LEVER_Q8_0)
SCALAR_PACKED(q4_0, LEVER_Q4_0)
SCALAR_PACKED(q5_0, LEVER_Q5_0)
SCALAR_PACKED(q4_K, LEVER_Q4_K)
SCALAR_PACKED(q6_K, LEVER_Q6_K)

const lever_kernel_set lever_kernels_scalar = {
    .rows = SCALAR_ROWS,
    .quantize_q8_0x = lever_quantize_row_q8_0x,
    .quantize_q8_K = lever_quantize_row_q8_K,
    .tile = LEVER_KERNEL_TABLE(tile, scalar),
    .packed = LEVER_KERNEL_TABLE(packed, scalar),
};
