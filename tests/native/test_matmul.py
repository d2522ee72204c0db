"""native matmul against lever.model.reference.quants on every ISA this CPU runs and in both weight
layouts (GGUF's rows, Lever's tiles), its batch-invariance contract, and its error against a
float64 product.

Every ISA reduces each (row, token) in the same canonical order (native/quants_internal.h):
exact integer block sums, then float32 fused multiply-adds block by block, whichever layout
the weights are in. So scalar C, AVX2, AVX-512, NEON and the numpy reference agree bit for bit
and are compared with assert_array_equal; the float64 comparison carries the tolerances.
"""

from __future__ import annotations

import numpy as np
import pytest

from lever.backends.cpu import native
from lever.errors import LeverError
from lever.gguf.types import TYPES
from lever.model.reference import quants as ref
from tests.native.test_quants import TYPE_NAMES, random_weights, real_tensor_rows, rng_for

# Against float64 x @ W.T. Quantized types: each activation moves by at most half a
# quantization step, amax / 254 of its block (with 0.1% slack for the float32 arithmetic of
# the quantizer); Q8_0 also rounds the step to fp16, which moves a value by up to 127 times
# that rounding (relative 2^-11, or absolute 2^-25 where the step is subnormal in fp16).
# Summed against |W|, that bounds the error of every output.
HALF_STEP = 1.001 / 254
# Float32 accumulation: n sequential fused steps err by at most n * 2^-24 of sum |w x|
# (the standard first-order bound), for every type on top of the above.
F32_UNIT_ROUNDOFF = 2.0**-24

ISAS = [isa for isa in ("scalar", "avx2", "avx512", "neon") if native.set_isa(isa) == isa]
native.set_isa(native.best_isa())

# n_in per type for the small cases: two blocks or more, F32 off any SIMD width (172).
N_IN = {"F32": 172, "F16": 96, "BF16": 96, "Q8_0": 160, "Q4_0": 160, "Q5_0": 160, "Q4_K": 512, "Q6_K": 512}
N_OUT = 37  # a partial tile for every ISA width (4, 8, 16)
N_TOK = 37


@pytest.fixture(params=ISAS)
def isa(request):
    native.set_isa(request.param)
    yield request.param
    native.set_isa(native.best_isa())


@pytest.fixture(params=["rows", "tiles"])
def layout(request):
    return request.param


def mm(tid: int, w, n_out: int, n_in: int, x: np.ndarray, layout: str, **kw) -> np.ndarray:
    """native.matmul of row-layout weights w, packed into the tile layout first for "tiles"."""
    if layout == "tiles":
        return native.matmul(tid, native.pack(tid, w, n_out, n_in), n_out, n_in, x, layout=native.TILES, **kw)
    return native.matmul(tid, w, n_out, n_in, x, **kw)


def activations(rng, n_tok: int, n_in: int) -> np.ndarray:
    """Normal rows, plus the awkward ones: all zero, tiny, huge, one zero block, and one
    whose quantization step is exactly 1 with halves to round (Q8_0 rounds them away from
    zero, Q8_K to even)."""
    x = rng.standard_normal((max(n_tok, 6), n_in)).astype(np.float32)
    x[1] = 0
    x[2] *= np.float32(1e-6)
    x[3] *= np.float32(1e4)
    x[4, :32] = 0
    x[5] = rng.integers(-100, 100, n_in) + np.float32(0.5)
    x[5, ::32] = -127  # each block's largest magnitude, first in the block: step 1
    return x[:n_tok]


