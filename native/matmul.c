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

/* One call's work, shared by the threads of the pool. */
typedef struct {
    const lever_kernel_set *ks;
    lever_tile_fn tile;     /* row layout */
    lever_packed_fn packed; /* tile layout */
    int type, tile_rows;
    const uint8_t *w;
    int64_t w_stride, n_out, n_in, n_tok, n_tiles, a_bytes, x_stride;
    const float *x;
    uint8_t *act;
    const uint8_t *xs;
    float *y;
    lever_counter toks, tiles;
} matmul_job;

static void quantize_part(void *ctx, int ith, int nth) {
    matmul_job *j = ctx;
    long long t0, t1;
    while (lever_claim(&j->toks, &t0, &t1))
        for (int64_t t = t0; t < t1; t++)
            quantize_activation(j->ks, j->type, j->x + t * j->n_in, j->n_in, j->act + t * j->a_bytes);
}

/* Tile i, tokens t0..t0+toks-1. A packed tile is LEVER_TILE_ROWS rows, computed as slices
 * of the ISA's width. */
static void one_tile(const matmul_job *j, int64_t i, int64_t t0, int toks) {
    const int64_t r0 = i * j->tile_rows;
    const int rows = (int)(j->n_out - r0 < j->tile_rows ? j->n_out - r0 : j->tile_rows);
    const uint8_t *x = j->xs + t0 * j->x_stride;
    float *y = j->y + t0 * j->n_out + r0;
    if (!j->packed) {
        j->tile(j->w + r0 * j->w_stride, j->w_stride, rows, j->n_in, x, j->x_stride, toks, y, j->n_out);
        return;
    }
    const uint8_t *tile = j->w + r0 * j->w_stride;
    const int R = j->ks->rows;
    for (int sub = 0; sub * R < rows; sub++) {
        const int n = rows - sub * R < R ? rows - sub * R : R;
        j->packed(tile, sub, n, j->n_in, x, j->x_stride, toks, y + sub * R, j->n_out);
    }
}

static void tiles_part(void *ctx, int ith, int nth) {
    matmul_job *j = ctx;
    long long i0, i1;
    while (lever_claim(&j->tiles, &i0, &i1))
        for (int64_t i = i0; i < i1; i++)
            for (int64_t t0 = 0; t0 < j->n_tok; t0 += LEVER_TOK_TILE)
                one_tile(j, i, t0, (int)(j->n_tok - t0 < LEVER_TOK_TILE ? j->n_tok - t0 : LEVER_TOK_TILE));
}

int lever_matmul(int type, int layout, const void *w, int64_t n_out, int64_t n_in, const float *x,
                 int64_t n_tok, float *y, int n_threads) {
    int ix;
    const lever_type_info *t = lever_type_info_of(type, &ix);
    if (!t) return LEVER_EUNSUPPORTED_TYPE;
    if (n_out < 0 || n_in < 0 || n_tok < 0 || n_in % t->block) return LEVER_EBAD_SHAPE;
    if (layout != LEVER_LAYOUT_ROWS && layout != LEVER_LAYOUT_TILES) return LEVER_EBAD_SHAPE;
    if (n_out == 0 || n_tok == 0) return LEVER_OK;

    const lever_kernel_set *ks = kernels_for_isa(lever_get_isa());
    const int packed = layout == LEVER_LAYOUT_TILES;
    const int64_t w_stride = n_in / t->block * t->block_bytes;

    const int64_t a_bytes = act_row_bytes(type, n_in);
    uint8_t *act = NULL;
    if (a_bytes) {
        act = aligned_alloc(64, (size_t)((n_tok * a_bytes + 63) / 64 * 64));
        if (!act) return LEVER_ENOMEM;
    }
    const int tile_rows = packed ? LEVER_TILE_ROWS : ks->rows;
    matmul_job j = {.ks = ks, .tile = packed ? NULL : ks->tile[ix], .packed = packed ? ks->packed[ix] : NULL,
                    .type = type, .tile_rows = tile_rows, .w = (const uint8_t *)w, .w_stride = w_stride,
                    .n_out = n_out, .n_in = n_in, .n_tok = n_tok, .n_tiles = (n_out + tile_rows - 1) / tile_rows,
                    .a_bytes = a_bytes, .x_stride = a_bytes ? a_bytes : n_in * (int64_t)sizeof(float), .x = x,
                    .act = act, .xs = a_bytes ? act : (const uint8_t *)x, .y = y};
    const int nt = n_threads > 0 ? n_threads : lever_threads_default();
    lever_counter_init(&j.toks, n_tok, 1);
    /* Two chunks a thread: each thread streams long contiguous runs of rows, which the tile
     * kernels' prefetch of the next tile relies on (one chunk a thread: 20.2 ms for the 1.5B
     * model's matrices at decode, two: 21.2, eight: 29.1), and a worker that starts late still
     * leaves half its share for the others to take. */
    lever_counter_init(&j.tiles, j.n_tiles, (j.n_tiles + TILE_CHUNKS_PER_THREAD * nt - 1) / (TILE_CHUNKS_PER_THREAD * nt));
    if (a_bytes)  /* a token's quantization is one thread's job: only many tokens are worth splitting */
        lever_parallel(quantize_part, &j, n_tok >= 8 ? n_threads : 1);
    lever_parallel(tiles_part, &j, n_threads);
    free(act);
    return LEVER_OK;
}
