/* arm64_parity.c: the NEON kernels against the scalar reference, on arm64 (or under qemu).
 *
 * tests/native/test_arm64_build.py cross-compiles this with the library for arm64 and runs it
 * where an arm64 CPU or qemu-aarch64 is at hand. On x86 the scalar kernels equal the numpy
 * reference bit for bit (test_matmul.py), so NEON equal to scalar here closes the loop.
 * Every type, both weight layouts, a partial tile and 1, 5 and 70 tokens, and dequantization,
 * bit for bit; rmsnorm bit for bit too; attention and swiglu within test_ops.py's tolerances
 * (each ISA has its own exp). Prints one line per failure and a summary; exit status 1 on any.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lever_kernels.h"

static uint64_t state = 0x9e3779b97f4a7c15ull;

static uint32_t next_u32(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 16);
}

static float uniform(void) { return (float)next_u32() / 4294967296.0f * 2.0f - 1.0f; }

static uint16_t half_of(float f) {
    _Float16 h = (_Float16)f;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}

static int failures = 0;

static void expect_equal(const char *what, const float *a, const float *b, int64_t n) {
    if (memcmp(a, b, (size_t)n * sizeof(float)) != 0) {
        int64_t i = 0;
        while (i < n && memcmp(a + i, b + i, sizeof(float)) == 0) i++;
        printf("FAIL %s: element %lld: %.9g vs %.9g\n", what, (long long)i, (double)a[i], (double)b[i]);
        failures++;
    }
}

/* Weights whose fp16 fields are small finite scales and whose float types are finite. */
/* For the operators whose SIMD paths use their own exp (test_ops.py's tolerances). */
static void expect_close(const char *what, const float *a, const float *b, int64_t n, float rtol, float atol) {
    for (int64_t i = 0; i < n; i++)
        if (!(fabsf(a[i] - b[i]) <= atol + rtol * fabsf(b[i]))) {
            printf("FAIL %s: element %lld: %.9g vs %.9g\n", what, (long long)i, (double)a[i], (double)b[i]);
            failures++;
            return;
        }
}

static void fill_weights(int type, uint8_t *w, int64_t n_rows, int64_t n_in) {
    int block, bb, seg[9];
    const int n_seg = lever_type_layout(type, &block, &bb, seg);
    const int64_t nb = n_in / block;
    for (int64_t r = 0; r < n_rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = w + (r * nb + b) * bb;
            if (type == LEVER_F32) {
                const float f = uniform();
                memcpy(blk, &f, 4);
                continue;
            }
            if (type == LEVER_F16 || type == LEVER_BF16) {
                const float f = uniform();
                uint32_t u;
                memcpy(&u, &f, 4);
                const uint16_t h = type == LEVER_F16 ? half_of(f) : (uint16_t)(u >> 16);
                memcpy(blk, &h, 2);
                continue;
            }
            for (int s = 0; s < n_seg; s++)
                for (int o = 0; o < seg[3 * s + 1]; o++) blk[seg[3 * s] + o] = (uint8_t)next_u32();
            for (int s = 0; s < n_seg; s++)
                if (seg[3 * s + 2] == 2) {
                    const uint16_t h = half_of(0.001f + 0.01f * fabsf(uniform()));
                    memcpy(blk + seg[3 * s], &h, 2);
                }
            if (type == LEVER_Q4_K) { /* d and dmin share the first 32-bit group */
                const uint16_t d = half_of(0.001f + 0.01f * fabsf(uniform())), m = half_of(0.001f * fabsf(uniform()));
                memcpy(blk, &d, 2);
                memcpy(blk + 2, &m, 2);
            }
        }
}

