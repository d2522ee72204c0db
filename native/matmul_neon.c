/* matmul_neon.c: the tile kernels for arm64 NEON + dotprod, 4 rows per tile.
 *
 * Same layout as the x86 kernels: one 32-bit lane per weight row, weights transposed once
 * per block so that register k holds bytes 4k..4k+3 of every row. sdot by lane
 * (vdotq_laneq_s32) broadcasts four activation bytes from a register, so each lane
 * accumulates its own row. sdot is signed by signed, so weights go in as their signed
 * values (q - 8, q - 16, q - 32, w) and need no offset correction. Integer sums are exact
 * and the float steps canonical, so results equal the scalar kernels bit for bit.
 */
#include <arm_neon.h>
#include <math.h>

#include "quants_internal.h"

#define ROWS 4
#define TILE LEVER_TILE_ROWS /* a packed tile is four slices of ROWS rows */

/* Where a tile's rows come from. Row layout: ROWS row pointers into the matrix (rows past the
 * end repeat the last row) and the next tile's bytes, prefetched as we go. Tile layout: slice
 * `sub` of a packed tile, whose bytes sit at 4 * ROWS * sub in each 64-byte group and at
 * 2 * ROWS * sub in each 32-byte run of fp16 scales. */
typedef struct {
    const uint8_t *p[ROWS];
    const uint8_t *tile;
    const uint8_t *next;
    int64_t next_bytes;
    int sub;
    int n_rows;
} tile_src;

static inline void src_rows(tile_src *s, const uint8_t *w, int64_t stride, int n_rows) {
    for (int i = 0; i < ROWS; i++) s->p[i] = w + (i < n_rows ? i : n_rows - 1) * stride;
    s->tile = NULL;
    s->next = w + ROWS * stride;
    s->next_bytes = ROWS * stride;
    s->n_rows = n_rows;
}

static inline void src_tile(tile_src *s, const uint8_t *tile, int sub, int n_rows) {
    s->tile = tile;
    s->sub = sub;
    s->n_rows = n_rows;
}

/* ---- loads and transpositions --------------------------------------------------------- */

/* In place: r[i] lane k becomes r[k] lane i (4x4 of 32-bit elements). */
static inline void transpose_4x4(uint32x4_t r[4]) {
    const uint32x4x2_t a = vtrnq_u32(r[0], r[1]), b = vtrnq_u32(r[2], r[3]);
    r[0] = vreinterpretq_u32_u64(vzip1q_u64(vreinterpretq_u64_u32(a.val[0]), vreinterpretq_u64_u32(b.val[0])));
    r[1] = vreinterpretq_u32_u64(vzip1q_u64(vreinterpretq_u64_u32(a.val[1]), vreinterpretq_u64_u32(b.val[1])));
    r[2] = vreinterpretq_u32_u64(vzip2q_u64(vreinterpretq_u64_u32(a.val[0]), vreinterpretq_u64_u32(b.val[0])));
    r[3] = vreinterpretq_u32_u64(vzip2q_u64(vreinterpretq_u64_u32(a.val[1]), vreinterpretq_u64_u32(b.val[1])));
}

/* The 16 bytes at `off` of each row: lane i of out[k] = bytes 4k..4k+3 of row i. */
static inline void transpose_16B(const tile_src *tr, int64_t off, uint8x16_t out[4]) {
    uint32x4_t r[4];
    for (int i = 0; i < ROWS; i++) r[i] = vreinterpretq_u32_u8(vld1q_u8(tr->p[i] + off));
    transpose_4x4(r);
    for (int k = 0; k < 4; k++) out[k] = vreinterpretq_u8_u32(r[k]);
}

/* The fp16 at `off` of each row, as float. */
static inline float32x4_t load_fp16(const tile_src *tr, int64_t off) {
    uint16_t h[ROWS];
    for (int i = 0; i < ROWS; i++) memcpy(&h[i], tr->p[i] + off, 2);
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)));
}

/* Four groups of four bytes from byte `off` of every row: lane i of out[k] = bytes
 * off + 4k .. off + 4k + 3 of row i. In the tile layout they are already there. */
static inline __attribute__((always_inline)) void groups(const tile_src *s, int packed, int64_t off,
                                                         uint8x16_t out[4]) {
    if (packed) {
        const uint8_t *p = s->tile + TILE * off + 4 * ROWS * s->sub;
        for (int k = 0; k < 4; k++) out[k] = vld1q_u8(p + 64 * k);
    } else {
        transpose_16B(s, off, out);
    }
}

