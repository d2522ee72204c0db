/* quants_internal.h: what the quantization and matmul files share, and nothing else sees.
 *
 * Block layouts are ggml's, byte for byte, because the weights are GGUF tensors streamed
 * from flash without repacking. fp16 <-> fp32 helpers are bit exact (round to nearest
 * even), so every ISA converts scales identically.
 *
 * The matmul kernels all follow one reduction order, the canonical one, so that scalar,
 * AVX2, AVX-512 and NEON give bit-identical results for every type:
 *   acc = 0
 *   for each weight block b, in order:          (block = 32 or 256 weights, 1 for float types)
 *       isum = exact integer dot of the block   (int32 for quantized types)
 *       acc  = fmaf((float)isum, d_w[b] * d_x[b], acc)
 *       (Q4_K then also: acc = fmaf(-(float)msum, dmin_w[b] * d_x[b], acc))
 *   float types: acc = fmaf(w[k], x[k], acc) for k in order.
 * Integer sums are associative, so SIMD may add them in any order; only the float steps are
 * ordered, and they are per (row, token): y[t, r] never depends on other rows or tokens.
 */
#ifndef LEVER_QUANTS_INTERNAL_H
#define LEVER_QUANTS_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "lever_kernels.h"

#define QK8_0 32
#define QK_K 256

typedef struct {
    uint16_t d; /* fp16 */
    int8_t qs[QK8_0];
} block_q8_0;

typedef struct {
    uint16_t d;               /* fp16 */
    uint8_t qs[QK8_0 / 2];    /* element j: low nibble of qs[j]; element j + 16: high nibble */
} block_q4_0;

typedef struct {
    uint16_t d;               /* fp16 */
    uint8_t qh[4];            /* bit j: fifth bit of element j */
    uint8_t qs[QK8_0 / 2];    /* low four bits, laid out as in Q4_0 */
} block_q5_0;

typedef struct {
    uint16_t d;               /* fp16 super-block scale of the 6-bit sub-block scales */
    uint16_t dmin;            /* fp16 super-block scale of the 6-bit sub-block mins */
    uint8_t scales[12];       /* 8 scales and 8 mins, 6 bits each (see q4_K_scale_min) */
    uint8_t qs[QK_K / 2];     /* 64-element chunk c: low nibbles of qs[32c..] then high */
} block_q4_K;

typedef struct {
    uint8_t ql[QK_K / 2];     /* low four bits */
    uint8_t qh[QK_K / 4];     /* high two bits */
    int8_t scales[QK_K / 16]; /* one per 16 elements */
    uint16_t d;               /* fp16 */
} block_q6_K;

/* Activations for Q4_K/Q6_K, as ggml's quantize_row_q8_K makes them. */
typedef struct {
    float d;
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16]; /* sum of each 16 qs */
} block_q8_K;

/* Activations for Q4_0/Q5_0/Q8_0: ggml's block_q8_0 (d rounded to fp16, qs as
 * quantize_row_q8_0_ref), with d already widened to float and the sum of qs, which the
 * SIMD kernels need to undo the offset they give the weights. */
typedef struct {
    float d;
    int32_t sum;
    int8_t qs[QK8_0];
} lever_q8_0x;

_Static_assert(sizeof(block_q8_0) == 34, "block_q8_0 layout");
_Static_assert(sizeof(block_q4_0) == 18, "block_q4_0 layout");
_Static_assert(sizeof(block_q5_0) == 22, "block_q5_0 layout");
_Static_assert(sizeof(block_q4_K) == 144, "block_q4_K layout");
_Static_assert(sizeof(block_q6_K) == 210, "block_q6_K layout");
_Static_assert(sizeof(block_q8_K) == 292, "block_q8_K layout");
_Static_assert(sizeof(lever_q8_0x) == 40, "lever_q8_0x layout");

static inline float lever_fp32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t lever_fp32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float lever_fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1f;
    const uint32_t mant = h & 0x3ff;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24 is exact in float */
        const float v = (float)mant * 0x1p-24f;
        return lever_fp32_from_bits(lever_fp32_to_bits(v) | sign);
    }
    if (exp == 31) return lever_fp32_from_bits(sign | 0x7f800000u | (mant << 13));
    return lever_fp32_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
}

