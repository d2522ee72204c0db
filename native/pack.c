/* pack.c: the tile layout (lever_kernels.h), made from the row layout and undone.
 *
 * Resident weights are packed once when they load (the draft, the output head, the target's
 * resident layers); the kernels then read every tile as one sequential stream. Packing is a
 * permutation of bytes: segment by segment (quants_internal.h), `width` bytes of each of the
 * tile's rows side by side. Nothing is computed, so a packed matrix multiplies to the same
 * bits as the rows it came from.
 */
#include <stdlib.h>
#include <string.h>

#include "lever_kernels.h"
#include "quants_internal.h"
#include "threadpool.h"

int64_t lever_tiled_bytes(int type, int64_t n_out, int64_t n_in) {
    const lever_type_info *t = lever_type_info_of(type, NULL);
    if (!t || n_out < 0 || n_in < 0 || n_in % t->block) return 0;
    const int64_t n_tiles = (n_out + LEVER_TILE_ROWS - 1) / LEVER_TILE_ROWS;
    return n_tiles * LEVER_TILE_ROWS * (n_in / t->block * t->block_bytes);
}

/* The `width`-byte pieces of one segment of one block, for the tile's rows. */
static inline void pack_segment(const lever_segment *s, const uint8_t *const *rows, int64_t row_off,
                                uint8_t *dst) {
    const int n = s->bytes / s->width;
    if (s->width == 4) {
        for (int r = 0; r < LEVER_TILE_ROWS; r++)
            for (int j = 0; j < n; j++) memcpy(dst + 64 * j + 4 * r, rows[r] + row_off + 4 * j, 4);
    } else {
        for (int r = 0; r < LEVER_TILE_ROWS; r++)
            for (int j = 0; j < n; j++) memcpy(dst + 32 * j + 2 * r, rows[r] + row_off + 2 * j, 2);
    }
}

typedef struct {
    const lever_type_info *t;
    const uint8_t *src;
    uint8_t *dst;
    int64_t n_out, row_bytes, n_blocks;
    const uint8_t *zeros; /* a zero row, for the rows that pad the last tile */
    lever_counter tiles;
} pack_job;

static void pack_part(void *ctx, int ith, int nth) {
    pack_job *j = ctx;
    const lever_type_info *t = j->t;
    long long i0, i1;
    while (lever_claim(&j->tiles, &i0, &i1))
        for (int64_t i = i0; i < i1; i++) {
            const uint8_t *rows[LEVER_TILE_ROWS];
            for (int r = 0; r < LEVER_TILE_ROWS; r++) {
                const int64_t row = i * LEVER_TILE_ROWS + r;
                rows[r] = row < j->n_out ? j->src + row * j->row_bytes : j->zeros;
            }
            uint8_t *tile = j->dst + i * LEVER_TILE_ROWS * j->row_bytes;
            for (int64_t b = 0; b < j->n_blocks; b++)
                for (int s = 0; s < t->n_segments; s++) {
                    const int64_t off = b * t->block_bytes + t->segments[s].offset;
                    pack_segment(&t->segments[s], rows, off, tile + LEVER_TILE_ROWS * off);
                }
        }
}

int lever_pack(int type, const void *src, int64_t n_out, int64_t n_in, void *dst, int n_threads) {
    const lever_type_info *t = lever_type_info_of(type, NULL);
    if (!t) return LEVER_EUNSUPPORTED_TYPE;
    if (n_out < 0 || n_in < 0 || n_in % t->block) return LEVER_EBAD_SHAPE;
    const int64_t row_bytes = n_in / t->block * t->block_bytes;
    uint8_t *zeros = calloc(1, (size_t)row_bytes + 1);
    if (!zeros) return LEVER_ENOMEM;
    pack_job j = {.t = t, .src = src, .dst = dst, .n_out = n_out, .row_bytes = row_bytes,
                  .n_blocks = n_in / t->block, .zeros = zeros};
    const int64_t n_tiles = (n_out + LEVER_TILE_ROWS - 1) / LEVER_TILE_ROWS;
    lever_counter_init(&j.tiles, n_tiles, 64);
    lever_parallel(pack_part, &j, n_threads);
    free(zeros);
    return LEVER_OK;
}

void lever_unpack_row(const lever_type_info *t, const uint8_t *tile, int r, int64_t row_bytes, uint8_t *out) {
    for (int64_t b = 0; b < row_bytes / t->block_bytes; b++)
        for (int s = 0; s < t->n_segments; s++) {
            const lever_segment *seg = &t->segments[s];
            const int64_t off = b * t->block_bytes + seg->offset;
            const uint8_t *src = tile + LEVER_TILE_ROWS * off + r * seg->width;
            for (int k = 0; k < seg->bytes / seg->width; k++)
                memcpy(out + off + k * seg->width, src + k * LEVER_TILE_ROWS * seg->width, seg->width);
        }
}

int lever_unpack_rows(int type, const void *tiled, int64_t n_out, int64_t n_in, const int64_t *rows, int64_t n,
                      void *dst) {
    const lever_type_info *t = lever_type_info_of(type, NULL);
    if (!t) return LEVER_EUNSUPPORTED_TYPE;
    if (n_out < 0 || n_in < 0 || n < 0 || n_in % t->block) return LEVER_EBAD_SHAPE;
    const int64_t row_bytes = n_in / t->block * t->block_bytes;
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= n_out) return LEVER_EBAD_SHAPE;
    for (int64_t i = 0; i < n; i++) {
        const int64_t tile = rows[i] / LEVER_TILE_ROWS;
        lever_unpack_row(t, (const uint8_t *)tiled + tile * LEVER_TILE_ROWS * row_bytes,
                         (int)(rows[i] % LEVER_TILE_ROWS), row_bytes, (uint8_t *)dst + i * row_bytes);
    }
    return LEVER_OK;
}
