/* matmul_avx512.c: the tile kernels for AVX-512 F/BW/VL/DQ + VNNI, 16 rows per tile.
 *
 * Layout: one 32-bit lane per weight row. A tile loads the same block of 16 rows and
 * transposes it so that register k holds bytes 4k..4k+3 of every row; vpdpbusd then
 * multiplies it by those four activation bytes broadcast from memory, and each lane
 * accumulates its own row. No horizontal sums, and the transposition is paid once per
 * weight block however many tokens use it.
 *
 * vpdpbusd multiplies unsigned by signed bytes, so weights go in unsigned (Q4: q, Q5: q,
 * Q6_K: q, Q8_0: w + 128) and the offset comes back out through the activation block sums
 * (sum of a, or the Q8_K bsums). All integer sums are exact, and the float steps follow
 * the canonical order of quants_internal.h, so results equal the scalar kernels bit for bit.
 */
#include <immintrin.h>

#include "quants_internal.h"

#define ROWS 16
#define TILE LEVER_TILE_ROWS /* ROWS == TILE: a packed tile is one slice */

/* Where a tile's rows come from. Row layout: ROWS row pointers into the matrix (rows past the
 * end repeat the last row) and the next tile's bytes, prefetched as we go. Tile layout: the
 * packed tile, read front to back (the hardware prefetchers follow one stream well). */
typedef struct {
    const uint8_t *p[ROWS];
    const uint8_t *tile;
    const uint8_t *next;
    int64_t next_bytes;
    __mmask16 mask; /* lanes that are real rows */
} tile_src;

static inline void src_rows(tile_src *s, const uint8_t *w, int64_t stride, int n_rows) {
    for (int i = 0; i < ROWS; i++) s->p[i] = w + (i < n_rows ? i : n_rows - 1) * stride;
    s->tile = NULL;
    s->next = w + ROWS * stride;
    s->next_bytes = ROWS * stride;
    s->mask = (__mmask16)((1u << n_rows) - 1);
}

static inline void src_tile(tile_src *s, const uint8_t *tile, int n_rows) {
    s->tile = tile;
    s->mask = (__mmask16)((1u << n_rows) - 1);
}

/* ---- loads and transpositions --------------------------------------------------------- */

static inline __m512i bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

static inline int u16_at(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* The fp16 at byte `off` of each row, as float (gathers are slow; inserts are one load
 * and one shuffle each). */
static inline __m512 fp16_rows(const tile_src *tr, int64_t off) {
    __m128i lo = _mm_cvtsi32_si128(u16_at(tr->p[0] + off)), hi = _mm_cvtsi32_si128(u16_at(tr->p[8] + off));
    lo = _mm_insert_epi16(lo, u16_at(tr->p[1] + off), 1);
    hi = _mm_insert_epi16(hi, u16_at(tr->p[9] + off), 1);
    lo = _mm_insert_epi16(lo, u16_at(tr->p[2] + off), 2);
    hi = _mm_insert_epi16(hi, u16_at(tr->p[10] + off), 2);
    lo = _mm_insert_epi16(lo, u16_at(tr->p[3] + off), 3);
    hi = _mm_insert_epi16(hi, u16_at(tr->p[11] + off), 3);
    lo = _mm_insert_epi16(lo, u16_at(tr->p[4] + off), 4);
    hi = _mm_insert_epi16(hi, u16_at(tr->p[12] + off), 4);
    lo = _mm_insert_epi16(lo, u16_at(tr->p[5] + off), 5);
    hi = _mm_insert_epi16(hi, u16_at(tr->p[13] + off), 5);
    lo = _mm_insert_epi16(lo, u16_at(tr->p[6] + off), 6);
    hi = _mm_insert_epi16(hi, u16_at(tr->p[14] + off), 6);
    lo = _mm_insert_epi16(lo, u16_at(tr->p[7] + off), 7);
    hi = _mm_insert_epi16(hi, u16_at(tr->p[15] + off), 7);
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

/* fp16 in the low half of each dword, as float. */
static inline __m512 fp16_lo(__m512i v) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
}

/* The 32 bytes at `off` of each row, transposed: lane i of out[k] = bytes 4k..4k+3 of row i.
 * Rows are paired in 256-bit halves (i with i + 4, i + 8 with i + 12) so that the final
 * 128-bit shuffles leave the lanes in row order. */
static inline void transpose_32B(const tile_src *tr, int64_t off, __m512i out[8]) {
    __m512i r[8], u[8];
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(tr->p[i] + off))),
                                  _mm256_loadu_si256((const __m256i *)(tr->p[i + 4] + off)), 1);
        r[i + 4] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(tr->p[i + 8] + off))),
                                      _mm256_loadu_si256((const __m256i *)(tr->p[i + 12] + off)), 1);
    }
    for (int g = 0; g < 2; g++) {
        const __m512i *q = r + 4 * g;
        const __m512i t0 = _mm512_unpacklo_epi32(q[0], q[1]), t1 = _mm512_unpackhi_epi32(q[0], q[1]);
        const __m512i t2 = _mm512_unpacklo_epi32(q[2], q[3]), t3 = _mm512_unpackhi_epi32(q[2], q[3]);
        u[4 * g + 0] = _mm512_unpacklo_epi64(t0, t2);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t0, t2);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t1, t3);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t1, t3);
    }
    for (int j = 0; j < 4; j++) {
        out[j] = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
        out[j + 4] = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
    }
}

