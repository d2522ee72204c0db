/* matmul_avx2.c: the tile kernels for AVX2 + FMA + F16C, 8 rows per tile.
 *
 * Same layout as matmul_avx512.c: one 32-bit lane per weight row, weights transposed once
 * per block so that register k holds bytes 4k..4k+3 of every row, activations broadcast.
 * Without VNNI, a 4-byte dot is vpmaddubsw (u8 x s8 -> pairs of int16) then vpmaddwd by 1.
 * vpmaddubsw saturates at 32767: weights below 64 (Q4, Q5, Q6 values) stay far below it,
 * even two groups added in int16; Q8_0 weights use |w| and move the sign to the activation
 * instead of an offset. Integer sums are exact and the float steps canonical, so results
 * equal the scalar kernels bit for bit.
 */
#include <immintrin.h>

#include "quants_internal.h"

#define ROWS 8
#define TILE LEVER_TILE_ROWS /* a packed tile is two slices of ROWS rows */

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
    __m256i mask; /* all ones in lanes that are real rows */
} tile_src;

static inline void set_mask(tile_src *s, int n_rows) {
    int32_t mask[ROWS];
    for (int i = 0; i < ROWS; i++) mask[i] = i < n_rows ? -1 : 0;
    s->mask = _mm256_loadu_si256((const __m256i *)mask);
}

static inline void src_rows(tile_src *s, const uint8_t *w, int64_t stride, int n_rows) {
    for (int i = 0; i < ROWS; i++) s->p[i] = w + (i < n_rows ? i : n_rows - 1) * stride;
    s->tile = NULL;
    s->next = w + ROWS * stride;
    s->next_bytes = ROWS * stride;
    set_mask(s, n_rows);
}

static inline void src_tile(tile_src *s, const uint8_t *tile, int sub, int n_rows) {
    s->tile = tile;
    s->sub = sub;
    set_mask(s, n_rows);
}

/* ---- loads and transpositions --------------------------------------------------------- */

static inline __m256i bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

static inline int u16_at(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* The fp16 at byte `off` of each row, as float (inserts beat a gather here). */
static inline __m256 fp16_rows(const tile_src *tr, int64_t off) {
    __m128i h = _mm_cvtsi32_si128(u16_at(tr->p[0] + off));
    h = _mm_insert_epi16(h, u16_at(tr->p[1] + off), 1);
    h = _mm_insert_epi16(h, u16_at(tr->p[2] + off), 2);
    h = _mm_insert_epi16(h, u16_at(tr->p[3] + off), 3);
    h = _mm_insert_epi16(h, u16_at(tr->p[4] + off), 4);
    h = _mm_insert_epi16(h, u16_at(tr->p[5] + off), 5);
    h = _mm_insert_epi16(h, u16_at(tr->p[6] + off), 6);
    h = _mm_insert_epi16(h, u16_at(tr->p[7] + off), 7);
    return _mm256_cvtph_ps(h);
}

/* fp16 in the low half of each dword, as float. */
static inline __m256 fp16_lo(__m256i v) {
    const __m256i h = _mm256_and_si256(v, _mm256_set1_epi32(0xffff));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

/* In place: r[i] lane k becomes r[k] lane i (8x8 of 32-bit elements). */
static inline void transpose_8x8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 2; g++) {
        u[4 * g + 0] = _mm256_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm256_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm256_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm256_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
        r[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    }
}

/* The 32 bytes at `off` of each row: lane i of out[k] = bytes 4k..4k+3 of row i. */
static inline void transpose_32B(const tile_src *tr, int64_t off, __m256i out[8]) {
    for (int i = 0; i < ROWS; i++) out[i] = _mm256_loadu_si256((const __m256i *)(tr->p[i] + off));
    transpose_8x8(out);
}

/* The 16 bytes at `off` of each row: 128-bit lane c of r[q] holds row 4c + q, so 4x4
 * transposes inside lanes leave out[k] in row order. */
static inline void transpose_16B(const tile_src *tr, int64_t off, __m256i out[4]) {
    __m256i r[4];
    for (int q = 0; q < 4; q++)
        r[q] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(tr->p[q] + off))),
                                       _mm_loadu_si128((const __m128i *)(tr->p[q + 4] + off)), 1);
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    out[0] = _mm256_unpacklo_epi64(t0, t2);
    out[1] = _mm256_unpackhi_epi64(t0, t2);
    out[2] = _mm256_unpacklo_epi64(t1, t3);
    out[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* n (4 or 8) groups of four bytes from byte `off` of every row: lane i of out[k] = bytes
 * off + 4k .. off + 4k + 3 of row i. In the tile layout they are already there. */
static inline __attribute__((always_inline)) void groups(const tile_src *s, int packed, int64_t off, int n,
                                                         __m256i *out) {
    if (packed) {
        const uint8_t *p = s->tile + TILE * off + 4 * ROWS * s->sub;
        for (int k = 0; k < n; k++) out[k] = _mm256_loadu_si256((const __m256i *)(p + 64 * k));
    } else if (n == 8) {
        transpose_32B(s, off, out);
    } else {
        transpose_16B(s, off, out);
    }
}

/* The fp16 at byte `off` of every row, as float. */
static inline __attribute__((always_inline)) __m256 halves(const tile_src *s, int packed, int64_t off) {
    if (packed) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s->tile + TILE * off + 2 * ROWS * s->sub)));
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