/* The fp16 at byte `off` of every row, as float. */
static inline __attribute__((always_inline)) float32x4_t halves(const tile_src *s, int packed, int64_t off) {
    if (packed) return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(s->tile + TILE * off) + ROWS * s->sub)));
    return load_fp16(s, off);
}

/* Block b of nb, `bytes` long in a row, asks for bytes ahead (quants_internal.h): in the
 * row layout its share of the next tile, in the tile layout what lies PREFETCH_AHEAD on. */
static inline void prefetch(const tile_src *s, int packed, int64_t b, int64_t nb, int64_t bytes) {
    if (packed)
        lever_prefetch_ahead(s->tile + TILE * b * bytes, TILE * bytes);
    else
        lever_prefetch_share(s->next, s->next_bytes, b, nb);
}

/* vqtbl1q_u8 control that fills byte k of every dword with byte src[k] of the same dword
 * (src[k] < 0: zero). */
static inline uint8x16_t dword_bytes(int b0, int b1, int b2, int b3) {
    const int src[4] = {b0, b1, b2, b3};
    uint8_t v[16];
    for (int i = 0; i < 16; i++) v[i] = (uint8_t)(src[i % 4] < 0 ? 0xff : 4 * (i / 4) + src[i % 4]);
    return vld1q_u8(v);
}

/* ---- activation quantization: the scalar quantizers, 4 values at a time ---------------- */

/* 16 int32 (each in -127..127) as 16 int8 in order. */
static inline int8x16_t narrow_int8x16(const int32x4_t q[4]) {
    const int16x8_t lo = vcombine_s16(vmovn_s32(q[0]), vmovn_s32(q[1]));
    const int16x8_t hi = vcombine_s16(vmovn_s32(q[2]), vmovn_s32(q[3]));
    return vcombine_s8(vmovn_s16(lo), vmovn_s16(hi));
}

static void quantize_q8_0x_neon(const float *x, lever_q8_0x *y, int64_t n) {
    for (int64_t b = 0; b < n / QK8_0; b++, x += QK8_0, y++) {
        float32x4_t v[8], m = vdupq_n_f32(0.0f);
        for (int i = 0; i < 8; i++) {
            v[i] = vld1q_f32(x + 4 * i);
            m = vmaxq_f32(m, vabsq_f32(v[i]));
        }
        const float d = vmaxvq_f32(m) / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int32x4_t q[8], sum = vdupq_n_s32(0);
        for (int i = 0; i < 8; i++) { /* fcvtas rounds half away from zero, as roundf */
            q[i] = vcvtaq_s32_f32(vmulq_n_f32(v[i], id));
            sum = vaddq_s32(sum, q[i]);
        }
        vst1q_s8(y->qs, narrow_int8x16(q));
        vst1q_s8(y->qs + 16, narrow_int8x16(q + 4));
        y->sum = vaddvq_s32(sum);
        y->d = lever_fp16_to_fp32(lever_fp32_to_fp16(d));
    }
}

static void quantize_q8_K_neon(const float *x, block_q8_K *y, int64_t n) {
    for (int64_t b = 0; b < n / QK_K; b++, x += QK_K, y++) {
        float32x4_t m = vdupq_n_f32(0.0f);
        for (int i = 0; i < 64; i++) m = vmaxq_f32(m, vabsq_f32(vld1q_f32(x + 4 * i)));
        const float amax = vmaxvq_f32(m);
        if (amax == 0.0f) {
            memset(y, 0, sizeof(*y));
            continue;
        }
        float max = 0.0f; /* the first value of largest magnitude sets the sign */
        for (int j = 0; j < QK_K; j++) {
            if (fabsf(x[j]) == amax) {
                max = x[j];
                break;
            }
        }
        const float iscale = -127.0f / max;
        for (int i = 0; i < 16; i++) {
            int32x4_t q[4];
            for (int k = 0; k < 4; k++) /* fcvtns: nearest even */
                q[k] = vminq_s32(vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + 16 * i + 4 * k), iscale)), vdupq_n_s32(127));
            vst1q_s8(y->qs + 16 * i, narrow_int8x16(q));
            y->bsums[i] = (int16_t)vaddvq_s32(vaddq_s32(vaddq_s32(q[0], q[1]), vaddq_s32(q[2], q[3])));
        }
        y->d = 1.0f / iscale;
    }
}