/* The 16 bytes at `off` of each row, transposed: lane i of out[k] = bytes 4k..4k+3 of row i.
 * 128-bit lane c of r[q] holds row 4c + q, so 4x4 transposes inside lanes finish the job. */
static inline void transpose_16B(const tile_src *tr, int64_t off, __m512i out[4]) {
    __m512i r[4];
    for (int q = 0; q < 4; q++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(tr->p[q] + off)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(tr->p[q + 4] + off)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(tr->p[q + 8] + off)), 2);
        r[q] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(tr->p[q + 12] + off)), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2);
    out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3);
    out[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* n (4 or 8) groups of four bytes from byte `off` of every row: lane i of out[k] = bytes
 * off + 4k .. off + 4k + 3 of row i. In the tile layout they are already there. */
static inline __attribute__((always_inline)) void groups(const tile_src *s, int packed, int64_t off, int n,
                                                         __m512i *out) {
    if (packed) {
        for (int k = 0; k < n; k++) out[k] = _mm512_loadu_si512(s->tile + TILE * off + 64 * k);
    } else if (n == 8) {
        transpose_32B(s, off, out);
    } else {
        transpose_16B(s, off, out);
    }
}

/* The fp16 at byte `off` of every row, as float. */
static inline __attribute__((always_inline)) __m512 halves(const tile_src *s, int packed, int64_t off) {
    if (packed) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s->tile + TILE * off)));
    return fp16_rows(s, off);
}

/* Block b of nb, `bytes` long in a row, asks for bytes ahead (quants_internal.h): in the
 * row layout its share of the next tile, in the tile layout what lies PREFETCH_AHEAD on. */
static inline void prefetch(const tile_src *s, int packed, int64_t b, int64_t nb, int64_t bytes) {
    if (packed)
        lever_prefetch_ahead(s->tile + TILE * b * bytes, TILE * bytes);
    else
        lever_prefetch_share(s->next, s->next_bytes, b, nb);
}

/* In place: r[i] lane k becomes r[k] lane i. */
static inline void transpose_16x16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) {
        const __m512d *a = (const __m512d *)(t + 4 * g);
        u[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a[0], a[2]));
        u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a[0], a[2]));
        u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a[1], a[3]));
        u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a[1], a[3]));
    }
    /* u[4g + j], 128-bit lane c = element 4c + j of rows 4g..4g+3 */
    for (int j = 0; j < 4; j++) {
        const __m512 lo01 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44);
        const __m512 lo23 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
        const __m512 hi01 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xee);
        const __m512 hi23 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xee);
        r[j] = _mm512_shuffle_f32x4(lo01, lo23, 0x88);
        r[4 + j] = _mm512_shuffle_f32x4(lo01, lo23, 0xdd);
        r[8 + j] = _mm512_shuffle_f32x4(hi01, hi23, 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(hi01, hi23, 0xdd);
    }
}

