/* ops_avx2.c: AVX2/FMA/F16C inner loops of rmsnorm, swiglu and attention (see ops.c).
 *
 * The same algorithms as ops_avx512.c on 8 lanes. Tails use masked loads and stores rather
 * than a scalar loop, so an element or row gets the same arithmetic wherever it sits in the
 * array (batch invariance, lever_kernels.h).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lever_kernels.h"

/* Prototypes repeated from ops.c (no shared internal header): keep them in step. */
void lever_ops_attn_heads_avx2(const float *q, float *out, int64_t nh, int64_t hd, const void *k,
                               const void *v, int kv_type, int64_t kv_stride, const int32_t *rows,
                               int64_t m, float scale, float *scratch);
void lever_ops_rmsnorm_avx2(const float *x, const float *w, int64_t n_rows, int64_t n, float eps,
                            float *out);
void lever_ops_swiglu_avx2(const float *gate, const float *up, int64_t n, float *out);

#define LANES 8
#define INLINE static inline __attribute__((always_inline))

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Lanes [0, n) of an 8-lane vector as a maskload/maskstore mask, n clamped to 8. */
INLINE __m256i tail_mask(int64_t n) {
    const int32_t k = n >= LANES ? LANES : (int32_t)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* e^x for x <= 88; same reduction and polynomial as exp_ps in ops_avx512.c (see there). */
INLINE __m256 exp_ps(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(lo, x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i pow2n = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(e, _mm256_castsi256_ps(pow2n)));
}

INLINE float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---- rmsnorm ---------------------------------------------------------------------------- */

/* Squares in float, summed in double (as ggml) over 4+4 lanes, tail zero-filled. */
static float rms_scale(const float *x, int64_t n, float eps) {
    __m256d acc_lo = _mm256_setzero_pd(), acc_hi = _mm256_setzero_pd();
    for (int64_t i = 0; i < n; i += LANES) {
        const __m256 xv = _mm256_maskload_ps(x + i, tail_mask(n - i));
        const __m256 sq = _mm256_mul_ps(xv, xv);
        acc_lo = _mm256_add_pd(acc_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(sq)));
        acc_hi = _mm256_add_pd(acc_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(sq, 1)));
    }
    const __m256d a = _mm256_add_pd(acc_lo, acc_hi);
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
    const float mean = (float)(_mm_cvtsd_f64(s) / (double)n);
    return 1.0f / sqrtf(mean + eps);
}

void lever_ops_rmsnorm_avx2(const float *x, const float *w, int64_t n_rows, int64_t n, float eps,
                            float *out) {
    for (int64_t r = 0; r < n_rows; r++) {
        const float *xr = x + r * n;
        float *yr = out + r * n;
        const __m256 scale = _mm256_set1_ps(rms_scale(xr, n, eps));
        for (int64_t i = 0; i < n; i += LANES) {
            const __m256i mk = tail_mask(n - i);
            const __m256 xv = _mm256_maskload_ps(xr + i, mk);
            const __m256 wv = _mm256_maskload_ps(w + i, mk);
            /* (x * scale) * w, the scalar order, so this part matches every ISA exactly */
            _mm256_maskstore_ps(yr + i, mk, _mm256_mul_ps(_mm256_mul_ps(xv, scale), wv));
        }
    }
}

/* ---- swiglu ----------------------------------------------------------------------------- */

/* silu(g) = g * sigmoid(g), with sigmoid from t = e^-|g| (never overflows):
 * g >= 0: 1 / (1 + t);  g < 0: t / (1 + t). */
void lever_ops_swiglu_avx2(const float *gate, const float *up, int64_t n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < n; i += LANES) {
        const __m256i mk = tail_mask(n - i);
        const __m256 g = _mm256_maskload_ps(gate + i, mk);
        const __m256 u = _mm256_maskload_ps(up + i, mk);
        const __m256 t = exp_ps(_mm256_or_ps(g, sign)); /* -|g| */
        const __m256 num = _mm256_blendv_ps(one, t, _mm256_cmp_ps(g, zero, _CMP_LT_OQ));
        const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, t));
        _mm256_maskstore_ps(out + i, mk, _mm256_mul_ps(_mm256_mul_ps(g, sig), u));
    }
}

/* ---- attention -------------------------------------------------------------------------- */