/* ---- per-token accumulation ------------------------------------------------------------ */

/* init + sum over k < n (a multiple of 4) of q[k] (s8 per row) . a[4k..4k+3]. */
static inline int32x4_t dot_groups(const int8x16_t *q, int n, const int8_t *a, int32x4_t init) {
    int32x4_t s0 = init, s1 = vdupq_n_s32(0);
    for (int k = 0; k < n; k += 4) {
        const int8x16_t av = vld1q_s8(a + 4 * k);
        s0 = vdotq_laneq_s32(s0, q[k], av, 0);
        s1 = vdotq_laneq_s32(s1, q[k + 1], av, 1);
        s0 = vdotq_laneq_s32(s0, q[k + 2], av, 2);
        s1 = vdotq_laneq_s32(s1, q[k + 3], av, 3);
    }
    return vaddq_s32(s0, s1);
}

/* acc = fma((float)isum, dw * dx, acc): the canonical per-block float step. */
static inline void acc_update(float *acc, int32x4_t isum, float32x4_t dw, float dx) {
    vst1q_f32(acc, vfmaq_f32(vld1q_f32(acc), vcvtq_f32_s32(isum), vmulq_n_f32(dw, dx)));
}

/* Zeroes the accumulators and asks for the output lines now: written at the end of the
 * tile, one line per token, they would otherwise each wait for memory (y can be 19 MB). */
static inline void acc_zero(float (*acc)[ROWS], int n_tok, float *y, int64_t ldy) {
    for (int t = 0; t < n_tok; t++) {
        vst1q_f32(acc[t], vdupq_n_f32(0.0f));
        __builtin_prefetch(y + t * ldy, 1, 3);
    }
}

static inline void acc_store(float (*acc)[ROWS], int n_tok, const tile_src *tr, float *y, int64_t ldy) {
    for (int t = 0; t < n_tok; t++)
        for (int r = 0; r < tr->n_rows; r++) y[t * ldy + r] = acc[t][r];
}

/* ---- float weights --------------------------------------------------------------------- */

/* Float types, element k of row r: row layout at row + k * size, tile layout at
 * tile + TILE * size * k + size * r (a block is one element). */
enum { F32, F16, BF16 };

/* Up to 4 weights of a row from k0, as floats (kn < 4: the rest zero, nothing read past). */
static inline float32x4_t load_row(int kind, const uint8_t *row, int64_t k0, int kn) {
    if (kind == F32) {
        const float *p = (const float *)row + k0;
        if (kn == 4) return vld1q_f32(p);
        float tmp[4] = {0};
        memcpy(tmp, p, (size_t)kn * sizeof(float));
        return vld1q_f32(tmp);
    }
    uint16_t tmp[4] = {0};
    memcpy(tmp, (const uint16_t *)row + k0, (size_t)kn * sizeof(uint16_t));
    if (kind == F16) return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(tmp)));
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(tmp), 16));
}

/* Element k of the slice's ROWS rows of a packed tile. */
static inline float32x4_t load_tiled(int kind, const tile_src *s, int64_t k) {
    if (kind == F32) return vld1q_f32((const float *)s->tile + TILE * k + ROWS * s->sub);
    const uint16x4_t h = vld1_u16((const uint16_t *)s->tile + TILE * k + ROWS * s->sub);
    if (kind == F16) return vcvt_f32_f16(vreinterpret_f16_u16(h));
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
}

/* Weights k0..k0+kn-1 of all rows against every token: acc = fma(w[k], x[k], acc) in k
 * order (kn = 4 for whole chunks). */
static inline __attribute__((always_inline)) void float_chunk(const tile_src *s, int packed, int kind,
                                                              int64_t k0, int kn, const uint8_t *x,
                                                              int64_t x_stride, int n_tok,
                                                              float (*acc)[ROWS]) {
    float32x4_t w[4];
    if (packed) {
        for (int k = 0; k < kn; k++) w[k] = load_tiled(kind, s, k0 + k);
    } else {
        uint32x4_t r[4];
        for (int i = 0; i < ROWS; i++) r[i] = vreinterpretq_u32_f32(load_row(kind, s->p[i], k0, kn));
        transpose_4x4(r);
        for (int k = 0; k < 4; k++) w[k] = vreinterpretq_f32_u32(r[k]);
    }
    for (int t = 0; t < n_tok; t++) {
        const float *xt = (const float *)(x + t * x_stride) + k0;
        float32x4_t a = vld1q_f32(acc[t]);
        for (int k = 0; k < kn; k++) a = vfmaq_n_f32(a, w[k], xt[k]);
        vst1q_f32(acc[t], a);
    }
}