def case(name: str, n_out: int = N_OUT, n_tok: int = N_TOK, n_in: int | None = None):
    rng = rng_for("matmul", name, n_out, n_tok, n_in)
    n_in = n_in or N_IN[name]
    return TYPES[name].ggml_id, random_weights(rng, name, n_out, n_in), n_out, n_in, activations(rng, n_tok, n_in)


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_matches_reference_bit_for_bit(name, isa, layout):
    tid, w, n_out, n_in, x = case(name)
    np.testing.assert_array_equal(mm(tid, w, n_out, n_in, x, layout), ref.matmul(tid, w, n_out, n_in, x))


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_batch_invariance(name, isa, layout):
    """Each token's row is the same alone, in any batch, in any order, on 1 or 2 threads."""
    tid, w, n_out, n_in, x = case(name)
    batch = mm(tid, w, n_out, n_in, x, layout, n_threads=2)
    np.testing.assert_array_equal(mm(tid, w, n_out, n_in, x, layout, n_threads=1), batch)
    for t in range(x.shape[0]):
        np.testing.assert_array_equal(mm(tid, w, n_out, n_in, x[t : t + 1], layout), batch[t : t + 1])
    perm = rng_for("perm", name).permutation(x.shape[0])
    np.testing.assert_array_equal(mm(tid, w, n_out, n_in, x[perm], layout, n_threads=2), batch[perm])
    others = activations(rng_for("others", name), 11, n_in)
    mixed = np.concatenate([others[:5], x[7:9], others[5:]])
    np.testing.assert_array_equal(mm(tid, w, n_out, n_in, mixed, layout)[5:7], batch[7:9])


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_layouts_agree_bit_for_bit(name, isa):
    """The same matrix in rows and in tiles gives the same bits, for every token count the
    kernels treat differently (one, a partial token tile, many)."""
    for n_out, n_tok in ((1, 1), (16, 3), (33, 70)):
        tid, w, n_out, n_in, x = case(name, n_out=n_out, n_tok=n_tok)
        np.testing.assert_array_equal(mm(tid, w, n_out, n_in, x, "tiles"), mm(tid, w, n_out, n_in, x, "rows"))


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_many_tokens_split_into_token_tiles(name, layout):
    """130 tokens run as several token tiles inside the kernels: rows stay the same."""
    tid, w, n_out, n_in, x = case(name, n_out=21, n_tok=130)
    batch = mm(tid, w, n_out, n_in, x, layout)
    for t in (0, 63, 64, 127, 128, 129):
        np.testing.assert_array_equal(mm(tid, w, n_out, n_in, x[t : t + 1], layout)[0], batch[t])


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_pack_is_the_reference_pack_and_unpacks(name):
    """native.pack equals the numpy reference (lever/model/reference/quants.py) built from
    lever/gguf/types.py's tile_segments, for whole and partial tiles; unpack_rows gives back any
    rows asked for, in their order."""
    t = TYPES[name]
    for n_out in (1, 15, 16, 17, 50):
        n_in = N_IN[name]
        w = random_weights(rng_for("pack", name, n_out), name, n_out, n_in)
        packed = native.pack(t.ggml_id, w, n_out, n_in)
        np.testing.assert_array_equal(packed, ref.pack(t.ggml_id, w, n_out, n_in))
        assert packed.nbytes == t.tiled_bytes(n_out, n_in) == native.tiled_bytes(t.ggml_id, n_out, n_in)
        rows = rng_for("rows", name, n_out).integers(0, n_out, 9)
        np.testing.assert_array_equal(native.unpack_rows(t.ggml_id, packed, n_out, n_in, rows),
                                      np.asarray(w).reshape(n_out, -1)[rows])
    with pytest.raises(LeverError, match="bad shape"):
        native.unpack_rows(t.ggml_id, packed, n_out, n_in, np.array([n_out]))


