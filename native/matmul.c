/* matmul.c: lever_matmul, y[t, r] = sum_k W[r, k] x[t, k], the hot path of decoding.
 *
 * Steps of one call:
 *   1. quantize each token's activations once (Q8_0 blocks for Q4_0/Q5_0/Q8_0 weights,
 *      Q8_K for Q4_K/Q6_K; float types use x as it is), tokens split across threads;
 *   2. split the output rows into tiles of the ISA's width (16 rows for AVX-512); the
 *      worker pool's threads claim runs of tiles from a shared counter. A tile kernel
 *      streams its rows' weights once and applies every block to all tokens of the call (up
 *      to LEVER_TOK_TILE at a time), so tree verification with 16-64 tokens reads each
 *      weight byte once.
 * A reduction is never split: each (row, token) is summed by one kernel call in the
 * canonical order of quants_internal.h, so the result is the same for any n_tok, any
 * batch companions, any thread count or claiming order, and any ISA.
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

static lever_tile_fn tile_for_type(const lever_kernel_set *k, int type) {
    switch (type) {
    case LEVER_F32: return k->f32;
    case LEVER_F16: return k->f16;
    case LEVER_BF16: return k->bf16;
    case LEVER_Q8_0: return k->q8_0;
    case LEVER_Q4_0: return k->q4_0;
    case LEVER_Q5_0: return k->q5_0;
    case LEVER_Q4_K: return k->q4_K;
    case LEVER_Q6_K: return k->q6_K;
    default: return NULL;
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
    lever_tile_fn tile;
    int type;
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

static void tiles_part(void *ctx, int ith, int nth) {
    matmul_job *j = ctx;
    const int R = j->ks->rows;
    long long i0, i1;
    while (lever_claim(&j->tiles, &i0, &i1)) {
        for (int64_t i = i0; i < i1; i++) {
            const int64_t r0 = i * R;
            const int rows = (int)(j->n_out - r0 < R ? j->n_out - r0 : R);
            for (int64_t t0 = 0; t0 < j->n_tok; t0 += LEVER_TOK_TILE) {
                const int toks = (int)(j->n_tok - t0 < LEVER_TOK_TILE ? j->n_tok - t0 : LEVER_TOK_TILE);
                j->tile(j->w + r0 * j->w_stride, j->w_stride, rows, j->n_in, j->xs + t0 * j->x_stride,
                        j->x_stride, toks, j->y + t0 * j->n_out + r0, j->n_out);
            }
        }
    }
}

int lever_matmul(int type, const void *w, int64_t n_out, int64_t n_in, const float *x,
                 int64_t n_tok, float *y, int n_threads) {
    int block_bytes;
    const int block = lever_type_block(type, &block_bytes);
    if (!block) return LEVER_EUNSUPPORTED_TYPE;
    if (n_out < 0 || n_in < 0 || n_tok < 0 || n_in % block) return LEVER_EBAD_SHAPE;
    if (n_out == 0 || n_tok == 0) return LEVER_OK;

    const lever_kernel_set *ks = kernels_for_isa(lever_get_isa());
    const lever_tile_fn tile = tile_for_type(ks, type);
    const int64_t w_stride = n_in / block * block_bytes;

    const int64_t a_bytes = act_row_bytes(type, n_in);
    uint8_t *act = NULL;
    if (a_bytes) {
        act = aligned_alloc(64, (size_t)((n_tok * a_bytes + 63) / 64 * 64));
        if (!act) return LEVER_ENOMEM;
    }
    const uint8_t *xs = a_bytes ? act : (const uint8_t *)x;
    const int64_t x_stride = a_bytes ? a_bytes : n_in * (int64_t)sizeof(float);

    matmul_job j = {.ks = ks, .tile = tile, .type = type, .w = (const uint8_t *)w, .w_stride = w_stride,
                    .n_out = n_out, .n_in = n_in, .n_tok = n_tok, .n_tiles = (n_out + ks->rows - 1) / ks->rows,
                    .a_bytes = a_bytes, .x_stride = x_stride, .x = x, .act = act, .xs = xs, .y = y};
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