static inline __attribute__((always_inline)) void float_body(const tile_src *s, int packed, int kind,
                                                             int64_t n_in, const uint8_t *x, int64_t x_stride,
                                                             int n_tok, float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(16)));
    acc_zero(acc, n_tok, y, ldy);
    const int64_t n_chunks = (n_in + 3) / 4;
    for (int64_t c = 0; c < n_chunks; c++) {
        prefetch(s, packed, c, n_chunks, 4 * (kind == F32 ? 4 : 2));
        const int64_t k0 = 4 * c;
        if (k0 + 4 <= n_in)
            float_chunk(s, packed, kind, k0, 4, x, x_stride, n_tok, acc);
        else
            float_chunk(s, packed, kind, k0, (int)(n_in - k0), x, x_stride, n_tok, acc);
    }
    acc_store(acc, n_tok, s, y, ldy);
}

/* ---- 32-weight blocks against Q8_0 activations ---------------------------------------- */

static inline __attribute__((always_inline)) void q8_0_body(const tile_src *s, int packed, int64_t n_in,
                                                           const uint8_t *x, int64_t x_stride, int n_tok,
                                                           float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(16)));
    acc_zero(acc, n_tok, y, ldy);
    for (int64_t b = 0; b < n_in / QK8_0; b++) {
        prefetch(s, packed, b, n_in / QK8_0, sizeof(block_q8_0));
        const int64_t off = b * (int64_t)sizeof(block_q8_0);
        uint8x16_t p[8];
        groups(s, packed, off + 2, p);
        groups(s, packed, off + 18, p + 4);
        int8x16_t q[8];
        for (int k = 0; k < 8; k++) q[k] = vreinterpretq_s8_u8(p[k]);
        const float32x4_t dw = halves(s, packed, off);
        for (int t = 0; t < n_tok; t++) {
            const lever_q8_0x *a = (const lever_q8_0x *)(x + t * x_stride) + b;
            acc_update(acc[t], dot_groups(q, 8, a->qs, vdupq_n_s32(0)), dw, a->d);
        }
    }
    acc_store(acc, n_tok, s, y, ldy);
}

/* Q4_0 and Q5_0: groups 0..3 are low nibbles, 4..7 high nibbles of the same 16 bytes. */
static inline void split_nibbles(const uint8x16_t p[4], uint8x16_t q[8]) {
    for (int k = 0; k < 4; k++) {
        q[k] = vandq_u8(p[k], vdupq_n_u8(0x0f));
        q[k + 4] = vshrq_n_u8(p[k], 4);
    }
}

static inline __attribute__((always_inline)) void q4_0_body(const tile_src *s, int packed, int64_t n_in,
                                                           const uint8_t *x, int64_t x_stride, int n_tok,
                                                           float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(16)));
    acc_zero(acc, n_tok, y, ldy);
    for (int64_t b = 0; b < n_in / QK8_0; b++) {
        prefetch(s, packed, b, n_in / QK8_0, sizeof(block_q4_0));
        const int64_t off = b * (int64_t)sizeof(block_q4_0);
        uint8x16_t p[4], u[8];
        groups(s, packed, off + 2, p);
        split_nibbles(p, u);
        int8x16_t q[8];
        for (int k = 0; k < 8; k++) q[k] = vsubq_s8(vreinterpretq_s8_u8(u[k]), vdupq_n_s8(8));
        const float32x4_t dw = halves(s, packed, off);
        for (int t = 0; t < n_tok; t++) {
            const lever_q8_0x *a = (const lever_q8_0x *)(x + t * x_stride) + b;
            acc_update(acc[t], dot_groups(q, 8, a->qs, vdupq_n_s32(0)), dw, a->d);
        }
    }
    acc_store(acc, n_tok, s, y, ldy);
}

