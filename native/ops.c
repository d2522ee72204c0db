/* ops.c: the per-token operators of a llama-style layer (rmsnorm, rope, attention, swiglu).
 *
 * This file holds the scalar reference of each operator, the ISA dispatch, and the threaded
 * driver of attention. The SIMD inner loops live in ops_avx2.c, ops_avx512.c and ops_neon.c;
 * they are declared below (there is no shared internal header, so each SIMD file repeats
 * the prototype it defines: keep them in step).
 *
 * Batch invariance (see lever_kernels.h) shapes everything here:
 *  - rmsnorm/swiglu/rope compute each row or element with arithmetic that depends only on
 *    its own values and the row length, never on its index, alignment or the array length;
 *  - attention reduces a (token, head) over the list of kv rows the token may see, in
 *    increasing row order, in blocks counted from the start of that list. Masked rows are
 *    skipped before any arithmetic, so neither they, nor other tokens, nor the thread count
 *    (threads only pick which (token, head) pairs they compute) can change a result.
 */
#include <math.h>
#include <stdint.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>


#include "lever_kernels.h"
#include "threadpool.h"

/* ---- SIMD entry points (defined in ops_<isa>.c) ---------------------------------------- */

/* Attention of nh query heads of one token that share one kv head, over m >= 1 visible rows.
 *   q, out:  nh heads of hd floats, contiguous
 *   k, v:    element 0 of this kv head in row 0; row r starts kv_stride elements later
 *   rows:    indices of the visible rows, increasing
 *   scratch: attn_scratch_floats(nh, hd, n_kv) floats, 64-byte aligned (below) */
typedef void (*attn_heads_fn)(const float *q, float *out, int64_t nh, int64_t hd, const void *k,
                              const void *v, int kv_type, int64_t kv_stride, const int32_t *rows,
                              int64_t m, float scale, float *scratch);
typedef void (*rmsnorm_fn)(const float *x, const float *w, int64_t n_rows, int64_t n, float eps,
                           float *out);
typedef void (*swiglu_fn)(const float *gate, const float *up, int64_t n, float *out);

#if defined(LEVER_HAVE_X86)
void lever_ops_attn_heads_avx2(const float *q, float *out, int64_t nh, int64_t hd, const void *k,
                               const void *v, int kv_type, int64_t kv_stride, const int32_t *rows,
                               int64_t m, float scale, float *scratch);
void lever_ops_rmsnorm_avx2(const float *x, const float *w, int64_t n_rows, int64_t n, float eps,
                            float *out);
void lever_ops_swiglu_avx2(const float *gate, const float *up, int64_t n, float *out);
void lever_ops_attn_heads_avx512(const float *q, float *out, int64_t nh, int64_t hd,
                                 const void *k, const void *v, int kv_type, int64_t kv_stride,
                                 const int32_t *rows, int64_t m, float scale, float *scratch);
void lever_ops_rmsnorm_avx512(const float *x, const float *w, int64_t n_rows, int64_t n,
                              float eps, float *out);
void lever_ops_swiglu_avx512(const float *gate, const float *up, int64_t n, float *out);
#elif defined(LEVER_HAVE_NEON)
void lever_ops_attn_heads_neon(const float *q, float *out, int64_t nh, int64_t hd, const void *k,
                               const void *v, int kv_type, int64_t kv_stride, const int32_t *rows,
                               int64_t m, float scale, float *scratch);
void lever_ops_rmsnorm_neon(const float *x, const float *w, int64_t n_rows, int64_t n, float eps,
                            float *out);
void lever_ops_swiglu_neon(const float *gate, const float *up, int64_t n, float *out);
#endif

/* ---- helpers ---------------------------------------------------------------------------- */

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Scratch one attention work unit needs, in floats. The SIMD kernels carve it as: scores
 * (nh rows of n_kv rounded to 16), two 16-row K/V staging blocks, nh accumulators and nh
 * zero-padded query heads (head_dim rounded to 16), nh softmax sums, slack for alignment. */
static int64_t attn_scratch_floats(int64_t nh, int64_t hd, int64_t n_kv) {
    int64_t hdp = round_up(hd, 16);
    return nh * round_up(n_kv, 16) + (32 + 2 * nh) * hdp + round_up(nh, 16) + 4 * 16;
}

/* IEEE half to float, exact (same result as F16C / NEON conversion). */
static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24 is exact in float */
        float f = (float)mant * 0x1p-24f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13); /* inf / nan */
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* ---- rmsnorm ---------------------------------------------------------------------------- */

