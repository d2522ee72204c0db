"""Tensor formats: native dequantization and the numpy reference against gguf-py, and the
reference's activation quantizers against ggml's.

Dequantization is exact: ggml's formulas are a few float32 multiplies and one subtraction,
done in the same order everywhere, and fp16/bf16 widen exactly.
"""

from __future__ import annotations

import functools
import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ

from lever.backends.cpu import native
from lever.errors import LeverError
from lever.gguf.types import TYPES
from lever.model.reference import quants as ref

TYPE_NAMES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"]
GGUF_QUANTIZES = {"BF16", "Q8_0", "Q4_0", "Q5_0"}  # gguf-py can make these from floats


def rng_for(*key) -> np.random.Generator:
    """A generator seeded by the test's key (stable across runs, unlike hash())."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _small_fp16(rng, shape) -> np.ndarray:
    """Finite positive fp16 scales around 1e-3, one in eight subnormal, as raw bytes."""
    v = rng.uniform(1e-4, 1e-2, shape)
    v = np.where(rng.random(shape) < 0.125, rng.uniform(1e-7, 6e-5, shape), v)
    return v.astype(np.float16).view(np.uint8).reshape(*shape, 2)


def random_weights(rng, name: str, n_out: int, n_in: int) -> np.ndarray:
    """(n_out, row bytes) uint8 of valid `name` rows: quantized from normal floats where
    gguf-py can; Q4_K/Q6_K are random bytes with small finite fp16 d (and dmin)."""
    t = TYPES[name]
    floats = rng.standard_normal((n_out, n_in)).astype(np.float32)
    if name == "F32":
        return floats.view(np.uint8)
    if name == "F16":
        return floats.astype(np.float16).view(np.uint8)
    if name in GGUF_QUANTIZES:
        return gguf.quants.quantize(floats, GQ[name]).reshape(n_out, -1)
    nb = n_in // t.block_elems
    raw = rng.integers(0, 256, (n_out, nb, t.block_bytes), dtype=np.uint8)
    if name == "Q4_K":
        raw[..., 0:2] = _small_fp16(rng, (n_out, nb))
        raw[..., 2:4] = _small_fp16(rng, (n_out, nb))
    else:  # Q6_K: d is the last two bytes
        raw[..., 208:210] = _small_fp16(rng, (n_out, nb))
    return raw.reshape(n_out, -1)


def gguf_dequantize(raw: np.ndarray, name: str, n_out: int, n_in: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, GQ[name]).reshape(n_out, n_in).astype(np.float32)


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_dequantize_matches_gguf(name):
    rng = rng_for("dequantize", name)
    n_out, n_in = 9, 768
    raw = random_weights(rng, name, n_out, n_in)
    want = gguf_dequantize(raw, name, n_out, n_in)
    tid = TYPES[name].ggml_id
    np.testing.assert_array_equal(native.dequantize(tid, raw, n_out, n_in), want)
    np.testing.assert_array_equal(ref.dequantize(tid, raw, n_out, n_in), want)


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_every_16_bit_pattern_widens_exactly(name):
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = native.dequantize(TYPES[name].ggml_id, bits, 1, bits.size)[0]
    if name == "F16":
        want = bits.view(np.float16).astype(np.float32)
    else:
        want = (bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # NaN payloads too


def test_dequantize_rejects_bad_arguments():
    with pytest.raises(LeverError, match="unsupported"):
        native.dequantize(3, np.zeros(20, np.uint8), 1, 32)  # Q4_1: not a Lever type
    with pytest.raises(LeverError, match="bad shape"):
        native.dequantize(TYPES["Q4_K"].ggml_id, np.zeros(144, np.uint8), 1, 128)


def test_reference_q8_0_quantizer_is_ggmls():
    """gguf-py's Q8_0 quantizer is bit-exact with ggml's quantize_row_q8_0_ref."""
    rng = rng_for("q8_0")
    x = rng.standard_normal((6, 256)).astype(np.float32) * np.float32([[1e-3], [1], [30], [1], [1], [1]])
    x[3, :32] = 0  # an all-zero block
    x[4, 32:64] = np.float32(127 / 2) * np.arange(-16, 16, dtype=np.float32) / 16  # ties at .5
    x[5, 64:96] = rng.integers(-127, 128, 32).astype(np.float32) + np.float32(0.5)
    d, qs = ref.quantize_q8_0(x)
    packed = np.concatenate([d.astype(np.float16)[..., None].view(np.uint8), qs.view(np.uint8)], axis=-1)
    np.testing.assert_array_equal(packed.reshape(6, -1), gguf.quants.quantize(x, GQ.Q8_0))


def test_reference_q8_K_quantizer():
    """ggml's quantize_row_q8_K_ref: the largest magnitude maps to -127, the rest round to
    nearest within half a step, capped at 127; bsums are sums of 16."""
    rng = rng_for("q8_K")
    x = rng.standard_normal((3, 512)).astype(np.float32)
    x[1, :256] = 0
    d, qs, bsums = ref.quantize_q8_K(x)
    blocks = x.reshape(3, 2, 256)
    assert d[1, 0] == 0 and not qs[1, 0].any()
    live = d != 0
    peak = np.abs(blocks).argmax(axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(qs, peak[..., None], -1)[..., 0][live], -127)
    assert np.abs(qs).max() <= 127
    err = np.abs(qs * d[..., None] - blocks)
    assert (err <= np.abs(d)[..., None] * 0.5001).all()
    np.testing.assert_array_equal(bsums, qs.reshape(3, 2, 16, 16).astype(np.int32).sum(-1))


@functools.lru_cache(maxsize=2)
def real_tensor_rows(path: Path, n_rows: int = 40) -> dict[str, tuple[int, np.ndarray]]:
    """Type name -> (n_in, first n_rows rows' bytes) of the first matrix of each Lever type
    in a GGUF file (parsed once per session: gguf-py takes seconds on a real model)."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        name = t.tensor_type.name
        if name not in out and name in TYPES and len(t.shape) == 2:
            out[name] = (int(t.shape[0]), np.ascontiguousarray(t.data[:n_rows]))
    return out


def test_real_tensors_dequantize_like_gguf(qwen_draft):
    """Every weight type of the real draft model, first rows, native against gguf-py."""
    tensors = real_tensor_rows(qwen_draft)
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= tensors.keys()
    for name, (n_in, rows) in tensors.items():
        want = gguf_dequantize(rows, name, len(rows), n_in)
        np.testing.assert_array_equal(native.dequantize(TYPES[name].ggml_id, rows, len(rows), n_in), want)