/* vpshufb control that fills byte k of every dword with byte src[k] of the same dword
 * (src[k] < 0: zero). */
static inline __m256i dword_bytes(int b0, int b1, int b2, int b3) {
    const int src[4] = {b0, b1, b2, b3};
    int32_t v[8];
    for (int i = 0; i < 8; i++) {
        uint32_t x = 0;
        for (int k = 0; k < 4; k++) x |= (uint32_t)(src[k] < 0 ? 0x80 : 4 * (i % 4) + src[k]) << (8 * k);
        v[i] = (int32_t)x;
    }
    return _mm256_loadu_si256((const __m256i *)v);
}

/* ---- activation quantization: the scalar quantizers, 8 values at a time ---------------- */

static inline __m256 abs_ps(__m256 v) {
    return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
}

static inline float hmax_ps(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* 32 int32 (each in -127..127) as 32 int8 in order: the packs work within 128-bit lanes,
 * so a final dword permutation restores the order. */
static inline void store_int8x32(int8_t *out, __m256i q0, __m256i q1, __m256i q2, __m256i q3) {
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* roundf of float lanes as int32: truncate, then step away from zero when the (exact)
 * remainder is at least one half. */
static inline __m256i round_half_away(__m256 v) {
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 rest = _mm256_sub_ps(v, t), one = _mm256_set1_ps(1.0f);
    const __m256 up = _mm256_and_ps(_mm256_cmp_ps(rest, _mm256_set1_ps(0.5f), _CMP_GE_OQ), one);
    const __m256 down = _mm256_and_ps(_mm256_cmp_ps(rest, _mm256_set1_ps(-0.5f), _CMP_LE_OQ), one);
    return _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(t, up), down));
}

static void quantize_q8_0x_avx2(const float *x, lever_q8_0x *y, int64_t n) {
    for (int64_t b = 0; b < n / QK8_0; b++, x += QK8_0, y++) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + 8 * i);
            m = _mm256_max_ps(m, abs_ps(v[i]));
        }
        const float d = hmax_ps(m) / 127.0f;
        const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = round_half_away(_mm256_mul_ps(v[i], id));
        store_int8x32(y->qs, q[0], q[1], q[2], q[3]);
        y->sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
        y->d = lever_fp16_to_fp32(lever_fp32_to_fp16(d));
    }
}