/* As ggml: squares in float, summed in double in index order, mean and scale in float. */
static void rmsnorm_scalar(const float *x, const float *w, int64_t n_rows, int64_t n, float eps,
                           float *out) {
    for (int64_t r = 0; r < n_rows; r++) {
        const float *xr = x + r * n;
        float *yr = out + r * n;
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++) sum += (double)(xr[i] * xr[i]);
        const float mean = (float)(sum / (double)n);
        const float scale = 1.0f / sqrtf(mean + eps);
        for (int64_t i = 0; i < n; i++) yr[i] = xr[i] * scale * w[i];
    }
}

void lever_rmsnorm(const float *x, const float *w, int64_t n_rows, int64_t n, float eps,
                   float *out) {
    rmsnorm_fn fn = rmsnorm_scalar;
    switch (lever_get_isa()) {
#if defined(LEVER_HAVE_X86)
    case LEVER_ISA_AVX2: fn = lever_ops_rmsnorm_avx2; break;
    case LEVER_ISA_AVX512: fn = lever_ops_rmsnorm_avx512; break;
#elif defined(LEVER_HAVE_NEON)
    case LEVER_ISA_NEON: fn = lever_ops_rmsnorm_neon; break;
#endif
    default: break;
    }
    if (n_rows > 0 && n > 0) fn(x, w, n_rows, n, eps, out);
}

/* ---- rope ------------------------------------------------------------------------------- */

/* One path for every ISA: the cost is n_tok * n_rot/2 sin/cos pairs plus a few flops per
 * element, small beside the matmuls, and a single path keeps every ISA bit-identical.
 * theta is rounded to float before cos/sin, as ggml and HF compute it. */
void lever_rope(float *x, const int32_t *pos, int64_t n_tok, int64_t n_head, int64_t head_dim,
                int64_t n_rot, const float *inv_freq, int neox, float attn_factor) {
    if (n_rot > head_dim) n_rot = head_dim;
    const int64_t half = n_rot / 2;
    if (n_tok <= 0 || n_head <= 0 || half <= 0) return;
    float cs_stack[2 * 128];
    float *cs = half <= 128 ? cs_stack : malloc((size_t)(2 * half) * sizeof(float));
    if (!cs) return; /* void API; only reachable with absurd n_rot */
    /* In pairs mode element 2i pairs with 2i+1; in neox mode i pairs with i + n_rot/2. */
    const int64_t stride = neox ? 1 : 2, offset = neox ? half : 1;
    for (int64_t t = 0; t < n_tok; t++) {
        const float p = (float)pos[t];
        for (int64_t i = 0; i < half; i++) {
            const float theta = p * inv_freq[i];
            cs[2 * i] = cosf(theta) * attn_factor;
            cs[2 * i + 1] = sinf(theta) * attn_factor;
        }
        for (int64_t h = 0; h < n_head; h++) {
            float *xh = x + (t * n_head + h) * head_dim;
            for (int64_t i = 0; i < half; i++) {
                float *a = xh + i * stride, *b = a + offset;
                const float x0 = *a, x1 = *b, c = cs[2 * i], s = cs[2 * i + 1];
                *a = x0 * c - x1 * s;
                *b = x0 * s + x1 * c;
            }
        }
    }
    if (cs != cs_stack) free(cs);
}

/* ---- swiglu ----------------------------------------------------------------------------- */