/* vpshufb control that fills byte k of every dword with byte src[k] of the same dword
 * (src[k] < 0: zero). */
static inline __m512i dword_bytes(int b0, int b1, int b2, int b3) {
    const int src[4] = {b0, b1, b2, b3};
    int32_t v[16];
    for (int i = 0; i < 16; i++) {
        uint32_t x = 0;
        for (int k = 0; k < 4; k++) x |= (uint32_t)(src[k] < 0 ? 0x80 : 4 * (i % 4) + src[k]) << (8 * k);
        v[i] = (int32_t)x;
    }
    return _mm512_loadu_si512(v);
}

/* ---- activation quantization: the scalar quantizers, 16 values at a time ------------- */

/* roundf of float lanes as int32: truncate, then step away from zero when the (exact)
 * remainder is at least one half. */
static inline __m512i round_half_away(__m512 v) {
    const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m512 rest = _mm512_sub_ps(v, t), one = _mm512_set1_ps(1.0f);
    __m512 r = _mm512_mask_add_ps(t, _mm512_cmp_ps_mask(rest, _mm512_set1_ps(0.5f), _CMP_GE_OQ), t, one);
    r = _mm512_mask_sub_ps(r, _mm512_cmp_ps_mask(rest, _mm512_set1_ps(-0.5f), _CMP_LE_OQ), r, one);
    return _mm512_cvttps_epi32(r);
}

static void quantize_q8_0x_avx512(const float *x, lever_q8_0x *y, int64_t n) {
    for (int64_t b = 0; b < n / QK8_0; b++, x += QK8_0, y++) {
        const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 127.0f;
        const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        const __m512i q0 = round_half_away(_mm512_mul_ps(v0, id)), q1 = round_half_away(_mm512_mul_ps(v1, id));
        _mm_storeu_si128((__m128i *)y->qs, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(y->qs + 16), _mm512_cvtepi32_epi8(q1));
        y->sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        y->d = lever_fp16_to_fp32(lever_fp32_to_fp16(d));
    }
}

static void quantize_q8_K_avx512(const float *x, block_q8_K *y, int64_t n) {
    for (int64_t b = 0; b < n / QK_K; b++, x += QK_K, y++) {
        __m512 amax_v = _mm512_setzero_ps();
        for (int i = 0; i < 16; i++) amax_v = _mm512_max_ps(amax_v, _mm512_abs_ps(_mm512_loadu_ps(x + 16 * i)));
        const float amax = _mm512_reduce_max_ps(amax_v);
        if (amax == 0.0f) {
            memset(y, 0, sizeof(*y));
            continue;
        }
        float max = 0.0f; /* the first value of largest magnitude sets the sign */
        for (int i = 0; i < 16; i++) {
            const __mmask16 at = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + 16 * i)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
            if (at) {
                max = x[16 * i + __builtin_ctz(at)];
                break;
            }
        }
        const float iscale = -127.0f / max;
        for (int i = 0; i < 16; i++) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_set1_ps(iscale), _mm512_loadu_ps(x + 16 * i)));
            q = _mm512_min_epi32(q, _mm512_set1_epi32(127)); /* rounded to nearest even */
            _mm_storeu_si128((__m128i *)(y->qs + 16 * i), _mm512_cvtepi32_epi8(q));
            y->bsums[i] = (int16_t)_mm512_reduce_add_epi32(q);
        }
        y->d = 1.0f / iscale;
    }
}

/* ---- per-token accumulation ------------------------------------------------------------ */