static void quantize_q8_K_avx2(const float *x, block_q8_K *y, int64_t n) {
    for (int64_t b = 0; b < n / QK_K; b++, x += QK_K, y++) {
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < 32; i++) m = _mm256_max_ps(m, abs_ps(_mm256_loadu_ps(x + 8 * i)));
        const float amax = hmax_ps(m);
        if (amax == 0.0f) {
            memset(y, 0, sizeof(*y));
            continue;
        }
        float max = 0.0f; /* the first value of largest magnitude sets the sign */
        for (int i = 0; i < 32; i++) {
            const int at = _mm256_movemask_ps(_mm256_cmp_ps(abs_ps(_mm256_loadu_ps(x + 8 * i)), _mm256_set1_ps(amax), _CMP_EQ_OQ));
            if (at) {
                max = x[8 * i + __builtin_ctz((unsigned)at)];
                break;
            }
        }
        const float iscale = -127.0f / max;
        const __m256 scale = _mm256_set1_ps(iscale);
        const __m256i cap = _mm256_set1_epi32(127);
        for (int i = 0; i < 8; i++) { /* 32 values: two bsums */
            __m256i q[4];
            for (int k = 0; k < 4; k++) /* rounded to nearest even */
                q[k] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(scale, _mm256_loadu_ps(x + 32 * i + 8 * k))), cap);
            store_int8x32(y->qs + 32 * i, q[0], q[1], q[2], q[3]);
            y->bsums[2 * i] = (int16_t)hsum_epi32(_mm256_add_epi32(q[0], q[1]));
            y->bsums[2 * i + 1] = (int16_t)hsum_epi32(_mm256_add_epi32(q[2], q[3]));
        }
        y->d = 1.0f / iscale;
    }
}

/* ---- per-token accumulation ------------------------------------------------------------ */

/* init + sum over k < n of q[k] (u8 < 64 per row) . activation bytes a[4k..4k+3] (s8).
 * Two groups share one vpmaddwd: 2 * 2 * 63 * 127 < 32767. */
static inline __m256i dot_groups(const __m256i *q, int n, const int8_t *a, __m256i init) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = init;
    for (int k = 0; k < n; k += 2) {
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(q[k], bcast4(a + 4 * k)),
                                           _mm256_maddubs_epi16(q[k + 1], bcast4(a + 4 * k + 4)));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
    }
    return s;
}

/* Q8_0 weights span -128..127: |w| times the activation with w's sign, one group per
 * vpmaddwd (2 * 128 * 127 < 32767). */
static inline __m256i dot_groups_signed(const __m256i *q, const __m256i *q_abs, const int8_t *a) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) {
        const __m256i p = _mm256_maddubs_epi16(q_abs[k], _mm256_sign_epi8(bcast4(a + 4 * k), q[k]));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
    }
    return s;
}

/* acc = fma((float)isum, dw * dx, acc): the canonical per-block float step. */
static inline void acc_update(float *acc, __m256i isum, __m256 dw, float dx) {
    const __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(dx));
    _mm256_store_ps(acc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, _mm256_load_ps(acc)));
}

/* Zeroes the accumulators and asks for the output lines now: written at the end of the
 * tile, one line per token, they would otherwise each wait for memory (y can be 19 MB). */
static inline void acc_zero(float (*acc)[ROWS], int n_tok, float *y, int64_t ldy) {
    for (int t = 0; t < n_tok; t++) {
        _mm256_store_ps(acc[t], _mm256_setzero_ps());
        __builtin_prefetch(y + t * ldy, 1, 3);
    }
}

static inline void acc_store(float (*acc)[ROWS], int n_tok, const tile_src *tr, float *y, int64_t ldy) {
    for (int t = 0; t < n_tok; t++) _mm256_maskstore_ps(y + t * ldy, tr->mask, _mm256_load_ps(acc[t]));
}

/* ---- float weights --------------------------------------------------------------------- */

/* Float types, element k of row r: row layout at row + k * size, tile layout at
 * tile + TILE * size * k + size * r (a block is one element). */
enum { F32, F16, BF16 };