static void check_type(int type, const char *name) {
    int block, bb, seg[9];
    lever_type_layout(type, &block, &bb, seg);
    const int64_t n_in = block == 256 ? 512 : block == 32 ? 160 : type == LEVER_F32 ? 172 : 96, n_out = 37;
    const int64_t row_bytes = n_in / block * bb;
    uint8_t *w = malloc((size_t)(n_out * row_bytes));
    uint8_t *tiled = malloc((size_t)lever_tiled_bytes(type, n_out, n_in));
    float *x = malloc((size_t)(70 * n_in) * sizeof(float));
    float *y[3];
    for (int i = 0; i < 3; i++) y[i] = malloc((size_t)(70 * n_out) * sizeof(float));
    fill_weights(type, w, n_out, n_in);
    lever_pack(type, w, n_out, n_in, tiled, 1);
    for (int64_t i = 0; i < 70 * n_in; i++) x[i] = uniform() * (i % 97 == 0 ? 30.0f : 1.0f);
    const int toks[3] = {1, 5, 70};
    for (int k = 0; k < 3; k++) {
        char what[96];
        lever_set_isa(LEVER_ISA_SCALAR);
        lever_matmul(type, LEVER_LAYOUT_ROWS, w, n_out, n_in, x, toks[k], y[0], 1);
        lever_set_isa(LEVER_ISA_NEON);
        lever_matmul(type, LEVER_LAYOUT_ROWS, w, n_out, n_in, x, toks[k], y[1], 2);
        lever_matmul(type, LEVER_LAYOUT_TILES, tiled, n_out, n_in, x, toks[k], y[2], 2);
        snprintf(what, sizeof what, "matmul %s rows, %d tokens", name, toks[k]);
        expect_equal(what, y[1], y[0], toks[k] * n_out);
        snprintf(what, sizeof what, "matmul %s tiles, %d tokens", name, toks[k]);
        expect_equal(what, y[2], y[0], toks[k] * n_out);
    }
    float *d0 = malloc((size_t)(n_out * n_in) * sizeof(float)), *d1 = malloc((size_t)(n_out * n_in) * sizeof(float));
    lever_set_isa(LEVER_ISA_SCALAR);
    lever_dequantize(type, w, n_out, n_in, d0);
    lever_set_isa(LEVER_ISA_NEON);
    lever_dequantize(type, w, n_out, n_in, d1);
    expect_equal("dequantize", d1, d0, n_out * n_in);
    free(d0), free(d1), free(w), free(tiled), free(x);
    for (int i = 0; i < 3; i++) free(y[i]);
}

static void check_ops(void) {
    enum { T = 6, H = 4, KVH = 2, D = 64, N = 256, KV = 11 };
    static float x[T * N], wn[N], o[2][T * N], q[T * H * D], att[2][T * H * D], kf[KV * KVH * D], vf[KV * KVH * D];
    static uint8_t mask[T * KV];
    for (int i = 0; i < T * N; i++) x[i] = uniform() * 3.0f;
    for (int i = 0; i < N; i++) wn[i] = uniform();
    for (int i = 0; i < T * H * D; i++) q[i] = uniform();
    for (int i = 0; i < KV * KVH * D; i++) kf[i] = uniform(), vf[i] = uniform();
    for (int i = 0; i < T * KV; i++) mask[i] = (uint8_t)(next_u32() % 3 != 0);
    for (int isa = 0; isa < 2; isa++) {
        lever_set_isa(isa ? LEVER_ISA_NEON : LEVER_ISA_SCALAR);
        lever_rmsnorm(x, wn, T, N, 1e-6f, o[isa]);
        lever_attention(q, T, H, D, kf, vf, LEVER_F32, KV, KVH, mask, 0.125f, att[isa], 2);
    }
    expect_equal("rmsnorm", o[1], o[0], T * N);
    expect_close("attention", att[1], att[0], T * H * D, 0.0f, 1e-5f); /* ATTN_ATOL_SIMD */
    for (int isa = 0; isa < 2; isa++) {
        lever_set_isa(isa ? LEVER_ISA_NEON : LEVER_ISA_SCALAR);
        lever_swiglu(x, wn, N, o[isa]);
    }
    expect_close("swiglu", o[1], o[0], N, 2e-6f, 1e-30f); /* SWIGLU_RTOL_SIMD */
}

int main(void) {
    if (lever_set_isa(LEVER_ISA_NEON) != LEVER_ISA_NEON) {
        printf("FAIL: no NEON path in this build\n");
        return 1;
    }
    const int types[8] = {LEVER_F32, LEVER_F16, LEVER_BF16, LEVER_Q8_0, LEVER_Q4_0, LEVER_Q5_0, LEVER_Q4_K, LEVER_Q6_K};
    const char *names[8] = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"};
    for (int i = 0; i < 8; i++) check_type(types[i], names[i]);
    check_ops();
    printf("%s: %d failures (8 types x 2 layouts x 3 token counts, dequantize, rmsnorm, attention, swiglu)\n",
           failures ? "FAIL" : "ok", failures);
    return failures != 0;
}
