/* matmul.c: lever_matmul, y[t, r] = sum_k W[r, k] x[t, k], the hot path of decoding.
 *
 * Steps of one call:
 *   1. quantize each token's activations once (Q8_0 blocks for Q4_0/Q5_0/Q8_0 weights,
 *      Q8_K for Q4_K/Q6_K; float types use x as it is), tokens split across threads;
 *   2. split the output rows into tiles (the ISA's width in the row layout, 16 rows in
 *      the tile layout); the worker pool's threads claim runs of tiles from a shared
 *      counter. A tile kernel streams its rows' weights once and applies every block to all
 *      tokens of the call (up to LEVER_TOK_TILE at a time), so tree verification with 16-64
 *      tokens reads each weight byte once, and a call of 1-8 tokens still splits the rows.
 * A reduction is never split: each (row, token) is summed by one kernel call in the
 * canonical order of quants_internal.h, so the result is the same for any n_tok, any
 * batch companions, any thread count or claiming order, any ISA and either layout.
 */
#include <stdlib.h>

#include "lever_kernels.h"
#include "quants_internal.h"
#include "threadpool.h"

#define TILE_CHUNKS_PER_THREAD 2

static const lever_kernel_set *kernels_for_isa(int isa) {
    switch (isa) {
#if defined(LEVER_HAVE_X86)
    case LEVER_ISA_AVX2: return &lever_kernels_avx2;
    case LEVER_ISA_AVX512: return &lever_kernels_avx512;
#endif
#if defined(LEVER_HAVE_NEON)
    case LEVER_ISA_NEON: return &lever_kernels_neon;
#endif
    default: return &lever_kernels_scalar;
    }
}

/* What the kernels read per token: bytes of one token's quantized row (0: float x as is). */
static int64_t act_row_bytes(int type, int64_t n_in) {
    switch (type) {
    case LEVER_Q8_0:
    case LEVER_Q4_0:
    case LEVER_Q5_0: return n_in / QK8_0 * (int64_t)sizeof(lever_q8_0x);
    case LEVER_Q4_K:
    case LEVER_Q6_K: return n_in / QK_K * (int64_t)sizeof(block_q8_K);
    default: return 0;
    }
}

static void quantize_activation(const lever_kernel_set *ks, int type, const float *x, int64_t n_in,
                                uint8_t *out) {
    if (type == LEVER_Q4_K || type == LEVER_Q6_K)
        ks->quantize_q8_K(x, (block_q8_K *)out, n_in);
    else
        ks->quantize_q8_0x(x, (lever_q8_0x *)out, n_in);
}

/* A matrix of a job: its kernel, and where its tiles sit in the job's numbering. */
typedef struct {
    lever_tile_fn tile;     /* row layout */
    lever_packed_fn packed; /* tile layout */
    int tile_rows;
    const uint8_t *w;
    int64_t w_stride, n_out, first_tile, n_tiles;
    const uint8_t *xs; /* the activations it reads: quantized for its type, or x */
    int64_t x_stride;
    float *y;
} matmul_part;

/* One job's work, shared by the threads of the pool: up to LEVER_MAX_MATRICES matrices that
 * multiply the same activations (a layer's Q, K, V; gate and up), their tiles numbered one
 * after another, so one fork-join computes them all and the activations are quantized once
 * for every kind the matrices need. */
typedef struct {
    const lever_kernel_set *ks;
    int n_parts;
    matmul_part parts[LEVER_MAX_MATRICES];
    int64_t n_in, n_tok, n_tiles;
    const float *x;
    int n_kinds;
    int kinds[LEVER_MAX_MATRICES]; /* activation kinds to quantize: a type that needs each */
    uint8_t *act[LEVER_MAX_MATRICES];
    int64_t a_bytes[LEVER_MAX_MATRICES];
    lever_counter toks, tiles;
} matmul_job;

static void quantize_part(void *ctx, int ith, int nth) {
    matmul_job *j = ctx;
    long long i0, i1;
    while (lever_claim(&j->toks, &i0, &i1))
        for (int64_t i = i0; i < i1; i++) { /* item i: kind i / n_tok, token i % n_tok */
            const int k = (int)(i / j->n_tok);
            const int64_t t = i % j->n_tok;
            quantize_activation(j->ks, j->kinds[k], j->x + t * j->n_in, j->n_in, j->act[k] + t * j->a_bytes[k]);
        }
}

/* Tile i of part p, tokens t0..t0+toks-1. A packed tile is LEVER_TILE_ROWS rows, computed as
 * slices of the ISA's width. */
static void one_tile(const matmul_job *j, const matmul_part *p, int64_t i, int64_t t0, int toks) {
    const int64_t r0 = i * p->tile_rows;
    const int rows = (int)(p->n_out - r0 < p->tile_rows ? p->n_out - r0 : p->tile_rows);
    const uint8_t *x = p->xs + t0 * p->x_stride;
    float *y = p->y + t0 * p->n_out + r0;
    if (!p->packed) {
        p->tile(p->w + r0 * p->w_stride, p->w_stride, rows, j->n_in, x, p->x_stride, toks, y, p->n_out);
        return;
    }
    const uint8_t *tile = p->w + r0 * p->w_stride;
    const int R = j->ks->rows;
    for (int sub = 0; sub * R < rows; sub++) {
        const int n = rows - sub * R < R ? rows - sub * R : R;
        p->packed(tile, sub, n, j->n_in, x, p->x_stride, toks, y + sub * R, p->n_out);
    }
}