/* Up to 8 weights of a row from k0, as floats (kn < 8: the rest zero, nothing read past). */
static inline __m256 load_row(int kind, const uint8_t *row, int64_t k0, int kn) {
    const size_t size = kind == F32 ? 4 : 2;
    uint8_t tmp[32] = {0};
    const uint8_t *p = row + size * k0;
    if (kn < 8) {
        memcpy(tmp, p, size * (size_t)kn);
        p = tmp;
    }
    if (kind == F32) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (kind == F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Element k of the slice's ROWS rows of a packed tile. */
static inline __m256 load_tiled(int kind, const tile_src *s, int64_t k) {
    if (kind == F32) return _mm256_loadu_ps((const float *)s->tile + TILE * k + ROWS * s->sub);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)s->tile + TILE * k + ROWS * s->sub));
    if (kind == F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Weights k0..k0+kn-1 of all rows against every token: acc = fma(w[k], x[k], acc) in k
 * order. Called with kn = 8 for whole chunks, so the loop unrolls and w stays in registers. */
static inline __attribute__((always_inline)) void float_chunk(const tile_src *s, int packed, int kind,
                                                              int64_t k0, int kn, const uint8_t *x,
                                                              int64_t x_stride, int n_tok,
                                                              float (*acc)[ROWS]) {
    __m256 w[8];
    if (packed) {
        for (int k = 0; k < kn; k++) w[k] = load_tiled(kind, s, k0 + k);
    } else {
        for (int i = 0; i < ROWS; i++) w[i] = load_row(kind, s->p[i], k0, kn);
        transpose_8x8((__m256i *)w);
    }
    for (int t = 0; t < n_tok; t++) {
        const float *xt = (const float *)(x + t * x_stride) + k0;
        __m256 a = _mm256_load_ps(acc[t]);
        for (int k = 0; k < kn; k++) a = _mm256_fmadd_ps(w[k], _mm256_set1_ps(xt[k]), a);
        _mm256_store_ps(acc[t], a);
    }
}

static inline __attribute__((always_inline)) void float_body(const tile_src *s, int packed, int kind,
                                                             int64_t n_in, const uint8_t *x, int64_t x_stride,
                                                             int n_tok, float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(32)));
    acc_zero(acc, n_tok, y, ldy);
    const int64_t n_chunks = (n_in + 7) / 8;
    for (int64_t c = 0; c < n_chunks; c++) {
        prefetch(s, packed, c, n_chunks, 8 * (kind == F32 ? 4 : 2));
        const int64_t k0 = 8 * c;
        if (k0 + 8 <= n_in)
            float_chunk(s, packed, kind, k0, 8, x, x_stride, n_tok, acc);
        else
            float_chunk(s, packed, kind, k0, (int)(n_in - k0), x, x_stride, n_tok, acc);
    }
    acc_store(acc, n_tok, s, y, ldy);
}

/* ---- 32-weight blocks against Q8_0 activations ---------------------------------------- */

static inline __attribute__((always_inline)) void q8_0_body(const tile_src *s, int packed, int64_t n_in,
                                                           const uint8_t *x, int64_t x_stride, int n_tok,
                                                           float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(32)));
    acc_zero(acc, n_tok, y, ldy);
    for (int64_t b = 0; b < n_in / QK8_0; b++) {
        prefetch(s, packed, b, n_in / QK8_0, sizeof(block_q8_0));
        const int64_t off = b * (int64_t)sizeof(block_q8_0);
        __m256i q[8], q_abs[8];
        groups(s, packed, off + 2, 8, q);
        for (int k = 0; k < 8; k++) q_abs[k] = _mm256_abs_epi8(q[k]);
        const __m256 dw = halves(s, packed, off);
        for (int t = 0; t < n_tok; t++) {
            const lever_q8_0x *a = (const lever_q8_0x *)(x + t * x_stride) + b;
            acc_update(acc[t], dot_groups_signed(q, q_abs, a->qs), dw, a->d);
        }
    }
    acc_store(acc, n_tok, s, y, ldy);
}

/* Q4_0 and Q5_0: groups 0..3 are low nibbles, 4..7 high nibbles of the same 16 bytes. */
static inline void split_nibbles(const __m256i p[4], __m256i q[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int k = 0; k < 4; k++) {
        q[k] = _mm256_and_si256(p[k], m4);
        q[k + 4] = _mm256_and_si256(_mm256_srli_epi16(p[k], 4), m4);
    }
}

static inline __attribute__((always_inline)) void q4_0_body(const tile_src *s, int packed, int64_t n_in,
                                                           const uint8_t *x, int64_t x_stride, int n_tok,
                                                           float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(32)));
    acc_zero(acc, n_tok, y, ldy);
    for (int64_t b = 0; b < n_in / QK8_0; b++) {
        prefetch(s, packed, b, n_in / QK8_0, sizeof(block_q4_0));
        const int64_t off = b * (int64_t)sizeof(block_q4_0);
        __m256i p[4], q[8];
        groups(s, packed, off + 2, 4, p);
        split_nibbles(p, q);
        const __m256 dw = halves(s, packed, off);
        for (int t = 0; t < n_tok; t++) {
            const lever_q8_0x *a = (const lever_q8_0x *)(x + t * x_stride) + b;
            acc_update(acc[t], dot_groups(q, 8, a->qs, _mm256_set1_epi32(-8 * a->sum)), dw, a->d);
        }
    }
    acc_store(acc, n_tok, s, y, ldy);
}

