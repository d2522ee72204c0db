/* ops_avx512.c: AVX-512 inner loops of rmsnorm, swiglu and attention (see ops.c).
 *
 * Tails use masked loads and stores rather than a scalar loop, so an element or row gets the
 * same arithmetic wherever it sits in the array (batch invariance, lever_kernels.h).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lever_kernels.h"

/* Prototypes repeated from ops.c (no shared internal header): keep them in step. */
void lever_ops_attn_heads_avx512(const float *q, float *out, int64_t nh, int64_t hd,
                                 const void *k, const void *v, int kv_type, int64_t kv_stride,
                                 const int32_t *rows, int64_t m, float scale, float *scratch);
void lever_ops_rmsnorm_avx512(const float *x, const float *w, int64_t n_rows, int64_t n,
                              float eps, float *out);
void lever_ops_swiglu_avx512(const float *gate, const float *up, int64_t n, float *out);

#define LANES 16
#define INLINE static inline __attribute__((always_inline))

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Lanes [0, n) of a 16-lane vector, n clamped to 16. */
INLINE __mmask16 tail_mask(int64_t n) {
    return n >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}

/* e^x, a few ulp, for x <= 88 (larger x is clamped). Cody-Waite reduction x = n ln2 + r,
 * |r| <= ln2/2, e^r by the Cephes expf polynomial, 2^n built in the exponent field. Below
 * -87.3 the result would be subnormal; it is flushed to 0 (the callers only add it to
 * terms >= 1 or multiply by it). NaN propagates. */
INLINE __m512 exp_ps(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.33654f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(lo, x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    const __m512i pow2n = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_mul_ps(e, _mm512_castsi512_ps(pow2n)));
}

/* ---- rmsnorm ---------------------------------------------------------------------------- */

/* Squares in float, summed in double (as ggml) over 8+8 lanes, tail zero-filled. */
static float rms_scale(const float *x, int64_t n, float eps) {
    __m512d acc_lo = _mm512_setzero_pd(), acc_hi = _mm512_setzero_pd();
    for (int64_t i = 0; i < n; i += LANES) {
        const __m512 xv = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
        const __m512 sq = _mm512_mul_ps(xv, xv);
        acc_lo = _mm512_add_pd(acc_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(sq)));
        acc_hi = _mm512_add_pd(acc_hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps(sq, 1)));
    }
    const double sum = _mm512_reduce_add_pd(_mm512_add_pd(acc_lo, acc_hi));
    const float mean = (float)(sum / (double)n);
    return 1.0f / sqrtf(mean + eps);
}

void lever_ops_rmsnorm_avx512(const float *x, const float *w, int64_t n_rows, int64_t n,
                              float eps, float *out) {
    for (int64_t r = 0; r < n_rows; r++) {
        const float *xr = x + r * n;
        float *yr = out + r * n;
        const __m512 scale = _mm512_set1_ps(rms_scale(xr, n, eps));
        for (int64_t i = 0; i < n; i += LANES) {
            const __mmask16 mk = tail_mask(n - i);
            const __m512 xv = _mm512_maskz_loadu_ps(mk, xr + i);
            const __m512 wv = _mm512_maskz_loadu_ps(mk, w + i);
            /* (x * scale) * w, the scalar order, so this part matches every ISA exactly */
            _mm512_mask_storeu_ps(yr + i, mk, _mm512_mul_ps(_mm512_mul_ps(xv, scale), wv));
        }
    }
}

/* ---- swiglu ----------------------------------------------------------------------------- */

/* silu(g) = g * sigmoid(g), with sigmoid from t = e^-|g| (never overflows):
 * g >= 0: 1 / (1 + t);  g < 0: t / (1 + t). */
void lever_ops_swiglu_avx512(const float *gate, const float *up, int64_t n, float *out) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += LANES) {
        const __mmask16 mk = tail_mask(n - i);
        const __m512 g = _mm512_maskz_loadu_ps(mk, gate + i);
        const __m512 u = _mm512_maskz_loadu_ps(mk, up + i);
        const __m512 t = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
        const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 num = _mm512_mask_mov_ps(one, neg, t);
        const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(one, t));
        _mm512_mask_storeu_ps(out + i, mk, _mm512_mul_ps(_mm512_mul_ps(g, sig), u));
    }
}