/* init + sum over k < n of q[k] (u8 per row) . activation bytes a[4k..4k+3] (s8). */
static inline __m512i dot_groups(const __m512i *q, int n, const int8_t *a, __m512i init) {
    __m512i s0 = init, s1 = _mm512_setzero_si512();
    for (int k = 0; k < n; k += 2) {
        s0 = _mm512_dpbusd_epi32(s0, q[k], bcast4(a + 4 * k));
        s1 = _mm512_dpbusd_epi32(s1, q[k + 1], bcast4(a + 4 * k + 4));
    }
    return _mm512_add_epi32(s0, s1);
}

/* acc = fma((float)isum, dw * dx, acc): the canonical per-block float step. */
static inline void acc_update(float *acc, __m512i isum, __m512 dw, float dx) {
    const __m512 d = _mm512_mul_ps(dw, _mm512_set1_ps(dx));
    _mm512_store_ps(acc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), d, _mm512_load_ps(acc)));
}

/* Zeroes the accumulators and asks for the output lines now: written at the end of the
 * tile, one line per token, they would otherwise each wait for memory (y can be 19 MB). */
static inline void acc_zero(float (*acc)[ROWS], int n_tok, float *y, int64_t ldy) {
    for (int t = 0; t < n_tok; t++) {
        _mm512_store_ps(acc[t], _mm512_setzero_ps());
        __builtin_prefetch(y + t * ldy, 1, 3);
    }
}

static inline void acc_store(float (*acc)[ROWS], int n_tok, const tile_src *tr, float *y, int64_t ldy) {
    for (int t = 0; t < n_tok; t++) _mm512_mask_storeu_ps(y + t * ldy, tr->mask, _mm512_load_ps(acc[t]));
}

/* ---- float weights --------------------------------------------------------------------- */

/* Float types, element k of row r: row layout at row + k * size, tile layout at
 * tile + TILE * size * k + size * r (a block is one element). */
enum { F32, F16, BF16 };

static inline __m512 load_row(int kind, const uint8_t *row, int64_t k0, __mmask16 m) {
    if (kind == F32) return _mm512_maskz_loadu_ps(m, (const float *)row + k0);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)row + k0);
    if (kind == F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Element k of all 16 rows of a packed tile. */
static inline __m512 load_tiled(int kind, const uint8_t *tile, int64_t k) {
    if (kind == F32) return _mm512_loadu_ps((const float *)tile + TILE * k);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)tile + TILE * k));
    if (kind == F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Weights k0..k0+kn-1 of all rows against every token: acc = fma(w[k], x[k], acc) in k
 * order. Called with kn = 16 for whole chunks, so the loop unrolls and w stays in registers. */
static inline __attribute__((always_inline)) void float_chunk(const tile_src *s, int packed, int kind,
                                                              int64_t k0, int kn, const uint8_t *x,
                                                              int64_t x_stride, int n_tok,
                                                              float (*acc)[ROWS]) {
    __m512 w[16];
    if (packed) {
        for (int k = 0; k < kn; k++) w[k] = load_tiled(kind, s->tile, k0 + k);
    } else {
        const __mmask16 km = (__mmask16)((1u << kn) - 1);
        for (int i = 0; i < ROWS; i++) w[i] = load_row(kind, s->p[i], k0, km);
        transpose_16x16(w);
    }
    for (int t = 0; t < n_tok; t++) {
        const float *xt = (const float *)(x + t * x_stride) + k0;
        __m512 a = _mm512_load_ps(acc[t]);
        for (int k = 0; k < kn; k++) a = _mm512_fmadd_ps(w[k], _mm512_set1_ps(xt[k]), a);
        _mm512_store_ps(acc[t], a);
    }
}

static inline __attribute__((always_inline)) void float_body(const tile_src *s, int packed, int kind,
                                                             int64_t n_in, const uint8_t *x, int64_t x_stride,
                                                             int n_tok, float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(64)));
    acc_zero(acc, n_tok, y, ldy);
    const int64_t n_chunks = (n_in + 15) / 16;
    for (int64_t c = 0; c < n_chunks; c++) {
        prefetch(s, packed, c, n_chunks, 16 * (kind == F32 ? 4 : 2));
        const int64_t k0 = 16 * c;
        if (k0 + 16 <= n_in)
            float_chunk(s, packed, kind, k0, 16, x, x_stride, n_tok, acc);
        else
            float_chunk(s, packed, kind, k0, (int)(n_in - k0), x, x_stride, n_tok, acc);
    }
    acc_store(acc, n_tok, s, y, ldy);
}