static inline __attribute__((always_inline)) void q5_0_body(const tile_src *s, int packed, int64_t n_in,
                                                           const uint8_t *x, int64_t x_stride, int n_tok,
                                                           float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(32)));
    acc_zero(acc, n_tok, y, ldy);
    /* Group k (elements 4k..4k+3) takes its fifth bits from qh byte k / 2, bits 4(k % 2) + j. */
    __m256i spread[4];
    for (int i = 0; i < 4; i++) spread[i] = dword_bytes(i, i, i, i);
    const __m256i bit_lo = _mm256_set1_epi32(0x08040201), bit_hi = _mm256_set1_epi32((int)0x80402010);
    const __m256i sixteen = _mm256_set1_epi8(16);
    for (int64_t b = 0; b < n_in / QK8_0; b++) {
        prefetch(s, packed, b, n_in / QK8_0, sizeof(block_q5_0));
        const int64_t off = b * (int64_t)sizeof(block_q5_0);
        __m256i p[4], q[8];
        groups(s, packed, off + 6, 4, p);
        split_nibbles(p, q);
        __m256i qh;
        __m256 dw;
        if (packed) {
            qh = _mm256_loadu_si256((const __m256i *)(s->tile + TILE * (off + 2) + 4 * ROWS * s->sub));
            dw = halves(s, packed, off);
        } else { /* d | qh[0..1], qh[2..3] | qs[0..1], ... */
            __m256i hd[4];
            transpose_16B(s, off, hd);
            qh = _mm256_or_si256(_mm256_srli_epi32(hd[0], 16), _mm256_slli_epi32(hd[1], 16));
            dw = fp16_lo(hd[0]);
        }
        for (int k = 0; k < 8; k++) {
            const __m256i bit = k % 2 ? bit_hi : bit_lo;
            const __m256i bytes = _mm256_and_si256(_mm256_shuffle_epi8(qh, spread[k / 2]), bit);
            q[k] = _mm256_or_si256(q[k], _mm256_and_si256(_mm256_cmpeq_epi8(bytes, bit), sixteen));
        }
        for (int t = 0; t < n_tok; t++) {
            const lever_q8_0x *a = (const lever_q8_0x *)(x + t * x_stride) + b;
            acc_update(acc[t], dot_groups(q, 8, a->qs, _mm256_set1_epi32(-16 * a->sum)), dw, a->d);
        }
    }
    acc_store(acc, n_tok, s, y, ldy);
}

/* ---- 256-weight super-blocks against Q8_K activations ---------------------------------- */

