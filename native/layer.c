/* layer.c: lever_layer_forward, one transformer layer in one call.
 *
 * Decoding runs a layer for one token (or a small tree) some thirty times per forward; from
 * Python each layer was fifteen kernel calls, and their argument checks, allocations and
 * fork-joins cost 70-160 us a layer against 350-620 us of weights to stream (Qwen2.5 0.5B /
 * 1.5B, one token). Here the same kernels run in the same order on the same values, so the
 * result is bit-identical to lever.backends.cpu.layer.layer_forward_steps, the composition in
 * Python that documents this function step by step; Q, K and V (and gate and up) are one
 * matmul job that quantizes the activations once.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lever_kernels.h"
#include "quants_internal.h"

static void add_rows(float *x, const float *b, int64_t n_rows, int64_t n) {
    for (int64_t r = 0; r < n_rows; r++)
        for (int64_t i = 0; i < n; i++) x[r * n + i] += b[i];
}

/* Token t's k (or v) row into cache row rows[t], converted to the cache's type as numpy's
 * astype(float16) converts (round to nearest even). */
static void store_kv(void *cache, int kv_type, const int64_t *rows, const float *src, int64_t n_tok, int64_t n) {
    for (int64_t t = 0; t < n_tok; t++) {
        const float *s = src + t * n;
        if (kv_type == LEVER_F16) {
            uint16_t *d = (uint16_t *)cache + rows[t] * n;
            for (int64_t i = 0; i < n; i++) d[i] = lever_fp32_to_fp16(s[i]);
        } else {
            memcpy((float *)cache + rows[t] * n, s, (size_t)n * sizeof(float));
        }
    }
}

static lever_matrix with_output(lever_matrix m, float *y) {
    m.y = y;
    return m;
}

int lever_layer_forward(const lever_layer_dims *d, const lever_layer_weights *w, float *x, int64_t n_tok,
                        const int32_t *pos, const uint8_t *mask, int64_t n_seen, void *k_cache, void *v_cache,
                        int kv_type, const int64_t *rows, int n_threads) {
    if (n_tok < 0 || n_seen < 0 || d->n_embd <= 0 || d->n_head <= 0 || d->n_head_kv <= 0 || d->head_dim <= 0 ||
        d->n_ff <= 0)
        return LEVER_EBAD_SHAPE;
    if (kv_type != LEVER_F32 && kv_type != LEVER_F16) return LEVER_EUNSUPPORTED_TYPE;
    if (n_tok == 0) return LEVER_OK;
    const int64_t E = d->n_embd, Q = d->n_head * d->head_dim, KV = d->n_head_kv * d->head_dim, F = d->n_ff;
    /* h: normed input (both halves); q, k, v, attn; o: a matmul's output; gate, up, act */
    float *buf = malloc((size_t)(n_tok * (2 * E + 2 * Q + 2 * KV + 3 * F)) * sizeof(float));
    if (!buf) return LEVER_ENOMEM;
    float *h = buf, *q = h + n_tok * E, *k = q + n_tok * Q, *v = k + n_tok * KV, *attn = v + n_tok * KV;
    float *o = attn + n_tok * Q, *gate = o + n_tok * E, *up = gate + n_tok * F, *act = up + n_tok * F;
    int rc;

    lever_rmsnorm(x, w->attn_norm, n_tok, E, d->rms_eps, h);
    const lever_matrix qkv[3] = {with_output(w->wq, q), with_output(w->wk, k), with_output(w->wv, v)};
    if ((rc = lever_matmul_many(3, qkv, h, n_tok, n_threads))) goto out;
    if (w->bq) add_rows(q, w->bq, n_tok, Q);
    if (w->bk) add_rows(k, w->bk, n_tok, KV);
    if (w->bv) add_rows(v, w->bv, n_tok, KV);
    if (w->q_norm) lever_rmsnorm(q, w->q_norm, n_tok * d->n_head, d->head_dim, d->rms_eps, q);
    if (w->k_norm) lever_rmsnorm(k, w->k_norm, n_tok * d->n_head_kv, d->head_dim, d->rms_eps, k);
    lever_rope(q, pos, n_tok, d->n_head, d->head_dim, d->n_rot, d->inv_freq, d->rope_neox, 1.0f);
    lever_rope(k, pos, n_tok, d->n_head_kv, d->head_dim, d->n_rot, d->inv_freq, d->rope_neox, 1.0f);
    store_kv(k_cache, kv_type, rows, k, n_tok, KV);
    store_kv(v_cache, kv_type, rows, v, n_tok, KV);
    if ((rc = lever_attention(q, n_tok, d->n_head, d->head_dim, k_cache, v_cache, kv_type, n_seen, d->n_head_kv,
                              mask, d->attn_scale, attn, n_threads)))
        goto out;
    const lever_matrix wo = with_output(w->wo, o);
    if ((rc = lever_matmul_many(1, &wo, attn, n_tok, n_threads))) goto out;
    for (int64_t i = 0; i < n_tok * E; i++) x[i] += o[i];

    lever_rmsnorm(x, w->ffn_norm, n_tok, E, d->rms_eps, h);
    const lever_matrix gu[2] = {with_output(w->w_gate, gate), with_output(w->w_up, up)};
    if ((rc = lever_matmul_many(2, gu, h, n_tok, n_threads))) goto out;
    lever_swiglu(gate, up, n_tok * F, act);
    const lever_matrix down = with_output(w->w_down, o);
    if ((rc = lever_matmul_many(1, &down, act, n_tok, n_threads))) goto out;
    for (int64_t i = 0; i < n_tok * E; i++) x[i] += o[i];
out:
    free(buf);
    return rc;
}

void lever_struct_sizes(int64_t *out) {
    out[0] = (int64_t)sizeof(lever_matrix);
    out[1] = (int64_t)sizeof(lever_layer_dims);
    out[2] = (int64_t)sizeof(lever_layer_weights);
}