/* ---- 32-weight blocks against Q8_0 activations ---------------------------------------- */

static inline __attribute__((always_inline)) void q8_0_body(const tile_src *s, int packed, int64_t n_in,
                                                            const uint8_t *x, int64_t x_stride, int n_tok,
                                                            float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(64)));
    acc_zero(acc, n_tok, y, ldy);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t b = 0; b < n_in / QK8_0; b++) {
        prefetch(s, packed, b, n_in / QK8_0, sizeof(block_q8_0));
        const int64_t off = b * (int64_t)sizeof(block_q8_0);
        __m512i q[8];
        groups(s, packed, off + 2, 8, q);
        for (int k = 0; k < 8; k++) q[k] = _mm512_xor_si512(q[k], flip); /* w + 128 */
        const __m512 dw = halves(s, packed, off);
        for (int t = 0; t < n_tok; t++) {
            const lever_q8_0x *a = (const lever_q8_0x *)(x + t * x_stride) + b;
            const __m512i isum = dot_groups(q, 8, a->qs, _mm512_set1_epi32(-128 * a->sum));
            acc_update(acc[t], isum, dw, a->d);
        }
    }
    acc_store(acc, n_tok, s, y, ldy);
}

/* Q4_0 and Q5_0 keep elements 0..15 in low nibbles and 16..31 in high nibbles of the same
 * 16 bytes: after transposition, groups 0..3 are low nibbles, 4..7 high nibbles. */
static inline void split_nibbles(const __m512i p[4], __m512i q[8]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int k = 0; k < 4; k++) {
        q[k] = _mm512_and_si512(p[k], m4);
        q[k + 4] = _mm512_and_si512(_mm512_srli_epi16(p[k], 4), m4);
    }
}

static inline __attribute__((always_inline)) void q4_0_body(const tile_src *s, int packed, int64_t n_in,
                                                            const uint8_t *x, int64_t x_stride, int n_tok,
                                                            float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(64)));
    acc_zero(acc, n_tok, y, ldy);
    for (int64_t b = 0; b < n_in / QK8_0; b++) {
        prefetch(s, packed, b, n_in / QK8_0, sizeof(block_q4_0));
        const int64_t off = b * (int64_t)sizeof(block_q4_0);
        __m512i p[4], q[8];
        groups(s, packed, off + 2, 4, p);
        split_nibbles(p, q);
        const __m512 dw = halves(s, packed, off);
        for (int t = 0; t < n_tok; t++) {
            const lever_q8_0x *a = (const lever_q8_0x *)(x + t * x_stride) + b;
            const __m512i isum = dot_groups(q, 8, a->qs, _mm512_set1_epi32(-8 * a->sum));
            acc_update(acc[t], isum, dw, a->d);
        }
    }
    acc_store(acc, n_tok, s, y, ldy);
}

