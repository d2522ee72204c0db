/* lever_kernels.h: the one header of Lever's native kernels.
 *
 * Everything the model core computes per token goes through these calls: quantized
 * matrix x activations (decode at 1 row up to tree verification at 64+ rows), dequantization,
 * and the per-token operators of a llama-style layer. Python loads the shared library with
 * ctypes (backends/cpu/native.py); ctypes drops the GIL for the call, so reads and compute overlap.
 *
 * Each kernel has a scalar reference and SIMD paths (AVX2/FMA, AVX-512, NEON) chosen once at
 * load from the CPU; lever_set_isa() forces a path so tests can compare them.
 *
 * Batch invariance is a contract, not an accident: every output row is reduced in a fixed
 * order that depends only on its own inputs and the ISA, never on how many rows are computed
 * together, which rows they are, or the thread count. Speculative decoding relies on it to
 * reproduce autoregressive output bit for bit.
 *
 * Return codes: 0 on success, LEVER_E* (negative) on bad arguments.
 */
#ifndef LEVER_KERNELS_H
#define LEVER_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Tensor types, numbered as ggml numbers them on disk in GGUF. */
enum lever_type {
    LEVER_F32 = 0,
    LEVER_F16 = 1,
    LEVER_Q4_0 = 2,
    LEVER_Q5_0 = 6,
    LEVER_Q8_0 = 8,
    LEVER_Q4_K = 12,
    LEVER_Q6_K = 14,
    LEVER_BF16 = 30,
};

enum lever_isa {
    LEVER_ISA_SCALAR = 0,
    LEVER_ISA_AVX2 = 1,   /* AVX2 + FMA + F16C */
    LEVER_ISA_AVX512 = 2, /* AVX-512 F/BW/VL (+VNNI where the CPU has it) */
    LEVER_ISA_NEON = 3,   /* arm64 NEON (+dotprod) */
};

/* Weight layouts. Row layout is GGUF's: n_out rows of blocks, as the file stores them and
 * flash streams them. Tile layout regroups them for the kernels: every LEVER_TILE_ROWS rows
 * form a tile, and inside a tile each block's bytes are interleaved so that one SIMD load
 * gives the same bytes of every row (what the row-layout kernels get by transposing
 * registers, once per block, and by reading LEVER_TILE_ROWS interleaved streams, which the
 * hardware prefetchers follow badly). The bytes are the same, only their order changes, plus
 * zero rows that pad the last tile; results are bit-identical in either layout. */
enum lever_layout {
    LEVER_LAYOUT_ROWS = 0,
    LEVER_LAYOUT_TILES = 1,
};

#define LEVER_TILE_ROWS 16

enum lever_err {
    LEVER_OK = 0,
    LEVER_EUNSUPPORTED_TYPE = -1,
    LEVER_EBAD_SHAPE = -2,  /* e.g. n_in not a multiple of the type's block size */
    LEVER_ENOMEM = -3,
};

/* ISA dispatch. lever_set_isa clamps to what this CPU and build support and returns
 * the ISA now in force. */
int lever_isa_best(void);
int lever_get_isa(void);
int lever_set_isa(int isa);

/* Dequantize n_rows rows of n_cols elements each (rows contiguous, in `type`'s block
 * format) into out, float32 (n_rows, n_cols). */
int lever_dequantize(int type, const void *src, int64_t n_rows, int64_t n_cols, float *out);

/* y[t, r] = sum_k W[r, k] * x[t, k]   for r < n_out, t < n_tok.
 *   w: n_out rows of n_in weights in `type`'s block format, contiguous  # (n_out, n_in)
 *   x: float32, contiguous                                               # (n_tok, n_in)
 *   y: float32, contiguous                                               # (n_tok, n_out)
 * Quantized types multiply against activations quantized per token the way ggml does
 * (Q8_0 blocks for Q4_0/Q5_0/Q8_0, Q8_K blocks for Q4_K/Q6_K); float types use float32
 * activations. n_threads <= 0 means all cores. Batch-invariant (see above); moreover every
 * ISA reduces in the same order (exact integer block sums, then one fused multiply-add per
 * block; native/quants_internal.h), so results are bit-identical across ISAs as well. */
int lever_matmul(int type, int layout, const void *w, int64_t n_out, int64_t n_in,
                 const float *x, int64_t n_tok, float *y, int n_threads);

/* One matrix of lever_matmul_many: W (type, layout, n_out x n_in) and its output y (n_tok, n_out). */
typedef struct {
    int type, layout;
    const void *w;
    int64_t n_out, n_in;
    float *y;
} lever_matrix;

#define LEVER_MAX_MATRICES 3

/* lever_matmul for n <= LEVER_MAX_MATRICES matrices of one n_in that multiply the same x (a
 * layer's Q, K and V; gate and up): one job for the thread pool, x quantized once for every
 * kind of activation the types need. Each y is what lever_matmul would give, bit for bit. */
int lever_matmul_many(int n, const lever_matrix *m, const float *x, int64_t n_tok, int n_threads);