static inline __attribute__((always_inline)) void q5_0_body(const tile_src *s, int packed, int64_t n_in,
                                                           const uint8_t *x, int64_t x_stride, int n_tok,
                                                           float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(16)));
    acc_zero(acc, n_tok, y, ldy);
    /* Group k (elements 4k..4k+3) takes its fifth bits from qh byte k / 2, bits 4(k % 2) + j. */
    uint8x16_t spread[4];
    for (int i = 0; i < 4; i++) spread[i] = dword_bytes(i, i, i, i);
    const uint8x16_t bit_lo = vreinterpretq_u8_u32(vdupq_n_u32(0x08040201));
    const uint8x16_t bit_hi = vreinterpretq_u8_u32(vdupq_n_u32(0x80402010));
    for (int64_t b = 0; b < n_in / QK8_0; b++) {
        prefetch(s, packed, b, n_in / QK8_0, sizeof(block_q5_0));
        const int64_t off = b * (int64_t)sizeof(block_q5_0);
        uint8x16_t p[4], u[8];
        groups(s, packed, off + 6, p);
        split_nibbles(p, u);
        uint8x16_t qh;
        if (packed) {
            qh = vld1q_u8(s->tile + TILE * (off + 2) + 4 * ROWS * s->sub);
        } else {
            uint32_t qh_rows[ROWS];
            for (int i = 0; i < ROWS; i++) memcpy(&qh_rows[i], s->p[i] + off + 2, 4);
            qh = vreinterpretq_u8_u32(vld1q_u32(qh_rows));
        }
        int8x16_t q[8];
        for (int k = 0; k < 8; k++) {
            const uint8x16_t set = vtstq_u8(vqtbl1q_u8(qh, spread[k / 2]), k % 2 ? bit_hi : bit_lo);
            const uint8x16_t v = vorrq_u8(u[k], vandq_u8(set, vdupq_n_u8(16)));
            q[k] = vsubq_s8(vreinterpretq_s8_u8(v), vdupq_n_s8(16));
        }
        const float32x4_t dw = halves(s, packed, off);
        for (int t = 0; t < n_tok; t++) {
            const lever_q8_0x *a = (const lever_q8_0x *)(x + t * x_stride) + b;
            acc_update(acc[t], dot_groups(q, 8, a->qs, vdupq_n_s32(0)), dw, a->d);
        }
    }
    acc_store(acc, n_tok, s, y, ldy);
}

/* ---- 256-weight super-blocks against Q8_K activations ---------------------------------- */