/* Round to nearest even, like F16C's vcvtps2ph and numpy's astype(float16). */
static inline uint16_t lever_fp32_to_fp16(float f) {
    const uint32_t u = lever_fp32_to_bits(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00; /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00; /* rounds to or past 65520: inf */
    if (a < 0x38800000u) {
        /* result is subnormal in fp16: a float add rounds it at the 2^-24 grid for us */
        const float r = lever_fp32_from_bits(a) + 0.5f; /* 0.5 = 2^-1: ulp of r is 2^-24 */
        return sign | (uint16_t)(lever_fp32_to_bits(r) - lever_fp32_to_bits(0.5f));
    }
    /* normal: drop 13 mantissa bits with round to nearest even, carry may bump exponent */
    const uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);
    return sign | (uint16_t)((rounded - (112u << 23)) >> 13);
}

static inline float lever_bf16_to_fp32(uint16_t h) {
    return lever_fp32_from_bits((uint32_t)h << 16);
}

/* Q4_K packs 8 scales and 8 mins of 6 bits into 12 bytes: j < 4 in the low 6 bits of bytes
 * j and j + 4; j >= 4 in a nibble of byte j + 4 plus the top 2 bits of bytes j - 4, j. */
static inline void q4_K_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---- the tensor types, in one table (quants.c), mirrored by lever/gguf/types.py -------- */

/* A run of a block's bytes and how the tile layout interleaves it: `width` bytes of each
 * of the tile's rows side by side (2: an fp16 scale, 4: a group of quants that one 32-bit
 * lane holds). A segment of n bytes takes LEVER_TILE_ROWS * n bytes of the tile, so byte
 * `off` of a row's block lands at LEVER_TILE_ROWS * off in the tile's block. */
typedef struct {
    uint8_t offset, bytes, width;
} lever_segment;

#define LEVER_MAX_SEGMENTS 3
#define LEVER_N_TYPES 8

typedef struct {
    int type;        /* enum lever_type */
    int block;       /* weights per block */
    int block_bytes; /* bytes per block */
    int n_segments;
    lever_segment segments[LEVER_MAX_SEGMENTS];
} lever_type_info;

/* The type's row of the table, or NULL if Lever does not compute with it; `index` is its
 * dense position (0..LEVER_N_TYPES-1), which the kernel sets are indexed by. */
const lever_type_info *lever_type_info_of(int type, int *index);

/* Block size (weights) and bytes of `type`; 0 if Lever does not compute with it. */
int lever_type_block(int type, int *block_bytes);

/* Row r (< LEVER_TILE_ROWS) of a packed tile back in the row layout: row_bytes into out. */
void lever_unpack_row(const lever_type_info *t, const uint8_t *tile, int r, int64_t row_bytes, uint8_t *out);

/* ---- quantization of activations (quants.c) ---------------------------------------- */

/* ggml quantize_row_q8_0_ref: d = amax / 127 rounded to fp16, q = roundf(x / d). */
void lever_quantize_row_q8_0x(const float *x, lever_q8_0x *y, int64_t n);
/* ggml quantize_row_q8_K_ref: d = max / -127 of the largest-magnitude x, q rounded to
 * nearest even and capped at 127, bsums per 16. */
void lever_quantize_row_q8_K(const float *x, block_q8_K *y, int64_t n);

/* ---- tile kernels ------------------------------------------------------------------- */

/* A tile's rows are contiguous, so the next tile's weights are the next `bytes` bytes after
 * this tile's. Block b of nb prefetches its share of them, one touch per cache line: the
 * stream of the matrix stays ahead of the kernel without relying on the hardware
 * prefetchers, which lose track of the 16 interleaved row streams of a tile. */
#ifndef LEVER_SW_PREFETCH
#define LEVER_SW_PREFETCH 1
#endif
static inline void lever_prefetch_share(const uint8_t *next, int64_t bytes, int64_t b, int64_t nb) {
    for (int64_t o = bytes * b / nb / 64 * 64; o < bytes * (b + 1) / nb; o += 64)
        if (LEVER_SW_PREFETCH) __builtin_prefetch(next + o, 0, 3);
}