static inline __attribute__((always_inline)) void q4_K_body(const tile_src *s, int packed, int64_t n_in,
                                                           const uint8_t *x, int64_t x_stride, int n_tok,
                                                           float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(32)));
    int32_t isum[LEVER_TOK_TILE][ROWS] __attribute__((aligned(32)));
    acc_zero(acc, n_tok, y, ldy);
    __m256i byte_sel[4], pair_sel[4];
    for (int i = 0; i < 4; i++) {
        byte_sel[i] = dword_bytes(i, -1, -1, -1);
        pair_sel[i] = dword_bytes(i, -1, i, -1);
    }
    const __m256i m4 = _mm256_set1_epi8(0x0f), m6 = _mm256_set1_epi8(0x3f), m2 = _mm256_set1_epi8(0x03);
    for (int64_t b = 0; b < n_in / QK_K; b++) {
        prefetch(s, packed, b, n_in / QK_K, sizeof(block_q4_K));
        const int64_t off = b * (int64_t)sizeof(block_q4_K);
        /* f[0] = d | dmin, f[1..3] = the 12 scale bytes, unpacked as q4_K_scale_min */
        __m256i f[4];
        groups(s, packed, off, 4, f);
        const __m256 dw = fp16_lo(f[0]), dmin = fp16_lo(_mm256_srli_epi32(f[0], 16));
        const __m256i sc03 = _mm256_and_si256(f[1], m6), m03 = _mm256_and_si256(f[2], m6);
        const __m256i top1 = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(f[1], 6), m2), 4);
        const __m256i top2 = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(f[2], 6), m2), 4);
        const __m256i sc47 = _mm256_or_si256(_mm256_and_si256(f[3], m4), top1);
        const __m256i m47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(f[3], 4), m4), top2);
        __m256i sc[8], mins[8];
        for (int j = 0; j < 8; j++) {
            sc[j] = _mm256_shuffle_epi8(j < 4 ? sc03 : sc47, byte_sel[j % 4]);
            mins[j] = _mm256_shuffle_epi8(j < 4 ? m03 : m47, pair_sel[j % 4]);
        }
        for (int c = 0; c < 4; c++) {
            __m256i lo[8], hi[8];
            groups(s, packed, off + 16 + 32 * c, 8, lo);
            for (int k = 0; k < 8; k++) {
                hi[k] = _mm256_and_si256(_mm256_srli_epi16(lo[k], 4), m4);
                lo[k] = _mm256_and_si256(lo[k], m4);
            }
            for (int t = 0; t < n_tok; t++) {
                const block_q8_K *a = (const block_q8_K *)(x + t * x_stride) + b;
                const __m256i z = _mm256_setzero_si256();
                const __m256i s_lo = dot_groups(lo, 8, a->qs + 64 * c, z);
                const __m256i s_hi = dot_groups(hi, 8, a->qs + 64 * c + 32, z);
                __m256i v = _mm256_add_epi32(_mm256_mullo_epi32(s_lo, sc[2 * c]),
                                             _mm256_mullo_epi32(s_hi, sc[2 * c + 1]));
                if (c) v = _mm256_add_epi32(v, _mm256_load_si256((const __m256i *)isum[t]));
                _mm256_store_si256((__m256i *)isum[t], v);
            }
        }
        for (int t = 0; t < n_tok; t++) {
            const block_q8_K *a = (const block_q8_K *)(x + t * x_stride) + b;
            /* msum = sum_j min_j * (bsums[2j] + bsums[2j + 1]) */
            __m256i msum = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins[j], bcast4(a->bsums + 2 * j)));
            const __m256 dx = _mm256_set1_ps(a->d);
            __m256 r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)isum[t])),
                                       _mm256_mul_ps(dw, dx), _mm256_load_ps(acc[t]));
            r = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, dx), r);
            _mm256_store_ps(acc[t], r);
        }
    }
    acc_store(acc, n_tok, s, y, ldy);
}

/* Q6_K 6-bit values of one 32-byte ql run (part 0: ql[0..31], 1: ql[32..63] of a half)
 * with its qh bits: low nibbles give group `part`, high nibbles group part + 2, and group
 * g takes qh bits 2g, 2g + 1. */
static inline void q6_K_values(const __m256i ql[8], const __m256i qh[8], int part, __m256i lo[8],
                               __m256i hi[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    for (int k = 0; k < 8; k++) {
        const __m256i h_lo = part ? _mm256_slli_epi16(qh[k], 2) : _mm256_slli_epi16(qh[k], 4);
        const __m256i h_hi = part ? _mm256_srli_epi16(qh[k], 2) : qh[k];
        lo[k] = _mm256_or_si256(_mm256_and_si256(ql[k], m4), _mm256_and_si256(h_lo, m30));
        hi[k] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql[k], 4), m4), _mm256_and_si256(h_hi, m30));
    }
}