static inline __attribute__((always_inline)) void q5_0_body(const tile_src *s, int packed, int64_t n_in,
                                                            const uint8_t *x, int64_t x_stride, int n_tok,
                                                            float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(64)));
    acc_zero(acc, n_tok, y, ldy);
    /* Group k (elements 4k..4k+3) takes its fifth bits from qh byte k / 2, bits 4(k % 2) + j. */
    __m512i spread[4];
    for (int i = 0; i < 4; i++) spread[i] = dword_bytes(i, i, i, i);
    const __m512i bit_lo = _mm512_set1_epi32(0x08040201), bit_hi = _mm512_set1_epi32((int)0x80402010);
    const __m512i sixteen = _mm512_set1_epi8(16);
    for (int64_t b = 0; b < n_in / QK8_0; b++) {
        prefetch(s, packed, b, n_in / QK8_0, sizeof(block_q5_0));
        const int64_t off = b * (int64_t)sizeof(block_q5_0);
        __m512i p[4], q[8], qh;
        __m512 dw;
        groups(s, packed, off + 6, 4, p);
        split_nibbles(p, q);
        if (packed) {
            qh = _mm512_loadu_si512(s->tile + TILE * (off + 2)); /* qh of every row */
            dw = halves(s, packed, off);
        } else { /* d | qh[0..1], qh[2..3] | qs[0..1], ...: a transposition beats gathers */
            __m512i hd[4];
            transpose_16B(s, off, hd);
            qh = _mm512_or_si512(_mm512_srli_epi32(hd[0], 16), _mm512_slli_epi32(hd[1], 16));
            dw = fp16_lo(hd[0]);
        }
        for (int k = 0; k < 8; k++) {
            const __m512i bytes = _mm512_shuffle_epi8(qh, spread[k / 2]);
            const __mmask64 set = _mm512_test_epi8_mask(bytes, k % 2 ? bit_hi : bit_lo);
            q[k] = _mm512_mask_add_epi8(q[k], set, q[k], sixteen);
        }
        for (int t = 0; t < n_tok; t++) {
            const lever_q8_0x *a = (const lever_q8_0x *)(x + t * x_stride) + b;
            const __m512i isum = dot_groups(q, 8, a->qs, _mm512_set1_epi32(-16 * a->sum));
            acc_update(acc[t], isum, dw, a->d);
        }
    }
    acc_store(acc, n_tok, s, y, ldy);
}

/* ---- 256-weight super-blocks against Q8_K activations ---------------------------------- */

static inline __attribute__((always_inline)) void q4_K_body(const tile_src *s, int packed, int64_t n_in,
                                                            const uint8_t *x, int64_t x_stride, int n_tok,
                                                            float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(64)));
    int32_t isum[LEVER_TOK_TILE][ROWS] __attribute__((aligned(64)));
    acc_zero(acc, n_tok, y, ldy);
    __m512i byte_sel[4], pair_sel[4];
    for (int i = 0; i < 4; i++) {
        byte_sel[i] = dword_bytes(i, -1, -1, -1); /* byte i as an int32 */
        pair_sel[i] = dword_bytes(i, -1, i, -1);  /* byte i in both int16 halves */
    }
    const __m512i m4 = _mm512_set1_epi8(0x0f), m6 = _mm512_set1_epi8(0x3f), m2 = _mm512_set1_epi8(0x03);
    for (int64_t b = 0; b < n_in / QK_K; b++) {
        prefetch(s, packed, b, n_in / QK_K, sizeof(block_q4_K));
        const int64_t off = b * (int64_t)sizeof(block_q4_K);
        /* f[0] = d | dmin, f[1..3] = the 12 scale bytes; unpack as q4_K_scale_min does,
         * four sub-blocks per dword. */
        __m512i f[4];
        groups(s, packed, off, 4, f);
        const __m512 dw = fp16_lo(f[0]), dmin = fp16_lo(_mm512_srli_epi32(f[0], 16));
        const __m512i sc03 = _mm512_and_si512(f[1], m6), m03 = _mm512_and_si512(f[2], m6);
        const __m512i top1 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(f[1], 6), m2), 4);
        const __m512i top2 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(f[2], 6), m2), 4);
        const __m512i sc47 = _mm512_or_si512(_mm512_and_si512(f[3], m4), top1);
        const __m512i m47 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(f[3], 4), m4), top2);
        __m512i sc[8], mins[8];
        for (int j = 0; j < 8; j++) {
            sc[j] = _mm512_shuffle_epi8(j < 4 ? sc03 : sc47, byte_sel[j % 4]);
            mins[j] = _mm512_shuffle_epi8(j < 4 ? m03 : m47, pair_sel[j % 4]);
        }
        /* chunk c: 32 bytes, low nibbles = sub-block 2c, high nibbles = sub-block 2c + 1 */
        for (int c = 0; c < 4; c++) {
            __m512i lo[8], hi[8];
            groups(s, packed, off + 16 + 32 * c, 8, lo);
            for (int k = 0; k < 8; k++) {
                hi[k] = _mm512_and_si512(_mm512_srli_epi16(lo[k], 4), m4);
                lo[k] = _mm512_and_si512(lo[k], m4);
            }
            for (int t = 0; t < n_tok; t++) {
                const block_q8_K *a = (const block_q8_K *)(x + t * x_stride) + b;
                const __m512i z = _mm512_setzero_si512();
                const __m512i s_lo = dot_groups(lo, 8, a->qs + 64 * c, z);
                const __m512i s_hi = dot_groups(hi, 8, a->qs + 64 * c + 32, z);
                __m512i v = _mm512_add_epi32(_mm512_mullo_epi32(s_lo, sc[2 * c]),
                                             _mm512_mullo_epi32(s_hi, sc[2 * c + 1]));
                if (c) v = _mm512_add_epi32(v, _mm512_load_si512(isum[t]));
                _mm512_store_si512(isum[t], v);
            }
        }
        for (int t = 0; t < n_tok; t++) {
            const block_q8_K *a = (const block_q8_K *)(x + t * x_stride) + b;
            /* msum = sum_j min_j * (bsums[2j] + bsums[2j + 1]) */
            __m512i ms0 = _mm512_setzero_si512(), ms1 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {
                ms0 = _mm512_dpwssd_epi32(ms0, mins[j], bcast4(a->bsums + 2 * j));
                ms1 = _mm512_dpwssd_epi32(ms1, mins[j + 1], bcast4(a->bsums + 2 * j + 2));
            }
            const __m512i msum = _mm512_add_epi32(ms0, ms1);
            const __m512 dx = _mm512_set1_ps(a->d);
            __m512 r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(isum[t])), _mm512_mul_ps(dw, dx),
                                       _mm512_load_ps(acc[t]));
            r = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, dx), r);
            _mm512_store_ps(acc[t], r);
        }
    }
    acc_store(acc, n_tok, s, y, ldy);
}