static inline __attribute__((always_inline)) void q4_K_body(const tile_src *s, int packed, int64_t n_in,
                                                           const uint8_t *x, int64_t x_stride, int n_tok,
                                                           float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(16)));
    int32_t isum[LEVER_TOK_TILE][ROWS] __attribute__((aligned(16)));
    acc_zero(acc, n_tok, y, ldy);
    uint8x16_t byte_sel[4];
    for (int i = 0; i < 4; i++) byte_sel[i] = dword_bytes(i, -1, -1, -1);
    const uint8x16_t m4 = vdupq_n_u8(0x0f), m6 = vdupq_n_u8(0x3f);
    for (int64_t b = 0; b < n_in / QK_K; b++) {
        prefetch(s, packed, b, n_in / QK_K, sizeof(block_q4_K));
        const int64_t off = b * (int64_t)sizeof(block_q4_K);
        /* f[0] = d | dmin, f[1..3] = the 12 scale bytes, unpacked as q4_K_scale_min */
        uint8x16_t f[4];
        groups(s, packed, off, f);
        const uint32x4_t dd = vreinterpretq_u32_u8(f[0]);
        const float32x4_t dw = vcvt_f32_f16(vreinterpret_f16_u16(vmovn_u32(dd)));
        const float32x4_t dmin = vcvt_f32_f16(vreinterpret_f16_u16(vshrn_n_u32(dd, 16)));
        const uint8x16_t sc03 = vandq_u8(f[1], m6), m03 = vandq_u8(f[2], m6);
        const uint8x16_t sc47 = vorrq_u8(vandq_u8(f[3], m4), vshlq_n_u8(vshrq_n_u8(f[1], 6), 4));
        const uint8x16_t m47 = vorrq_u8(vshrq_n_u8(f[3], 4), vshlq_n_u8(vshrq_n_u8(f[2], 6), 4));
        int32x4_t sc[8], mins[8];
        for (int j = 0; j < 8; j++) {
            sc[j] = vreinterpretq_s32_u8(vqtbl1q_u8(j < 4 ? sc03 : sc47, byte_sel[j % 4]));
            mins[j] = vreinterpretq_s32_u8(vqtbl1q_u8(j < 4 ? m03 : m47, byte_sel[j % 4]));
        }
        for (int c = 0; c < 4; c++) {
            uint8x16_t p[8];
            groups(s, packed, off + 16 + 32 * c, p);
            groups(s, packed, off + 32 + 32 * c, p + 4);
            int8x16_t lo[8], hi[8];
            for (int k = 0; k < 8; k++) {
                lo[k] = vreinterpretq_s8_u8(vandq_u8(p[k], m4));
                hi[k] = vreinterpretq_s8_u8(vshrq_n_u8(p[k], 4));
            }
            for (int t = 0; t < n_tok; t++) {
                const block_q8_K *a = (const block_q8_K *)(x + t * x_stride) + b;
                const int32x4_t s_lo = dot_groups(lo, 8, a->qs + 64 * c, vdupq_n_s32(0));
                const int32x4_t s_hi = dot_groups(hi, 8, a->qs + 64 * c + 32, vdupq_n_s32(0));
                int32x4_t v = vmlaq_s32(vmulq_s32(s_lo, sc[2 * c]), s_hi, sc[2 * c + 1]);
                if (c) v = vaddq_s32(v, vld1q_s32(isum[t]));
                vst1q_s32(isum[t], v);
            }
        }
        for (int t = 0; t < n_tok; t++) {
            const block_q8_K *a = (const block_q8_K *)(x + t * x_stride) + b;
            /* msum = sum_j min_j * (bsums[2j] + bsums[2j + 1]) */
            const int16x8_t bs32 = vpaddq_s16(vld1q_s16(a->bsums), vld1q_s16(a->bsums + 8));
            const int32x4_t bs_lo = vmovl_s16(vget_low_s16(bs32)), bs_hi = vmovl_high_s16(bs32);
            int32x4_t msum = vmulq_laneq_s32(mins[0], bs_lo, 0);
            msum = vmlaq_laneq_s32(msum, mins[1], bs_lo, 1);
            msum = vmlaq_laneq_s32(msum, mins[2], bs_lo, 2);
            msum = vmlaq_laneq_s32(msum, mins[3], bs_lo, 3);
            msum = vmlaq_laneq_s32(msum, mins[4], bs_hi, 0);
            msum = vmlaq_laneq_s32(msum, mins[5], bs_hi, 1);
            msum = vmlaq_laneq_s32(msum, mins[6], bs_hi, 2);
            msum = vmlaq_laneq_s32(msum, mins[7], bs_hi, 3);
            float32x4_t r = vfmaq_f32(vld1q_f32(acc[t]), vcvtq_f32_s32(vld1q_s32(isum[t])), vmulq_n_f32(dw, a->d));
            r = vfmsq_f32(r, vcvtq_f32_s32(msum), vmulq_n_f32(dmin, a->d));
            vst1q_f32(acc[t], r);
        }
    }
    acc_store(acc, n_tok, s, y, ldy);
}

