/* ops_neon.c: arm64 NEON inner loops of rmsnorm, swiglu and attention (see ops.c).
 *
 * The algorithms of ops_avx512.c on 4 lanes. NEON has no masked loads, so tails are copied
 * into a zeroed vector and results copied back: the arithmetic is the same as for a full
 * vector, so an element or row gets the same result wherever it sits in the array (batch
 * invariance, lever_kernels.h). Uses only base ARMv8 NEON (f16 -> f32 conversion included).
 */
#include <arm_neon.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lever_kernels.h"

/* Prototypes repeated from ops.c (no shared internal header): keep them in step. */
void lever_ops_attn_heads_neon(const float *q, float *out, int64_t nh, int64_t hd, const void *k,
                               const void *v, int kv_type, int64_t kv_stride, const int32_t *rows,
                               int64_t m, float scale, float *scratch);
void lever_ops_rmsnorm_neon(const float *x, const float *w, int64_t n_rows, int64_t n, float eps,
                            float *out);
void lever_ops_swiglu_neon(const float *gate, const float *up, int64_t n, float *out);

#define LANES 4
#define INLINE static inline __attribute__((always_inline))

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Lanes [0, n) of p, the rest zero (n < 4 only at tails). */
INLINE float32x4_t load_tail(const float *p, int64_t n) {
    if (n >= LANES) return vld1q_f32(p);
    float tmp[LANES] = {0};
    memcpy(tmp, p, (size_t)n * sizeof(float));
    return vld1q_f32(tmp);
}

INLINE void store_tail(float *p, float32x4_t v, int64_t n) {
    if (n >= LANES) {
        vst1q_f32(p, v);
        return;
    }
    float tmp[LANES];
    vst1q_f32(tmp, v);
    memcpy(p, tmp, (size_t)n * sizeof(float));
}

/* e^x for x <= 88; same reduction and polynomial as exp_ps in ops_avx512.c (see there). */
INLINE float32x4_t exp_ps(float32x4_t x) {
    const float32x4_t lo = vdupq_n_f32(-87.33654f);
    const uint32x4_t tiny = vcltq_f32(x, lo);
    x = vminq_f32(vdupq_n_f32(88.0f), vmaxq_f32(lo, x));
    const float32x4_t n = vrndnq_f32(vmulq_n_f32(x, 1.44269504088896341f));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    const float32x4_t e = vaddq_f32(vfmaq_f32(r, p, vmulq_f32(r, r)), vdupq_n_f32(1.0f));
    const int32x4_t pow2n = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    const float32x4_t y = vmulq_f32(e, vreinterpretq_f32_s32(pow2n));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(y), tiny));
}

/* ---- rmsnorm ---------------------------------------------------------------------------- */

/* Squares in float, summed in double (as ggml) over 2+2 lanes, tail zero-filled. */
static float rms_scale(const float *x, int64_t n, float eps) {
    float64x2_t acc_lo = vdupq_n_f64(0.0), acc_hi = vdupq_n_f64(0.0);
    for (int64_t i = 0; i < n; i += LANES) {
        const float32x4_t xv = load_tail(x + i, n - i);
        const float32x4_t sq = vmulq_f32(xv, xv);
        acc_lo = vaddq_f64(acc_lo, vcvt_f64_f32(vget_low_f32(sq)));
        acc_hi = vaddq_f64(acc_hi, vcvt_high_f64_f32(sq));
    }
    const double sum = vaddvq_f64(vaddq_f64(acc_lo, acc_hi));
    const float mean = (float)(sum / (double)n);
    return 1.0f / sqrtf(mean + eps);
}

void lever_ops_rmsnorm_neon(const float *x, const float *w, int64_t n_rows, int64_t n, float eps,
                            float *out) {
    for (int64_t r = 0; r < n_rows; r++) {
        const float *xr = x + r * n;
        float *yr = out + r * n;
        const float32x4_t scale = vdupq_n_f32(rms_scale(xr, n, eps));
        for (int64_t i = 0; i < n; i += LANES) {
            const float32x4_t xv = load_tail(xr + i, n - i), wv = load_tail(w + i, n - i);
            /* (x * scale) * w, the scalar order, so this part matches every ISA exactly */
            store_tail(yr + i, vmulq_f32(vmulq_f32(xv, scale), wv), n - i);
        }
    }
}

/* ---- swiglu ----------------------------------------------------------------------------- */

/* silu(g) = g * sigmoid(g), with sigmoid from t = e^-|g| (never overflows):
 * g >= 0: 1 / (1 + t);  g < 0: t / (1 + t). */
void lever_ops_swiglu_neon(const float *gate, const float *up, int64_t n, float *out) {
    const float32x4_t one = vdupq_n_f32(1.0f);
    for (int64_t i = 0; i < n; i += LANES) {
        const float32x4_t g = load_tail(gate + i, n - i), u = load_tail(up + i, n - i);
        const float32x4_t t = exp_ps(vnegq_f32(vabsq_f32(g)));
        const float32x4_t num = vbslq_f32(vcltzq_f32(g), t, one);
        const float32x4_t sig = vdivq_f32(num, vaddq_f32(one, t));
        store_tail(out + i, vmulq_f32(vmulq_f32(g, sig), u), n - i);
    }
}