/* ---- attention -------------------------------------------------------------------------- */

/* Rows are processed in blocks of RB consecutive entries of the visible-row list. */
#define RB 16

/* Points rp[0..RB) at RB rows of one kv head as floats, zero-padded to hdp. f32 rows whose
 * length is a whole number of vectors are used in place; others are staged in buf (f16 to
 * f32 is exact, so staging changes no value). Slots past nr repeat row 0 so the score loops
 * can run full blocks (their lanes are dropped). */
static void stage_rows(const void *base, int kv_type, int64_t stride, const int32_t *rows,
                       int64_t nr, int64_t hd, int64_t hdp, float *buf, const float **rp) {
    if (kv_type == LEVER_F32 && hd == hdp) {
        for (int64_t r = 0; r < nr; r++) rp[r] = (const float *)base + (int64_t)rows[r] * stride;
    } else if (kv_type == LEVER_F16 && hd == hdp) { /* the common case: whole vectors */
        for (int64_t r = 0; r < nr; r++) {
            const uint16_t *src = (const uint16_t *)base + (int64_t)rows[r] * stride;
            float *dst = buf + r * hdp;
            for (int64_t d = 0; d < hdp; d += LANES)
                _mm512_store_ps(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + d))));
            rp[r] = dst;
        }
    } else {
        for (int64_t r = 0; r < nr; r++) {
            const int64_t off = (int64_t)rows[r] * stride;
            float *dst = buf + r * hdp;
            for (int64_t d = 0; d < hdp; d += LANES) {
                const __mmask16 mk = tail_mask(hd - d);
                const __m512 f = kv_type == LEVER_F16
                    ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, (const uint16_t *)base + off + d))
                    : _mm512_maskz_loadu_ps(mk, (const float *)base + off + d);
                _mm512_store_ps(dst + d, f);
            }
            rp[r] = dst;
        }
    }
    for (int64_t r = nr; r < RB; r++) rp[r] = rp[0];
}

/* Horizontal sums of 16 vectors at once: lane r of the result is the sum of a[r]'s lanes.
 * A transpose-and-add tree, ~3 shuffles+adds per vector instead of ~8 for separate
 * reductions. Every lane goes through the same tree, ((x0+x2)+(x1+x3)) within each 128-bit
 * lane and then (L0+L1)+(L2+L3), so a sum does not depend on the lane it lands in. */
INLINE __m512 hsum16(const __m512 a[16]) {
    __m512 s[8], u[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: the lane's sums of 4 vectors */
        const __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* fold the four 128-bit lanes: pairs (0,1) and (2,3), then the two halves */
    const __m512 p01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 p23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(p01, p23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(p01, p23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* A score is the same arithmetic in both kernels below: q . row over 16-lane chunks in d
 * order (one FMA chain per lane), then the hsum16 tree, then times scale. Which kernel, and
 * which lane, computes it changes nothing. */

/* One head, 16 rows: s[0..nr) = scale * (q . row r). */
static void scores_1x16(const float *qh, const float *const *rp, int64_t hdp, int64_t nr,
                        float scale, float *s) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hdp; d += LANES) {
        const __m512 qv = _mm512_loadu_ps(qh + d);
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) acc[r] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rp[r] + d), acc[r]);
    }
    _mm512_mask_storeu_ps(s, tail_mask(nr), _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale)));
}