/* Tile layout: a tile is read front to back, but a block's fields are not consumed in byte
 * order (Q6_K reads its scales at the end first), which the hardware prefetchers take for
 * a new stream each time: cold, the Q6_K output head ran at 6.6 GB/s a core. So each block
 * asks for the bytes PREFETCH_AHEAD further on, into L2 (prefetcht1), whatever it reads.
 * 8 KiB measured best on Zen 4 (4 KiB: 13.5 ms for the 1.5B head on one core, 8 KiB: 9.2,
 * 16 KiB: 9.1; two cores 7.1 / 5.5 / 5.8 ms); into L1 (prefetcht0) it was slower. */
#ifndef LEVER_PREFETCH_AHEAD
#define LEVER_PREFETCH_AHEAD 8192
#endif
#ifndef LEVER_PREFETCH_HINT
#define LEVER_PREFETCH_HINT 2
#endif

static inline void lever_prefetch_ahead(const uint8_t *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + LEVER_PREFETCH_AHEAD + o, 0, LEVER_PREFETCH_HINT);
}

/* Most tokens a tile kernel takes at once: its per-token state lives on the stack. */
#define LEVER_TOK_TILE 64

/* One slice of a packed tile (tile layout): rows sub * rows .. sub * rows + n_rows - 1 of
 * the LEVER_TILE_ROWS rows that start at `tile`, written to y[t * ldy + r] for r < n_rows;
 * x as for lever_tile_fn. */
typedef void (*lever_packed_fn)(const uint8_t *tile, int sub, int n_rows, int64_t n_in, const uint8_t *x,
                                int64_t x_stride, int n_tok, float *y, int64_t ldy);

/* One tile of the output: y[t * ldy + r] for r < n_rows, t < n_tok, where row r of the
 * weights starts at w + r * w_stride and token t's activations (float, or quantized blocks
 * for quantized types) start at x + t * x_stride. n_rows <= the ISA's rows per tile,
 * n_tok <= LEVER_TOK_TILE. */
typedef void (*lever_tile_fn)(const uint8_t *w, int64_t w_stride, int n_rows, int64_t n_in,
                              const uint8_t *x, int64_t x_stride, int n_tok, float *y,
                              int64_t ldy);

/* The same set of kernels for every ISA: the activation quantizers (bit-identical to the
 * scalar ones above) and one tile kernel per weight type. */
typedef struct {
    int rows; /* rows per tile: the SIMD width in 32-bit lanes (divides LEVER_TILE_ROWS) */
    void (*quantize_q8_0x)(const float *x, lever_q8_0x *y, int64_t n);
    void (*quantize_q8_K)(const float *x, block_q8_K *y, int64_t n);
    lever_tile_fn tile[LEVER_N_TYPES];     /* row layout, by the type's dense index */
    lever_packed_fn packed[LEVER_N_TYPES]; /* tile layout */
} lever_kernel_set;

/* Dense indices of the table's rows (quants.c lists the types in this order). */
enum { LEVER_IX_F32, LEVER_IX_F16, LEVER_IX_BF16, LEVER_IX_Q8_0, LEVER_IX_Q4_0, LEVER_IX_Q5_0, LEVER_IX_Q4_K,
       LEVER_IX_Q6_K };

/* A kernel set's tables, filled by name: KERNEL_TABLE(tile, avx2) lists tile_f32_avx2, ... */
#define LEVER_KERNEL_TABLE(kind, isa)                                                                     \
    {                                                                                                   \
        [LEVER_IX_F32] = kind##_f32_##isa, [LEVER_IX_F16] = kind##_f16_##isa,                             \
        [LEVER_IX_BF16] = kind##_bf16_##isa, [LEVER_IX_Q8_0] = kind##_q8_0_##isa,                         \
        [LEVER_IX_Q4_0] = kind##_q4_0_##isa, [LEVER_IX_Q5_0] = kind##_q5_0_##isa,                         \
        [LEVER_IX_Q4_K] = kind##_q4_K_##isa, [LEVER_IX_Q6_K] = kind##_q6_K_##isa,                         \
    }

extern const lever_kernel_set lever_kernels_scalar;
#if defined(LEVER_HAVE_X86)
extern const lever_kernel_set lever_kernels_avx2;
extern const lever_kernel_set lever_kernels_avx512;
#endif
#if defined(LEVER_HAVE_NEON)
extern const lever_kernel_set lever_kernels_neon;
#endif

#endif