static inline __attribute__((always_inline)) void q6_K_body(const tile_src *s, int packed, int64_t n_in,
                                                           const uint8_t *x, int64_t x_stride, int n_tok,
                                                           float *y, int64_t ldy) {
    float acc[LEVER_TOK_TILE][ROWS] __attribute__((aligned(32)));
    int32_t isum[LEVER_TOK_TILE][ROWS] __attribute__((aligned(32)));
    acc_zero(acc, n_tok, y, ldy);
    __m256i pair_sel[2];
    for (int i = 0; i < 2; i++) pair_sel[i] = dword_bytes(-1, 2 * i, -1, 2 * i + 1);
    for (int64_t b = 0; b < n_in / QK_K; b++) {
        prefetch(s, packed, b, n_in / QK_K, sizeof(block_q6_K));
        const int64_t off = b * (int64_t)sizeof(block_q6_K);
        __m256i sv[4], sc[16], sc_pairs[8];
        groups(s, packed, off + 192, 4, sv);
        for (int j = 0; j < 16; j++) sc[j] = _mm256_srai_epi32(_mm256_slli_epi32(sv[j / 4], 24 - 8 * (j % 4)), 24);
        for (int i = 0; i < 8; i++) sc_pairs[i] = _mm256_srai_epi16(_mm256_shuffle_epi8(sv[i / 2], pair_sel[i % 2]), 8);
        const __m256 dw = halves(s, packed, off + 208);
        for (int h = 0; h < 2; h++) {
            __m256i qh[8];
            groups(s, packed, off + 128 + 32 * h, 8, qh);
            for (int part = 0; part < 2; part++) {
                __m256i ql[8], lo[8], hi[8];
                groups(s, packed, off + 64 * h + 32 * part, 8, ql);
                q6_K_values(ql, qh, part, lo, hi);
                const int j_lo = 8 * h + 2 * part, j_hi = j_lo + 4;
                for (int t = 0; t < n_tok; t++) {
                    const block_q8_K *a = (const block_q8_K *)(x + t * x_stride) + b;
                    const int8_t *aq = a->qs + 128 * h + 32 * part;
                    const __m256i z = _mm256_setzero_si256();
                    __m256i v = _mm256_mullo_epi32(dot_groups(lo, 4, aq, z), sc[j_lo]);
                    v = _mm256_add_epi32(v, _mm256_mullo_epi32(dot_groups(lo + 4, 4, aq + 16, z), sc[j_lo + 1]));
                    v = _mm256_add_epi32(v, _mm256_mullo_epi32(dot_groups(hi, 4, aq + 64, z), sc[j_hi]));
                    v = _mm256_add_epi32(v, _mm256_mullo_epi32(dot_groups(hi + 4, 4, aq + 80, z), sc[j_hi + 1]));
                    if (h | part) v = _mm256_add_epi32(v, _mm256_load_si256((const __m256i *)isum[t]));
                    _mm256_store_si256((__m256i *)isum[t], v);
                }
            }
        }
        for (int t = 0; t < n_tok; t++) {
            const block_q8_K *a = (const block_q8_K *)(x + t * x_stride) + b;
            /* the values are q - 32: take 32 * sum_j scale_j * bsums[j] back out */
            __m256i corr = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) corr = _mm256_add_epi32(corr, _mm256_madd_epi16(sc_pairs[i], bcast4(a->bsums + 2 * i)));
            const __m256i is = _mm256_sub_epi32(_mm256_load_si256((const __m256i *)isum[t]), _mm256_slli_epi32(corr, 5));
            acc_update(acc[t], is, dw, a->d);
        }
    }
    acc_store(acc, n_tok, s, y, ldy);
}

/* ---- the kernels: each body once per layout -------------------------------------------- */

#define KERNELS(name, call)                                                                                    \
    static void tile_##name##_avx2(const uint8_t *w, int64_t w_stride, int n_rows, int64_t n_in,              \
                                   const uint8_t *x, int64_t x_stride, int n_tok, float *y, int64_t ldy) {     \
        tile_src s;                                                                                            \
        src_rows(&s, w, w_stride, n_rows);                                                                     \
        call(&s, 0, n_in, x, x_stride, n_tok, y, ldy);                                                         \
    }                                                                                                          \
    static void packed_##name##_avx2(const uint8_t *tile, int sub, int n_rows, int64_t n_in,                  \
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

const lever_kernel_set lever_kernels_avx2 = {
    .rows = ROWS,
    .quantize_q8_0x = quantize_q8_0x_avx2,
    .quantize_q8_K = quantize_q8_K_avx2,
    .tile = LEVER_KERNEL_TABLE(tile, avx2),
    .packed = LEVER_KERNEL_TABLE(packed, avx2),
};