def test_type_table_is_the_native_table():
    """lever/gguf/types.py's TYPES and native/quants.c's TYPE_INFO state the same facts."""
    for t in TYPES.values():
        assert native.type_layout(t.ggml_id) == (t.block_elems, t.block_bytes, t.tile_segments), t.name
        assert sum(n for _, n, _ in t.tile_segments) == t.block_bytes
    with pytest.raises(LeverError, match="unsupported"):
        native.type_layout(3)


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_close_to_float64_product(name):
    tid, w, n_out, n_in, x = case(name)
    W = ref.dequantize(tid, w, n_out, n_in).astype(np.float64)
    x64 = x.astype(np.float64)
    y = native.matmul(tid, w, n_out, n_in, x)
    scale = np.abs(x64) @ np.abs(W).T
    bound = n_in * F32_UNIT_ROUNDOFF * scale
    act = TYPES[name].activation
    if act != "f32":
        block = 256 if act == "q8_K" else 32
        amax = np.abs(x64).reshape(x.shape[0], -1, block).max(axis=-1)
        per_value = HALF_STEP * amax
        if act == "q8_0":
            step = (amax / 127).astype(np.float32)
            per_value += 127 * np.abs(step.astype(np.float16).astype(np.float64) - step)
        bound = bound + np.repeat(per_value, block, axis=1) @ np.abs(W).T
    err = np.abs(y - x64 @ W.T)
    assert (err <= bound).all(), f"worst error / bound: {(err / np.maximum(bound, 1e-300)).max()}"
    assert (y[1] == 0).all()  # an all-zero token gives exact zeros


REAL_N_IN = [("Q8_0", 896), ("Q4_0", 896), ("Q5_0", 896), ("Q5_0", 4864), ("Q8_0", 8960), ("Q4_K", 1536),
             ("Q4_K", 8960), ("Q6_K", 1536), ("Q6_K", 4864), ("Q6_K", 8960), ("F16", 1536), ("BF16", 896),
             ("F32", 64)]


@pytest.mark.parametrize("name,n_in", REAL_N_IN)
def test_model_widths(name, n_in, isa, layout):
    """The row widths of the Qwen2.5 0.5B/1.5B matrices, every ISA, against the reference."""
    tid, w, n_out, n_in, x = case(name, n_out=24, n_tok=6, n_in=n_in)
    np.testing.assert_array_equal(mm(tid, w, n_out, n_in, x, layout), ref.matmul(tid, w, n_out, n_in, x))


def test_errors_and_empty_shapes():
    w = np.zeros((4, 34), np.uint8)
    x = np.zeros((2, 32), np.float32)
    with pytest.raises(LeverError, match="unsupported"):
        native.matmul(3, w, 4, 32, x)
    with pytest.raises(LeverError, match="bad shape"):
        native.matmul(TYPES["Q4_K"].ggml_id, np.zeros((4, 144), np.uint8), 4, 128, np.zeros((2, 128), np.float32))
    with pytest.raises(LeverError, match="bad shape"):
        native.matmul(TYPES["Q8_0"].ggml_id, w, 4, 33, np.zeros((2, 33), np.float32))
    assert native.matmul(TYPES["Q8_0"].ggml_id, w, 4, 32, np.zeros((0, 32), np.float32)).shape == (0, 4)


def test_vocab_sized_output(layout):
    """151936 rows (the Qwen vocab): thread split and tiles over a large n_out."""
    tid, w, n_out, n_in, x = case("Q8_0", n_out=151936, n_tok=3, n_in=64)
    y = mm(tid, w, n_out, n_in, x, layout, n_threads=2)
    np.testing.assert_array_equal(mm(tid, w, n_out, n_in, x, layout, n_threads=1), y)
    for r0 in (0, 75968, 151920):
        rows = w[r0 : r0 + 16]
        np.testing.assert_array_equal(y[:, r0 : r0 + 16], ref.matmul(tid, rows, 16, n_in, x))


def test_real_tensors(qwen_draft, isa, layout):
    """The first rows of one tensor of each quantized type of the real draft model."""
    tensors = real_tensor_rows(qwen_draft)
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= tensors.keys()
    for name, (n_in, w) in tensors.items():
        tid, n_out = TYPES[name].ggml_id, len(w)
        x = activations(rng_for("real", name), 6, n_in)
        np.testing.assert_array_equal(mm(tid, w, n_out, n_in, x, layout), ref.matmul(tid, w, n_out, n_in, x))