/* Two heads, 8 rows: each row chunk is loaded once for both heads, halving the loads. */
static void scores_2x8(const float *qa, const float *qb, const float *const *rp, int64_t hdp,
                       int64_t nr, float scale, float *sa, float *sb) {
    __m512 acc[16]; /* acc[r]: head a, acc[8 + r]: head b */
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hdp; d += LANES) {
        const __m512 qav = _mm512_loadu_ps(qa + d), qbv = _mm512_loadu_ps(qb + d);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            const __m512 kv = _mm512_loadu_ps(rp[r] + d);
            acc[r] = _mm512_fmadd_ps(qav, kv, acc[r]);
            acc[8 + r] = _mm512_fmadd_ps(qbv, kv, acc[8 + r]);
        }
    }
    const __m512 sc = _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale));
    const __mmask8 mk = (__mmask8)tail_mask(nr);
    _mm256_mask_storeu_ps(sa, mk, _mm512_castps512_ps256(sc));
    _mm256_mask_storeu_ps(sb, mk, _mm512_extractf32x8_ps(sc, 1));
}

/* Scores of all nh heads over one staged block of nr <= 16 rows. */
static void block_scores(const float *qs, int64_t nh, const float *const *rp, int64_t hdp,
                         int64_t nr, float scale, float *s, int64_t ms) {
    int64_t h = 0;
    for (; h + 2 <= nh; h += 2) {
        const float *qa = qs + h * hdp, *qb = qa + hdp;
        float *sa = s + h * ms, *sb = sa + ms;
        scores_2x8(qa, qb, rp, hdp, nr < 8 ? nr : 8, scale, sa, sb);
        if (nr > 8) scores_2x8(qa, qb, rp + 8, hdp, nr - 8, scale, sa + 8, sb + 8);
    }
    if (h < nh) scores_1x16(qs + h * hdp, rp, hdp, nr, scale, s + h * ms);
}

/* For NH (1 or 2) heads: acc[h][0..NC*16) += sum over the block's rows r of p[h][r] * row r,
 * in row order, one FMA per row per accumulator. NC and NH are compile-time constants after
 * inlining, so the accumulators live in registers; with two heads each V chunk is loaded
 * once for both and there are twice as many independent FMA chains. A head's arithmetic is
 * the same whether it runs alone or paired. */
INLINE void wsum_block(int NH, int NC, float *acc, int64_t acc_stride, const float *p,
                       int64_t p_stride, const float *const *rp, int64_t off, int64_t nr) {
    __m512 a[2][8];
    for (int h = 0; h < NH; h++)
#pragma GCC unroll 8
        for (int c = 0; c < NC; c++) a[h][c] = _mm512_load_ps(acc + h * acc_stride + off + c * LANES);
    for (int64_t r = 0; r < nr; r++) {
        __m512 pr[2];
        for (int h = 0; h < NH; h++) pr[h] = _mm512_set1_ps(p[h * p_stride + r]);
        const float *row = rp[r] + off;
#pragma GCC unroll 8
        for (int c = 0; c < NC; c++) {
            const __m512 vv = _mm512_loadu_ps(row + c * LANES);
            for (int h = 0; h < NH; h++) a[h][c] = _mm512_fmadd_ps(pr[h], vv, a[h][c]);
        }
    }
    for (int h = 0; h < NH; h++)
#pragma GCC unroll 8
        for (int c = 0; c < NC; c++) _mm512_store_ps(acc + h * acc_stride + off + c * LANES, a[h][c]);
}

#define WSUM_CASES(NH)                                                          \
    switch (nc) {                                                               \
    case 1: wsum_block(NH, 1, acc, hdp, p, ms, rp, off, nr); break;             \
    case 2: wsum_block(NH, 2, acc, hdp, p, ms, rp, off, nr); break;             \
    case 3: wsum_block(NH, 3, acc, hdp, p, ms, rp, off, nr); break;             \
    case 4: wsum_block(NH, 4, acc, hdp, p, ms, rp, off, nr); break;             \
    case 5: wsum_block(NH, 5, acc, hdp, p, ms, rp, off, nr); break;             \
    case 6: wsum_block(NH, 6, acc, hdp, p, ms, rp, off, nr); break;             \
    case 7: wsum_block(NH, 7, acc, hdp, p, ms, rp, off, nr); break;             \
    default: wsum_block(NH, 8, acc, hdp, p, ms, rp, off, nr); break;            \
    }