/* Q6_K 6-bit values of one 32-byte ql run (part 0: ql[0..31], 1: ql[32..63] of a half)
 * with its qh bits: low nibbles give group `part`, high nibbles group part + 2, and group
 * g takes qh bits 2g, 2g + 1. */
static inline void q6_K_values(const __m512i ql[8], const __m512i qh[8], int part, __m512i lo[8],
                               __m512i hi[8]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    for (int k = 0; k < 8; k++) {
        const __m512i h_lo = part ? _mm512_slli_epi16(qh[k], 2) : _mm512_slli_epi16(qh[k], 4);
        const __m512i h_hi = part ? _mm512_srli_epi16(qh[k], 2) : qh[k];
        lo[k] = _mm512_or_si512(_mm512_and_si512(ql[k], m4), _mm512_and_si512(h_lo, m30));
        hi[k] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql[k], 4), m4), _mm512_and_si512(h_hi, m30));
    }
}

static inline __attribute__((always_inline)) void q6_K_body(const tile_src *s, int packed, int64_t n_in,
                                                            const uint8_t *x, int64_t x_stride, int n_tok,
                                                            float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(64)));
    int32_t isum[LEVER_TOK_TILE][ROWS] __attribute__((aligned(64)));
    acc_zero(acc, n_tok, y, ldy);
    __m512i pair_sel[2];
    for (int i = 0; i < 2; i++) pair_sel[i] = dword_bytes(-1, 2 * i, -1, 2 * i + 1);
    for (int64_t b = 0; b < n_in / QK_K; b++) {
        prefetch(s, packed, b, n_in / QK_K, sizeof(block_q6_K));
        const int64_t off = b * (int64_t)sizeof(block_q6_K);
        __m512i sv[4], sc[16], sc_pairs[8];
        groups(s, packed, off + 192, 4, sv);
        for (int j = 0; j < 16; j++) sc[j] = _mm512_srai_epi32(_mm512_slli_epi32(sv[j / 4], 24 - 8 * (j % 4)), 24);
        for (int i = 0; i < 8; i++) sc_pairs[i] = _mm512_srai_epi16(_mm512_shuffle_epi8(sv[i / 2], pair_sel[i % 2]), 8);
        const __m512 dw = halves(s, packed, off + 208);
        for (int h = 0; h < 2; h++) {
            __m512i qh[8];
            groups(s, packed, off + 128 + 32 * h, 8, qh);
            for (int part = 0; part < 2; part++) {
                __m512i ql[8], lo[8], hi[8];
                groups(s, packed, off + 64 * h + 32 * part, 8, ql);
                q6_K_values(ql, qh, part, lo, hi);
                const int j_lo = 8 * h + 2 * part, j_hi = j_lo + 4; /* 16-element sub-blocks */
                for (int t = 0; t < n_tok; t++) {
                    const block_q8_K *a = (const block_q8_K *)(x + t * x_stride) + b;
                    const int8_t *aq = a->qs + 128 * h + 32 * part;
                    const __m512i z = _mm512_setzero_si512();
                    __m512i v = _mm512_mullo_epi32(dot_groups(lo, 4, aq, z), sc[j_lo]);
                    v = _mm512_add_epi32(v, _mm512_mullo_epi32(dot_groups(lo + 4, 4, aq + 16, z), sc[j_lo + 1]));
                    v = _mm512_add_epi32(v, _mm512_mullo_epi32(dot_groups(hi, 4, aq + 64, z), sc[j_hi]));
                    v = _mm512_add_epi32(v, _mm512_mullo_epi32(dot_groups(hi + 4, 4, aq + 80, z), sc[j_hi + 1]));
                    if (h | part) v = _mm512_add_epi32(v, _mm512_load_si512(isum[t]));
                    _mm512_store_si512(isum[t], v);
                }
            }
        }
        for (int t = 0; t < n_tok; t++) {
            const block_q8_K *a = (const block_q8_K *)(x + t * x_stride) + b;
            /* the values are q - 32: take 32 * sum_j scale_j * bsums[j] back out */
            __m512i c0 = _mm512_setzero_si512(), c1 = _mm512_setzero_si512();
            for (int i = 0; i < 8; i += 2) {
                c0 = _mm512_dpwssd_epi32(c0, sc_pairs[i], bcast4(a->bsums + 2 * i));
                c1 = _mm512_dpwssd_epi32(c1, sc_pairs[i + 1], bcast4(a->bsums + 2 * i + 2));
            }
            const __m512i corr = _mm512_slli_epi32(_mm512_add_epi32(c0, c1), 5);
            const __m512i is = _mm512_sub_epi32(_mm512_load_si512(isum[t]), corr);
            acc_update(acc[t], is, dw, a->d);
        }
    }
    acc_store(acc, n_tok, s, y, ldy);
}

/* ---- the kernels: each body once per layout -------------------------------------------- */

#define KERNELS(name, call)                                                                                    \
    static void tile_##name##_avx512(const uint8_t *w, int64_t w_stride, int n_rows, int64_t n_in,            \
                                     const uint8_t *x, int64_t x_stride, int n_tok, float *y, int64_t ldy) {   \
        tile_src s;                                                                                            \
        src_rows(&s, w, w_stride, n_rows);                                                                     \
        call(&s, 0, n_in, x, x_stride, n_tok, y, ldy);                                                         \
    }                                                                                                          \
    static void packed_##name##_avx512(const uint8_t *tile, int sub, int n_rows, int64_t n_in,                \
                                       const uint8_t *x, int64_t x_stride, int n_tok, float *y, int64_t ldy) { \
        tile_src s;                                                                                            \
        src_tile(&s, tile, n_rows);                                                                            \
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

const lever_kernel_set lever_kernels_avx512 = {
    .rows = ROWS,
    .quantize_q8_0x = quantize_q8_0x_avx512,
    .quantize_q8_K = quantize_q8_K_avx512,
    .tile = LEVER_KERNEL_TABLE(tile, avx512),
    .packed = LEVER_KERNEL_TABLE(packed, avx512),
};