static void swiglu_scalar(const float *gate, const float *up, int64_t n, float *out) {
    /* expf(-g) overflows to inf for very negative g, giving g/inf = -0, the right limit. */
    for (int64_t i = 0; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

void lever_swiglu(const float *gate, const float *up, int64_t n, float *out) {
    swiglu_fn fn = swiglu_scalar;
    switch (lever_get_isa()) {
#if defined(LEVER_HAVE_X86)
    case LEVER_ISA_AVX2: fn = lever_ops_swiglu_avx2; break;
    case LEVER_ISA_AVX512: fn = lever_ops_swiglu_avx512; break;
#elif defined(LEVER_HAVE_NEON)
    case LEVER_ISA_NEON: fn = lever_ops_swiglu_neon; break;
#endif
    default: break;
    }
    if (n > 0) fn(gate, up, n, out);
}

/* ---- attention -------------------------------------------------------------------------- */

/* Row j of one kv head as floats: in place for f32, converted into tmp for f16. */
static const float *kv_row(const void *base, int kv_type, int64_t off, int64_t hd, float *tmp) {
    if (kv_type == LEVER_F32) return (const float *)base + off;
    const uint16_t *src = (const uint16_t *)base + off;
    for (int64_t d = 0; d < hd; d++) tmp[d] = f16_to_f32(src[d]);
    return tmp;
}

static double dot_f64(const float *a, const float *b, int64_t n) {
    double sum = 0.0;
    for (int64_t d = 0; d < n; d++) sum += (double)a[d] * (double)b[d];
    return sum;
}

/* Scalar reference, in double so that it sits within an ulp or so of the float64 numpy
 * reference: per head, the max score, then weights exp(s - max) and the weighted sum of V
 * rows in row order, divided by the sum of weights at the end. Scores are recomputed in the
 * second pass rather than stored, so the scratch stays small and the scores stay double. */
static void attn_heads_scalar(const float *q, float *out, int64_t nh, int64_t hd, const void *k,
                              const void *v, int kv_type, int64_t kv_stride, const int32_t *rows,
                              int64_t m, float scale, float *scratch) {
    double *acc = (double *)scratch;     /* hd (scratch is 64-byte aligned) */
    float *row = (float *)(acc + hd);    /* hd, f16 conversion */
    for (int64_t h = 0; h < nh; h++) {
        const float *qh = q + h * hd;
        double mx = -INFINITY;
        for (int64_t i = 0; i < m; i++) {
            const float *kr = kv_row(k, kv_type, rows[i] * kv_stride, hd, row);
            const double s = dot_f64(qh, kr, hd) * scale;
            mx = s > mx ? s : mx;
        }
        double sum = 0.0;
        for (int64_t d = 0; d < hd; d++) acc[d] = 0.0;
        for (int64_t i = 0; i < m; i++) {
            const float *kr = kv_row(k, kv_type, rows[i] * kv_stride, hd, row);
            const double p = exp(dot_f64(qh, kr, hd) * scale - mx);
            sum += p;
            const float *vr = kv_row(v, kv_type, rows[i] * kv_stride, hd, row);
            for (int64_t d = 0; d < hd; d++) acc[d] += p * vr[d];
        }
        for (int64_t d = 0; d < hd; d++) out[h * hd + d] = (float)(acc[d] / sum);
    }
}

static attn_heads_fn attn_kernel(void) {
    switch (lever_get_isa()) {
#if defined(LEVER_HAVE_X86)
    case LEVER_ISA_AVX2: return lever_ops_attn_heads_avx2;
    case LEVER_ISA_AVX512: return lever_ops_attn_heads_avx512;
#elif defined(LEVER_HAVE_NEON)
    case LEVER_ISA_NEON: return lever_ops_attn_heads_neon;
#endif
    default: return attn_heads_scalar;
    }
}

/* Visible rows of one mask row, in increasing order; returns their count. */
static int64_t visible_rows(const uint8_t *mask_row, int64_t n_kv, int32_t *rows) {
    int64_t m = 0;
    for (int64_t j = 0; j < n_kv; j++)
        if (mask_row[j]) rows[m++] = (int32_t)j;
    return m;
}

/* One attention call's work: units are claimed from a shared counter (the costs differ with
 * each token's visible rows), which changes only who computes a unit, never its result. */
typedef struct {
    attn_heads_fn kernel;
    const float *q;
    const void *k, *v;
    const uint8_t *mask;
    float *out;
    int64_t n_head, head_dim;
    int kv_type;
    int64_t n_kv, n_kv_head, group, n_split, hb, n_units;
    float scale;
    size_t scratch_bytes, rows_bytes, elsize;
    atomic_llong next;
    atomic_int err;
} attn_job;

static void attn_part(void *ctx, int ith, int nth) {
    attn_job *j = ctx;
    /* Per-thread heap scratch: n_kv may be tens of thousands, too much for the stack. */
    float *scratch = aligned_alloc(64, j->scratch_bytes);
    int32_t *rows = aligned_alloc(64, j->rows_bytes);
    if (!scratch || !rows) {
        atomic_store(&j->err, LEVER_ENOMEM);
        free(scratch);
        free(rows);
        return;
    }
    int64_t rows_tok = -1, m = 0;
    for (int64_t u; (u = atomic_fetch_add(&j->next, 1)) < j->n_units;) {
        const int64_t t = u / (j->n_kv_head * j->n_split);
        const int64_t g = u / j->n_split % j->n_kv_head;
        const int64_t h0 = g * j->group + u % j->n_split * j->hb;
        const int64_t nh = j->hb < g * j->group + j->group - h0 ? j->hb : g * j->group + j->group - h0;
        if (t != rows_tok) {
            m = visible_rows(j->mask + t * j->n_kv, j->n_kv, rows);
            rows_tok = t;
        }
        const float *qh = j->q + (t * j->n_head + h0) * j->head_dim;
        float *oh = j->out + (t * j->n_head + h0) * j->head_dim;
        if (m == 0) {
            memset(oh, 0, (size_t)(nh * j->head_dim) * sizeof(float));
            continue;
        }
        const char *kg = (const char *)j->k + (size_t)(g * j->head_dim) * j->elsize;
        const char *vg = (const char *)j->v + (size_t)(g * j->head_dim) * j->elsize;
        j->kernel(qh, oh, nh, j->head_dim, kg, vg, j->kv_type, j->n_kv_head * j->head_dim, rows, m, j->scale,
                  scratch);
    }
    free(scratch);
    free(rows);
}

int lever_attention(const float *q, int64_t n_tok, int64_t n_head, int64_t head_dim,
                    const void *k, const void *v, int kv_type, int64_t n_kv, int64_t n_kv_head,
                    const uint8_t *mask, float scale, float *out, int n_threads) {
    if (kv_type != LEVER_F32 && kv_type != LEVER_F16) return LEVER_EUNSUPPORTED_TYPE;
    if (n_tok < 0 || n_head <= 0 || head_dim <= 0 || n_kv < 0 || n_kv_head <= 0 ||
        n_head % n_kv_head != 0 || n_kv > INT32_MAX)
        return LEVER_EBAD_SHAPE;
    if (n_tok == 0) return LEVER_OK;

    const attn_heads_fn kernel = attn_kernel();
    const size_t elsize = kv_type == LEVER_F16 ? 2 : 4;
    const int64_t group = n_head / n_kv_head;
    int nt = n_threads > 0 ? n_threads : lever_threads_default();

    /* Work unit: one token, one kv head, and a block of the query heads reading it, so each
     * K/V row is loaded (and converted from f16) once for the whole block. When there are
     * fewer (token, kv head) pairs than threads, as at decode, the heads of a group are
     * split into smaller blocks. A head's arithmetic is the same in any block. */
    const int64_t pairs = n_tok * n_kv_head;
    int64_t n_split = pairs >= nt ? 1 : (nt + pairs - 1) / pairs;
    if (n_split > group) n_split = group;
    const int64_t hb = (group + n_split - 1) / n_split;
    n_split = (group + hb - 1) / hb;
    const int64_t n_units = pairs * n_split;
    if (nt > n_units) nt = (int)n_units; /* no idle threads, each with its own scratch */

    const size_t scratch_bytes =
        (size_t)round_up(attn_scratch_floats(hb, head_dim, n_kv) * (int64_t)sizeof(float), 64);
    const size_t rows_bytes = (size_t)round_up((n_kv > 0 ? n_kv : 1) * 4, 64);
    attn_job j = {kernel, q, k, v, mask, out, n_head, head_dim, kv_type, n_kv, n_kv_head, group, n_split, hb,
                  n_units, scale, scratch_bytes, rows_bytes, elsize, 0, LEVER_OK};
    lever_parallel(attn_part, &j, nt);
    int err = atomic_load(&j.err);
    return err;
}

/* ---- top-k ------------------------------------------------------------------------------ */

/* One pass with the k best so far in an insertion list: a value enters only when it beats
 * the k-th, which after the first few thousand of a vocabulary is rare. NaN never enters
 * (every comparison with it is false). Ties keep the lower index first. */
int lever_top_k(const float *x, int64_t n_rows, int64_t n, int k, int64_t *ids, float *values) {
    if (n_rows < 0 || k < 1 || k > n) return LEVER_EBAD_SHAPE;
    for (int64_t r = 0; r < n_rows; r++) {
        const float *xr = x + r * n;
        int64_t *id = ids + r * k;
        float *v = values + r * k;
        int have = 0;
        for (int64_t i = 0; i < n; i++) {
            const float xi = xr[i];
            if (have == k && !(xi > v[k - 1])) continue;
            if (have < k && xi != xi) continue;
            int j = have < k ? have++ : k - 1;
            while (j > 0 && xi > v[j - 1]) {
                v[j] = v[j - 1];
                id[j] = id[j - 1];
                j--;
            }
            v[j] = xi;
            id[j] = i;
        }
        if (have < k) return LEVER_EBAD_SHAPE; /* fewer than k numbers in the row */
    }
    return LEVER_OK;
}