/* Weighted V sums of nh1 (1 or 2) heads over one block, in groups of up to 8 vectors. */
static void heads_weighted_sum(int nh1, float *acc, const float *p, int64_t ms,
                               const float *const *rp, int64_t hdp, int64_t nr) {
    for (int64_t off = 0; off < hdp; off += 8 * LANES) {
        const int64_t nc = (hdp - off) / LANES < 8 ? (hdp - off) / LANES : 8;
        if (nh1 == 2) {
            WSUM_CASES(2)
        } else {
            WSUM_CASES(1)
        }
    }
}

/* Scores of one head -> softmax weights in place; returns the sum of the weights.
 * Max is exact in any order; the sum runs over 16 lanes in list order, then a fixed tree. */
static float softmax_weights(float *s, int64_t m) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < m; i += LANES)
        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(m - i), s + i));
    const __m512 mxv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < m; i += LANES) {
        const __mmask16 mk = tail_mask(m - i);
        const __m512 p = _mm512_maskz_mov_ps(mk, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + i), mxv)));
        sum = _mm512_add_ps(sum, p);
        _mm512_mask_storeu_ps(s + i, mk, p);
    }
    return _mm512_reduce_add_ps(sum);
}

void lever_ops_attn_heads_avx512(const float *q, float *out, int64_t nh, int64_t hd,
                                 const void *k, const void *v, int kv_type, int64_t kv_stride,
                                 const int32_t *rows, int64_t m, float scale, float *scratch) {
    const int64_t hdp = round_up(hd, LANES), ms = round_up(m, LANES);
    /* scratch layout, each part a multiple of 16 floats (64 bytes) */
    float *s = scratch;          /* nh x ms scores, then weights */
    float *buf = s + nh * ms;    /* RB x hdp staged K or V rows */
    float *acc = buf + RB * hdp; /* nh x hdp weighted sums */
    float *qp = acc + nh * hdp;  /* nh x hdp zero-padded queries */
    float *wsum = qp + nh * hdp; /* nh sums of softmax weights */
    const float *rp[RB];

    const float *qs = q;
    if (hd != hdp) { /* pad so the dot products run over whole vectors */
        memset(qp, 0, (size_t)(nh * hdp) * sizeof(float));
        for (int64_t h = 0; h < nh; h++) memcpy(qp + h * hdp, q + h * hd, (size_t)hd * sizeof(float));
        qs = qp;
    }

    /* pass 1: scores, each K row staged once for all nh heads */
    for (int64_t i0 = 0; i0 < m; i0 += RB) {
        const int64_t nr = m - i0 < RB ? m - i0 : RB;
        stage_rows(k, kv_type, kv_stride, rows + i0, nr, hd, hdp, buf, rp);
        block_scores(qs, nh, rp, hdp, nr, scale, s + i0, ms);
    }

    for (int64_t h = 0; h < nh; h++) wsum[h] = softmax_weights(s + h * ms, m);

    /* pass 2: weighted sum of V rows, each V row staged once for all nh heads */
    memset(acc, 0, (size_t)(nh * hdp) * sizeof(float));
    for (int64_t i0 = 0; i0 < m; i0 += RB) {
        const int64_t nr = m - i0 < RB ? m - i0 : RB;
        stage_rows(v, kv_type, kv_stride, rows + i0, nr, hd, hdp, buf, rp);
        for (int64_t h = 0; h < nh; h += 2)
            heads_weighted_sum(nh - h >= 2 ? 2 : 1, acc + h * hdp, s + h * ms + i0, ms, rp, hdp, nr);
    }

    for (int64_t h = 0; h < nh; h++) {
        const __m512 sum = _mm512_set1_ps(wsum[h]);
        for (int64_t d = 0; d < hd; d += LANES)
            _mm512_mask_storeu_ps(out + h * hd + d, tail_mask(hd - d),
                                  _mm512_div_ps(_mm512_load_ps(acc + h * hdp + d), sum));
    }
}