static inline __attribute__((always_inline)) void q6_K_body(const tile_src *s, int packed, int64_t n_in,
                                                           const uint8_t *x, int64_t x_stride, int n_tok,
                                                           float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(16)));
    int32_t isum[LEVER_TOK_TILE][ROWS] __attribute__((aligned(16)));
    acc_zero(acc, n_tok, y, ldy);
    uint8x16_t top_sel[4];
    for (int i = 0; i < 4; i++) top_sel[i] = dword_bytes(-1, -1, -1, i);
    const uint8x16_t m4 = vdupq_n_u8(0x0f), m30 = vdupq_n_u8(0x30);
    for (int64_t b = 0; b < n_in / QK_K; b++) {
        prefetch(s, packed, b, n_in / QK_K, sizeof(block_q6_K));
        const int64_t off = b * (int64_t)sizeof(block_q6_K);
        uint8x16_t sv[4];
        groups(s, packed, off + 192, sv);
        int32x4_t sc[16];
        for (int j = 0; j < 16; j++)
            sc[j] = vshrq_n_s32(vreinterpretq_s32_u8(vqtbl1q_u8(sv[j / 4], top_sel[j % 4])), 24);
        const float32x4_t dw = halves(s, packed, off + 208);
        for (int h = 0; h < 2; h++) {
            uint8x16_t qh[8];
            groups(s, packed, off + 128 + 32 * h, qh);
            groups(s, packed, off + 144 + 32 * h, qh + 4);
            for (int part = 0; part < 2; part++) {
                /* low nibbles: group `part`, high nibbles: group part + 2; group g takes qh
                 * bits 2g, 2g + 1 */
                uint8x16_t ql[8];
                groups(s, packed, off + 64 * h + 32 * part, ql);
                groups(s, packed, off + 64 * h + 32 * part + 16, ql + 4);
                int8x16_t lo[8], hi[8];
                for (int k = 0; k < 8; k++) {
                    const uint8x16_t h_lo = part ? vshlq_n_u8(qh[k], 2) : vshlq_n_u8(qh[k], 4);
                    const uint8x16_t h_hi = part ? vshrq_n_u8(qh[k], 2) : qh[k];
                    const uint8x16_t l = vorrq_u8(vandq_u8(ql[k], m4), vandq_u8(h_lo, m30));
                    const uint8x16_t u = vorrq_u8(vshrq_n_u8(ql[k], 4), vandq_u8(h_hi, m30));
                    lo[k] = vsubq_s8(vreinterpretq_s8_u8(l), vdupq_n_s8(32));
                    hi[k] = vsubq_s8(vreinterpretq_s8_u8(u), vdupq_n_s8(32));
                }
                const int j_lo = 8 * h + 2 * part, j_hi = j_lo + 4;
                for (int t = 0; t < n_tok; t++) {
                    const block_q8_K *a = (const block_q8_K *)(x + t * x_stride) + b;
                    const int8_t *aq = a->qs + 128 * h + 32 * part;
                    const int32x4_t z = vdupq_n_s32(0);
                    int32x4_t v = vmulq_s32(dot_groups(lo, 4, aq, z), sc[j_lo]);
                    v = vmlaq_s32(v, dot_groups(lo + 4, 4, aq + 16, z), sc[j_lo + 1]);
                    v = vmlaq_s32(v, dot_groups(hi, 4, aq + 64, z), sc[j_hi]);
                    v = vmlaq_s32(v, dot_groups(hi + 4, 4, aq + 80, z), sc[j_hi + 1]);
                    if (h | part) v = vaddq_s32(v, vld1q_s32(isum[t]));
                    vst1q_s32(isum[t], v);
                }
            }
        }
        for (int t = 0; t < n_tok; t++) {
            const block_q8_K *a = (const block_q8_K *)(x + t * x_stride) + b;
            acc_update(acc[t], vld1q_s32(isum[t]), dw, a->d);
        }
    }
    acc_store(acc, n_tok, s, y, ldy);
}

/* ---- the kernels: each body once per layout -------------------------------------------- */

#define KERNELS(name, call)                                                                                    \
    static void tile_##name##_neon(const uint8_t *w, int64_t w_stride, int n_rows, int64_t n_in,              \
                                   const uint8_t *x, int64_t x_stride, int n_tok, float *y, int64_t ldy) {     \
        tile_src s;                                                                                            \
        src_rows(&s, w, w_stride, n_rows);                                                                     \
        call(&s, 0, n_in, x, x_stride, n_tok, y, ldy);                                                         \
    }                                                                                                          \
    static void packed_##name##_neon(const uint8_t *tile, int sub, int n_rows, int64_t n_in,                  \
                                     const uint8_t *x, int64_t x_stride, int n_tok, float *y, int64_t ldy) {   \
        tile_src s;                                                                                            \
        src_tile(&s, tile, sub, n_rows);                                                                       \
        call(&s, 1, n_in, x, x_stride, n_tok, y, ldy);                                                         \
    }

#define F32_BODY(s, packed, ...) float_body(s, packed, F32, __VA_ARGS__)
#define F16_BODY(s, packed, ...) float_body(s, packed, F16, __VA_ARGS__)
#define BF16_BODY(s, packed, ...) float_body(s, packed, BF16, __VA_ARGS__)
KERNELS(f32, F32_BODY)
KERNELS(f16, F16_BODY)
KERNELS(bf16, BF16_BODY)
KERNELS(q8_0, q8_0_body)
KERNELS(q4_0, q4_0_body)
KERNELS(q5_0, q5_0_body)
KERNELS(q4_K, q4_K_body)
KERNELS(q6_K, q6_K_body)

const lever_kernel_set lever_kernels_neon = {
    .rows = ROWS,
    .quantize_q8_0x = quantize_q8_0x_neon,
    .quantize_q8_K = quantize_q8_K_neon,
    .tile = LEVER_KERNEL_TABLE(tile, neon),
    .packed = LEVER_KERNEL_TABLE(packed, neon),
};