/* One transformer layer (llama, qwen2, qwen3), as lever.backends.cpu.layer.layer_forward_steps
 * composes the kernels above, bit for bit: x (n_tok, n_embd) is updated in place; the tokens'
 * k, v rows go to cache rows rows[t] (kv_type: LEVER_F16 or LEVER_F32 caches of (n_ctx,
 * n_head_kv, head_dim)), and attention reads cache rows [0, n_seen) through mask (n_tok, n_seen). */
typedef struct {
    int64_t n_embd, n_head, n_head_kv, head_dim, n_ff, n_rot;
    float rms_eps, attn_scale;
    int rope_neox;
    const float *inv_freq; /* (n_rot / 2,) */
} lever_layer_dims;

typedef struct {
    const float *attn_norm, *ffn_norm;                  /* (n_embd,) */
    const float *bq, *bk, *bv, *q_norm, *k_norm;        /* NULL where the layer has none */
    lever_matrix wq, wk, wv, wo, w_gate, w_up, w_down;  /* .y unused */
} lever_layer_weights;

int lever_layer_forward(const lever_layer_dims *d, const lever_layer_weights *w, float *x, int64_t n_tok,
                        const int32_t *pos, const uint8_t *mask, int64_t n_seen, void *k_cache, void *v_cache,
                        int kv_type, const int64_t *rows, int n_threads);

/* sizeof the three structs above, for the test that ties backends/cpu/native.py's ctypes mirrors to them. */
void lever_struct_sizes(int64_t *out);

/* Bytes of an (n_out, n_in) matrix of `type` in tile layout: whole tiles, the last padded
 * with zero rows (0 for an unsupported type or a bad shape). */
int64_t lever_tiled_bytes(int type, int64_t n_out, int64_t n_in);

/* Row layout -> tile layout: src (n_out rows), dst lever_tiled_bytes(...) bytes. */
int lever_pack(int type, const void *src, int64_t n_out, int64_t n_in, void *dst, int n_threads);

/* Tile layout -> row layout for the n rows listed (each < n_out), e.g. the embedding rows of
 * a prompt from a tied output matrix: dst gets n rows of the row layout, in list order. */
int lever_unpack_rows(int type, const void *tiled, int64_t n_out, int64_t n_in, const int64_t *rows,
                      int64_t n, void *dst);

/* The type table (for the test that ties lever/gguf/types.py to it): block size, block bytes and
 * the tile layout's segments as (offset, bytes, width) triples into seg (room for 3). Returns
 * the number of segments, or LEVER_EUNSUPPORTED_TYPE. */
int lever_type_layout(int type, int *block, int *block_bytes, int *seg);

/* out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w[:]     # x, out: (n_rows, n) */
void lever_rmsnorm(const float *x, const float *w, int64_t n_rows, int64_t n, float eps,
                   float *out);

/* Rotary embedding in place on x: (n_tok, n_head, head_dim). Only the first n_rot dims of
 * each head rotate. theta_i = pos[t] * inv_freq[i], i < n_rot/2 (inv_freq carries any rope
 * scaling). neox = 0 rotates adjacent pairs (2i, 2i+1); neox = 1 rotates (i, i + n_rot/2).
 * cos and sin are multiplied by attn_factor (1.0 unless YaRN). */
void lever_rope(float *x, const int32_t *pos, int64_t n_tok, int64_t n_head, int64_t head_dim,
                int64_t n_rot, const float *inv_freq, int neox, float attn_factor);

/* Attention with an explicit mask, grouped-query.
 *   q:    float32                                   # (n_tok, n_head, head_dim)
 *   k, v: kv_type (LEVER_F32 or LEVER_F16)           # (n_kv, n_kv_head, head_dim)
 *   mask: uint8, 1 = token t may attend to row j     # (n_tok, n_kv)
 *   out:  float32                                   # (n_tok, n_head, head_dim)
 * Query head h reads kv head h / (n_head / n_kv_head). scores scaled by `scale`, softmax
 * over the allowed rows only (rows with mask 0 are never read). A token with no allowed row
 * gets zeros. Batch-invariant: a token's output depends only on its q, its mask row and
 * the rows it may see. */
int lever_attention(const float *q, int64_t n_tok, int64_t n_head, int64_t head_dim,
                    const void *k, const void *v, int kv_type, int64_t n_kv, int64_t n_kv_head,
                    const uint8_t *mask, float scale, float *out, int n_threads);

/* The k largest values of each row of x (n_rows, n), by falling value (ties: lower index
 * first), as ids and values (n_rows, k). NaN is never chosen; LEVER_EBAD_SHAPE when a row has
 * fewer than k numbers. */
int lever_top_k(const float *x, int64_t n_rows, int64_t n, int k, int64_t *ids, float *values);

/* out[i] = silu(gate[i]) * up[i]; the result for an element never depends on its index
 * or on n (no separate tail arithmetic). */
void lever_swiglu(const float *gate, const float *up, int64_t n, float *out);

#ifdef __cplusplus
}
#endif
#endif