/* Rows are processed in blocks of RB consecutive entries of the visible-row list. */
#define RB 8

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
                _mm256_store_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d))));
            rp[r] = dst;
        }
    } else {
        for (int64_t r = 0; r < nr; r++) {
            const int64_t off = (int64_t)rows[r] * stride;
            float *dst = buf + r * hdp;
            for (int64_t d = 0; d < hdp; d += LANES) {
                __m256 f;
                if (kv_type == LEVER_F16) { /* F16C has no masked load: zero-fill a copy */
                    uint16_t tmp[LANES] = {0};
                    const int64_t n = hd - d < LANES ? hd - d : LANES;
                    memcpy(tmp, (const uint16_t *)base + off + d, (size_t)n * sizeof(uint16_t));
                    f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tmp));
                } else {
                    f = _mm256_maskload_ps((const float *)base + off + d, tail_mask(hd - d));
                }
                _mm256_store_ps(dst + d, f);
            }
            rp[r] = dst;
        }
    }
    for (int64_t r = nr; r < RB; r++) rp[r] = rp[0];
}

/* Horizontal sums of 8 vectors at once: lane r of the result is the sum of a[r]'s lanes.
 * A transpose-and-add tree; every lane goes through the same tree, ((x0+x2)+(x1+x3)) in
 * each 128-bit half and then L0+L1, so a sum does not depend on the lane it lands in. */
INLINE __m256 hsum8(const __m256 a[8]) {
    __m256 s[4], u[2];
    for (int i = 0; i < 4; i++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        s[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++) { /* per 128-bit lane: the lane's sums of 4 vectors */
        const __m256d x = _mm256_castps_pd(s[2 * i]), y = _mm256_castps_pd(s[2 * i + 1]);
        u[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20),
                         _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

/* A score is the same arithmetic in both kernels below: q . row over 8-lane chunks in d
 * order (one FMA chain per lane), then the hsum8 tree, then times scale. */

/* One head, 8 rows: s[0..nr) = scale * (q . row r). */
static void scores_1x8(const float *qh, const float *const *rp, int64_t hdp, int64_t nr,
                       float scale, float *s) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hdp; d += LANES) {
        const __m256 qv = _mm256_loadu_ps(qh + d);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rp[r] + d), acc[r]);
    }
    _mm256_maskstore_ps(s, tail_mask(nr), _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
}

/* Two heads, 4 rows: each row chunk is loaded once for both heads. */
static void scores_2x4(const float *qa, const float *qb, const float *const *rp, int64_t hdp,
                       int64_t nr, float scale, float *sa, float *sb) {
    __m256 acc[8]; /* acc[r]: head a, acc[4 + r]: head b */
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hdp; d += LANES) {
        const __m256 qav = _mm256_loadu_ps(qa + d), qbv = _mm256_loadu_ps(qb + d);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const __m256 kv = _mm256_loadu_ps(rp[r] + d);
            acc[r] = _mm256_fmadd_ps(qav, kv, acc[r]);
            acc[4 + r] = _mm256_fmadd_ps(qbv, kv, acc[4 + r]);
        }
    }
    const __m256 sc = _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale));
    const __m128i mk = _mm256_castsi256_si128(tail_mask(nr));
    _mm_maskstore_ps(sa, mk, _mm256_castps256_ps128(sc));
    _mm_maskstore_ps(sb, mk, _mm256_extractf128_ps(sc, 1));
}

/* Scores of all nh heads over one staged block of nr <= 8 rows. */
static void block_scores(const float *qs, int64_t nh, const float *const *rp, int64_t hdp,
                         int64_t nr, float scale, float *s, int64_t ms) {
    int64_t h = 0;
    for (; h + 2 <= nh; h += 2) {
        const float *qa = qs + h * hdp, *qb = qa + hdp;
        float *sa = s + h * ms, *sb = sa + ms;
        scores_2x4(qa, qb, rp, hdp, nr < 4 ? nr : 4, scale, sa, sb);
        if (nr > 4) scores_2x4(qa, qb, rp + 4, hdp, nr - 4, scale, sa + 4, sb + 4);
    }
    if (h < nh) scores_1x8(qs + h * hdp, rp, hdp, nr, scale, s + h * ms);
}

/* For NH (1 or 2) heads: acc[h][0..NC*8) += sum over the block's rows r of p[h][r] * row r,
 * in row order, one FMA per row per accumulator. NC and NH are compile-time constants after
 * inlining, so the accumulators live in registers; with two heads each V chunk is loaded
 * once for both. A head's arithmetic is the same whether it runs alone or paired. */