/* ---- attention -------------------------------------------------------------------------- */

/* Rows are processed in blocks of RB consecutive entries of the visible-row list. */
#define RB 8

/* Points rp[0..RB) at RB rows of one kv head as floats, zero-padded to hdp. f32 rows whose
 * length is a whole number of vectors are used in place; others are staged in buf. Slots
 * past nr repeat row 0 so the score loop can run full blocks (their lanes are dropped). */
static void stage_rows(const void *base, int kv_type, int64_t stride, const int32_t *rows,
                       int64_t nr, int64_t hd, int64_t hdp, float *buf, const float **rp) {
    for (int64_t r = 0; r < nr; r++) {
        const int64_t off = (int64_t)rows[r] * stride;
        if (kv_type == LEVER_F32 && hd == hdp) {
            rp[r] = (const float *)base + off;
            continue;
        }
        float *dst = buf + r * hdp;
        for (int64_t d = 0; d < hdp; d += LANES) {
            float32x4_t f;
            if (kv_type == LEVER_F16) {
                const uint16_t *src = (const uint16_t *)base + off + d;
                uint16_t tmp[LANES] = {0};
                if (hd - d < LANES) { /* tail: zero-fill, then the same conversion */
                    memcpy(tmp, src, (size_t)(hd - d) * sizeof(uint16_t));
                    src = tmp;
                }
                f = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(src)));
            } else {
                f = load_tail((const float *)base + off + d, hd - d);
            }
            vst1q_f32(dst + d, f);
        }
        rp[r] = dst;
    }
    for (int64_t r = nr; r < RB; r++) rp[r] = rp[0];
}

/* Sums of four vectors at once: lane r is the sum of a[r]'s lanes, by the same tree
 * ((x0+x1)+(x2+x3)) in every lane. */
INLINE float32x4_t hsum4(float32x4_t a0, float32x4_t a1, float32x4_t a2, float32x4_t a3) {
    return vpaddq_f32(vpaddq_f32(a0, a1), vpaddq_f32(a2, a3));
}

/* A score is the same arithmetic in both kernels below: q . row over 4-lane chunks in d
 * order (one FMA chain per lane), then the hsum4 tree, then times scale. */

/* One head, 8 rows: s[0..nr) = scale * (q . row r). */
static void scores_1x8(const float *qh, const float *const *rp, int64_t hdp, int64_t nr,
                       float scale, float *s) {
    float32x4_t acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) acc[r] = vdupq_n_f32(0.0f);
    for (int64_t d = 0; d < hdp; d += LANES) {
        const float32x4_t qv = vld1q_f32(qh + d);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) acc[r] = vfmaq_f32(acc[r], qv, vld1q_f32(rp[r] + d));
    }
    float res[8];
    vst1q_f32(res, vmulq_n_f32(hsum4(acc[0], acc[1], acc[2], acc[3]), scale));
    vst1q_f32(res + 4, vmulq_n_f32(hsum4(acc[4], acc[5], acc[6], acc[7]), scale));
    memcpy(s, res, (size_t)nr * sizeof(float));
}

/* Two heads, 4 rows: each row chunk is loaded once for both heads. */
static void scores_2x4(const float *qa, const float *qb, const float *const *rp, int64_t hdp,
                       int64_t nr, float scale, float *sa, float *sb) {
    float32x4_t acc[8]; /* acc[r]: head a, acc[4 + r]: head b */
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) acc[r] = vdupq_n_f32(0.0f);
    for (int64_t d = 0; d < hdp; d += LANES) {
        const float32x4_t qav = vld1q_f32(qa + d), qbv = vld1q_f32(qb + d);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const float32x4_t kv = vld1q_f32(rp[r] + d);
            acc[r] = vfmaq_f32(acc[r], qav, kv);
            acc[4 + r] = vfmaq_f32(acc[4 + r], qbv, kv);
        }
    }
    float res[8];
    vst1q_f32(res, vmulq_n_f32(hsum4(acc[0], acc[1], acc[2], acc[3]), scale));
    vst1q_f32(res + 4, vmulq_n_f32(hsum4(acc[4], acc[5], acc[6], acc[7]), scale));
    memcpy(sa, res, (size_t)nr * sizeof(float));
    memcpy(sb, res + 4, (size_t)nr * sizeof(float));
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

/* For NH (1 or 2) heads: acc[h][0..NC*4) += sum over the block's rows r of p[h][r] * row r,
 * in row order, one FMA per row per accumulator. NC and NH are compile-time constants after
 * inlining, so the accumulators live in registers; with two heads each V chunk is loaded
 * once for both. A head's arithmetic is the same whether it runs alone or paired. */