static void tiles_part(void *ctx, int ith, int nth) {
    matmul_job *j = ctx;
    long long i0, i1;
    while (lever_claim(&j->tiles, &i0, &i1))
        for (int64_t i = i0; i < i1; i++) {
            int k = 0;
            while (i >= j->parts[k].first_tile + j->parts[k].n_tiles) k++;
            const matmul_part *p = &j->parts[k];
            for (int64_t t0 = 0; t0 < j->n_tok; t0 += LEVER_TOK_TILE)
                one_tile(j, p, i - p->first_tile, t0, (int)(j->n_tok - t0 < LEVER_TOK_TILE ? j->n_tok - t0 : LEVER_TOK_TILE));
        }
}

static int activation_kind(int type) {
    return type == LEVER_Q4_K || type == LEVER_Q6_K ? LEVER_Q4_K : type == LEVER_Q8_0 || type == LEVER_Q4_0 ||
           type == LEVER_Q5_0 ? LEVER_Q8_0 : LEVER_F32;
}

int lever_matmul_many(int n, const lever_matrix *m, const float *x, int64_t n_tok, int n_threads) {
    if (n < 1 || n > LEVER_MAX_MATRICES || n_tok < 0) return LEVER_EBAD_SHAPE;
    const int64_t n_in = m[0].n_in;
    matmul_job j = {.ks = kernels_for_isa(lever_get_isa()), .n_parts = n, .n_in = n_in, .n_tok = n_tok, .x = x};
    for (int i = 0; i < n; i++) {
        int ix;
        const lever_type_info *t = lever_type_info_of(m[i].type, &ix);
        if (!t) return LEVER_EUNSUPPORTED_TYPE;
        if (m[i].n_out < 0 || m[i].n_in != n_in || n_in < 0 || n_in % t->block) return LEVER_EBAD_SHAPE;
        if (m[i].layout != LEVER_LAYOUT_ROWS && m[i].layout != LEVER_LAYOUT_TILES) return LEVER_EBAD_SHAPE;
        const int packed = m[i].layout == LEVER_LAYOUT_TILES;
        matmul_part *p = &j.parts[i];
        p->tile = packed ? NULL : j.ks->tile[ix];
        p->packed = packed ? j.ks->packed[ix] : NULL;
        p->tile_rows = packed ? LEVER_TILE_ROWS : j.ks->rows;
        p->w = m[i].w;
        p->w_stride = n_in / t->block * t->block_bytes;
        p->n_out = m[i].n_out;
        p->n_tiles = (m[i].n_out + p->tile_rows - 1) / p->tile_rows;
        p->first_tile = j.n_tiles;
        p->y = m[i].y;
        j.n_tiles += p->n_tiles;
    }
    if (j.n_tiles == 0 || n_tok == 0) return LEVER_OK;

    int rc = LEVER_OK;
    for (int i = 0; i < n; i++) { /* each activation kind once */
        const int kind = activation_kind(m[i].type);
        int k = 0;
        while (k < j.n_kinds && j.kinds[k] != kind) k++;
        if (k == j.n_kinds && kind != LEVER_F32) {
            j.kinds[k] = kind;
            j.a_bytes[k] = act_row_bytes(kind, n_in);
            j.act[k] = aligned_alloc(64, (size_t)((n_tok * j.a_bytes[k] + 63) / 64 * 64));
            j.n_kinds++;
            if (!j.act[k]) {
                rc = LEVER_ENOMEM;
                goto out;
            }
        }
        j.parts[i].xs = kind == LEVER_F32 ? (const uint8_t *)x : j.act[k];
        j.parts[i].x_stride = kind == LEVER_F32 ? n_in * (int64_t)sizeof(float) : j.a_bytes[k];
    }
    const int nt = n_threads > 0 ? n_threads : lever_threads_default();
    lever_counter_init(&j.toks, j.n_kinds * n_tok, 1);
    /* Two chunks a thread: each thread streams long contiguous runs of rows (the tile
     * layout's prefetch reads ahead along them), and a worker that starts late still leaves
     * half its share for the others to take. */
    lever_counter_init(&j.tiles, j.n_tiles, (j.n_tiles + TILE_CHUNKS_PER_THREAD * nt - 1) / (TILE_CHUNKS_PER_THREAD * nt));
    if (j.n_kinds)  /* a token's quantization is one thread's job: only many tokens are worth splitting */
        lever_parallel(quantize_part, &j, n_tok >= 8 ? n_threads : 1);
    lever_parallel(tiles_part, &j, n_threads);
out:
    for (int k = 0; k < j.n_kinds; k++) free(j.act[k]);
    return rc;
}

int lever_matmul(int type, int layout, const void *w, int64_t n_out, int64_t n_in, const float *x,
                 int64_t n_tok, float *y, int n_threads) {
    if (!lever_type_info_of(type, NULL)) return LEVER_EUNSUPPORTED_TYPE;
    const lever_matrix m = {.type = type, .layout = layout, .w = w, .n_out = n_out, .n_in = n_in, .y = y};
    return lever_matmul_many(1, &m, x, n_tok, n_threads);
}