INLINE void wsum_block(int NH, int NC, float *acc, int64_t acc_stride, const float *p,
                       int64_t p_stride, const float *const *rp, int64_t off, int64_t nr) {
    __m256 a[2][8];
    for (int h = 0; h < NH; h++)
#pragma GCC unroll 8
        for (int c = 0; c < NC; c++) a[h][c] = _mm256_load_ps(acc + h * acc_stride + off + c * LANES);
    for (int64_t r = 0; r < nr; r++) {
        __m256 pr[2];
        for (int h = 0; h < NH; h++) pr[h] = _mm256_broadcast_ss(p + h * p_stride + r);
        const float *row = rp[r] + off;
#pragma GCC unroll 8
        for (int c = 0; c < NC; c++) {
            const __m256 vv = _mm256_loadu_ps(row + c * LANES);
            for (int h = 0; h < NH; h++) a[h][c] = _mm256_fmadd_ps(pr[h], vv, a[h][c]);
        }
    }
    for (int h = 0; h < NH; h++)
#pragma GCC unroll 8
        for (int c = 0; c < NC; c++) _mm256_store_ps(acc + h * acc_stride + off + c * LANES, a[h][c]);
}

/* Weighted V sums of nh1 (1 or 2) heads over one block: groups of up to 8 vectors for one
 * head, 4 for two (16 registers). */
static void heads_weighted_sum(int nh1, float *acc, const float *p, int64_t ms,
                               const float *const *rp, int64_t hdp, int64_t nr) {
    const int64_t group = nh1 == 2 ? 4 : 8;
    for (int64_t off = 0; off < hdp; off += group * LANES) {
        const int64_t nc = (hdp - off) / LANES < group ? (hdp - off) / LANES : group;
        if (nh1 == 2) {
            switch (nc) {
            case 1: wsum_block(2, 1, acc, hdp, p, ms, rp, off, nr); break;
            case 2: wsum_block(2, 2, acc, hdp, p, ms, rp, off, nr); break;
            case 3: wsum_block(2, 3, acc, hdp, p, ms, rp, off, nr); break;
            default: wsum_block(2, 4, acc, hdp, p, ms, rp, off, nr); break;
            }
        } else {
            switch (nc) {
            case 1: wsum_block(1, 1, acc, hdp, p, ms, rp, off, nr); break;
            case 2: wsum_block(1, 2, acc, hdp, p, ms, rp, off, nr); break;
            case 3: wsum_block(1, 3, acc, hdp, p, ms, rp, off, nr); break;
            case 4: wsum_block(1, 4, acc, hdp, p, ms, rp, off, nr); break;
            case 5: wsum_block(1, 5, acc, hdp, p, ms, rp, off, nr); break;
            case 6: wsum_block(1, 6, acc, hdp, p, ms, rp, off, nr); break;
            case 7: wsum_block(1, 7, acc, hdp, p, ms, rp, off, nr); break;
            default: wsum_block(1, 8, acc, hdp, p, ms, rp, off, nr); break;
            }
        }
    }
}

/* Scores of one head -> softmax weights in place; returns the sum of the weights.
 * Max is exact in any order; the sum runs over 8 lanes in list order, then a fixed tree. */
static float softmax_weights(float *s, int64_t m) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 mx = ninf;
    for (int64_t i = 0; i < m; i += LANES) {
        const __m256i mk = tail_mask(m - i);
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_maskload_ps(s + i, mk), _mm256_castsi256_ps(mk)));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const __m256 mxv = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < m; i += LANES) {
        const __m256i mk = tail_mask(m - i);
        const __m256 p = _mm256_and_ps(_mm256_castsi256_ps(mk),
                                       exp_ps(_mm256_sub_ps(_mm256_maskload_ps(s + i, mk), mxv)));
        sum = _mm256_add_ps(sum, p);
        _mm256_maskstore_ps(s + i, mk, p);
    }
    return hsum_ps(sum);
}

void lever_ops_attn_heads_avx2(const float *q, float *out, int64_t nh, int64_t hd, const void *k,
                               const void *v, int kv_type, int64_t kv_stride, const int32_t *rows,
                               int64_t m, float scale, float *scratch) {
    /* Same scratch layout as ops_avx512.c, rounded to 16 floats, so it fits ops.c's size. */
    const int64_t hdp = round_up(hd, LANES), ms = round_up(m, 16), hdr = round_up(hd, 16);
    float *s = scratch;           /* nh x ms scores, then weights */
    float *buf = s + nh * ms;     /* RB x hdp staged K or V rows */
    float *acc = buf + 16 * hdr;  /* nh x hdp weighted sums */
    float *qp = acc + nh * hdr;   /* nh x hdp zero-padded queries */
    float *wsum = qp + nh * hdr;  /* nh sums of softmax weights */
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
        const __m256 sum = _mm256_set1_ps(wsum[h]);
        for (int64_t d = 0; d < hd; d += LANES)
            _mm256_maskstore_ps(out + h * hd + d, tail_mask(hd - d),
                                _mm256_div_ps(_mm256_load_ps(acc + h * hdp + d), sum));
    }
}