INLINE void wsum_block(int NH, int NC, float *acc, int64_t acc_stride, const float *p,
                       int64_t p_stride, const float *const *rp, int64_t off, int64_t nr) {
    float32x4_t a[2][16];
    for (int h = 0; h < NH; h++)
#pragma GCC unroll 16
        for (int c = 0; c < NC; c++) a[h][c] = vld1q_f32(acc + h * acc_stride + off + c * LANES);
    for (int64_t r = 0; r < nr; r++) {
        float pr[2];
        for (int h = 0; h < NH; h++) pr[h] = p[h * p_stride + r];
        const float *row = rp[r] + off;
#pragma GCC unroll 16
        for (int c = 0; c < NC; c++) {
            const float32x4_t vv = vld1q_f32(row + c * LANES);
            for (int h = 0; h < NH; h++) a[h][c] = vfmaq_n_f32(a[h][c], vv, pr[h]);
        }
    }
    for (int h = 0; h < NH; h++)
#pragma GCC unroll 16
        for (int c = 0; c < NC; c++) vst1q_f32(acc + h * acc_stride + off + c * LANES, a[h][c]);
}

/* Weighted V sums of nh1 (1 or 2) heads over one block: 16 accumulator registers of 32,
 * i.e. groups of 16 vectors for one head or 8 for two, then what is left 4 and 1 at a time. */
static void heads_weighted_sum(int nh1, float *acc, const float *p, int64_t ms,
                               const float *const *rp, int64_t hdp, int64_t nr) {
    int64_t off = 0;
    if (nh1 == 2) {
        for (; hdp - off >= 8 * LANES; off += 8 * LANES) wsum_block(2, 8, acc, hdp, p, ms, rp, off, nr);
        for (; hdp - off >= 4 * LANES; off += 4 * LANES) wsum_block(2, 4, acc, hdp, p, ms, rp, off, nr);
        for (; off < hdp; off += LANES) wsum_block(2, 1, acc, hdp, p, ms, rp, off, nr);
    } else {
        for (; hdp - off >= 16 * LANES; off += 16 * LANES) wsum_block(1, 16, acc, hdp, p, ms, rp, off, nr);
        for (; hdp - off >= 4 * LANES; off += 4 * LANES) wsum_block(1, 4, acc, hdp, p, ms, rp, off, nr);
        for (; off < hdp; off += LANES) wsum_block(1, 1, acc, hdp, p, ms, rp, off, nr);
    }
}

/* Scores of one head -> softmax weights in place; returns the sum of the weights.
 * Max is exact in any order; the sum runs over 4 lanes in list order, then a fixed tree.
 * Tail lanes read -inf for the max and give weight 0 to the sum. */
static float softmax_weights(float *s, int64_t m) {
    float32x4_t mx = vdupq_n_f32(-INFINITY);
    int64_t i = 0;
    for (; i + LANES <= m; i += LANES) mx = vmaxq_f32(mx, vld1q_f32(s + i));
    float mxs = vmaxvq_f32(mx);
    for (; i < m; i++) mxs = s[i] > mxs ? s[i] : mxs;
    const float32x4_t mxv = vdupq_n_f32(mxs);
    float32x4_t sum = vdupq_n_f32(0.0f);
    for (i = 0; i < m; i += LANES) {
        const int64_t n = m - i < LANES ? m - i : LANES;
        float32x4_t p = exp_ps(vsubq_f32(load_tail(s + i, n), mxv));
        if (n < LANES) { /* drop the padding lanes' e^(0 - max) */
            const uint32x4_t keep = vcltq_u32((uint32x4_t){0, 1, 2, 3}, vdupq_n_u32((uint32_t)n));
            p = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(p), keep));
        }
        sum = vaddq_f32(sum, p);
        store_tail(s + i, p, n);
    }
    return vaddvq_f32(sum);
}

void lever_ops_attn_heads_neon(const float *q, float *out, int64_t nh, int64_t hd, const void *k,
                               const void *v, int kv_type, int64_t kv_stride, const int32_t *rows,
                               int64_t m, float scale, float *scratch) {
    /* Same scratch layout as ops_avx512.c, rounded to 16 floats, so it fits ops.c's size. */
    const int64_t hdp = round_up(hd, LANES), ms = round_up(m, 16), hdr = round_up(hd, 16);
    float *s = scratch;          /* nh x ms scores, then weights */
    float *buf = s + nh * ms;    /* RB x hdp staged K or V rows */
    float *acc = buf + 16 * hdr; /* nh x hdp weighted sums */
    float *qp = acc + nh * hdr;  /* nh x hdp zero-padded queries */
    float *wsum = qp + nh * hdr; /* nh sums of softmax weights */
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
        const float32x4_t sum = vdupq_n_f32(wsum[h]);
        for (int64_t d = 0; d < hd; d += LANES)
            store_tail(out + h * hd + d, vdivq_f32(vld1q_f32(acc + h * hdp + d), sum), hd - d);
    }
}
