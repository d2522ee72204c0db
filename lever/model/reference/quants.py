"""Numpy reference of the tensor formats and of the native matmul (native/quants.c, matmul.c).

Dequantization follows ggml's formulas (so it equals gguf-py's). The matmul reproduces the
native kernels' semantics exactly, one step at a time:

1. activations are quantized per token the way ggml does it: Q8_0 blocks (32 values, fp16
   scale) for Q4_0/Q5_0/Q8_0 weights, Q8_K blocks (256 values, float scale, sums of 16) for
   Q4_K/Q6_K weights; float weights take the float32 activations as they are;
2. each weight block's dot product with the activation block is an exact integer;
3. per (token, row), blocks are folded in order with a float32 fused multiply-add:
   ``acc = fma(float32(isum), d_w * d_x, acc)`` (Q4_K adds ``fma(-float32(msum), dmin_w * d_x,
   acc)``); float types fold ``acc = fma(w[k], x[k], acc)`` for k in order.

Everything is float32 IEEE arithmetic with the fused step emulated exactly (`fma_f32`), so
the result should equal the native kernels bit for bit.
"""

from __future__ import annotations

import numpy as np

from lever.gguf.types import BY_ID, TILE_ROWS

QK8_0 = 32
QK_K = 256
F32, F16, Q4_0, Q5_0, Q8_0, Q4_K, Q6_K, BF16 = 0, 1, 2, 6, 8, 12, 14, 30


def _blocks(data, n_rows: int, n_cols: int, type_id: int) -> np.ndarray:
    """Raw bytes as (n_rows, blocks per row, bytes per block) uint8."""
    t = BY_ID[type_id]
    raw = np.frombuffer(np.ascontiguousarray(data).tobytes(), np.uint8)
    return raw.reshape(n_rows, n_cols // t.block_elems, t.block_bytes)


def _fp16(b: np.ndarray) -> np.ndarray:
    """Two little-endian bytes (last axis) as fp16 widened to float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


# ---- block decoding: integer values and scales of each format ------------------------------


def decode_q8_0(blk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """-> values int (.., 32), d float32 (..)."""
    return blk[..., 2:].view(np.int8).astype(np.int32), _fp16(blk[..., :2])


def decode_q4_0(blk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    qs = blk[..., 2:].astype(np.int32)  # element j: low nibble of qs[j], j + 16: high nibble
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)
    return q - 8, _fp16(blk[..., :2])


def decode_q5_0(blk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    qh = np.ascontiguousarray(blk[..., 2:6]).view(np.uint32).astype(np.int64)  # bit j: element j
    qs = blk[..., 6:].astype(np.int32)
    lo = np.concatenate([qs & 15, qs >> 4], axis=-1)
    hi = ((qh >> np.arange(32)) & 1).astype(np.int32)
    return (lo | hi << 4) - 16, _fp16(blk[..., :2])


def q4_K_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 packed bytes -> 8 scales and 8 mins of 6 bits (ggml get_scale_min_k4)."""
    s = s.astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | (s[..., 0:4] >> 6) << 4], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6) << 4], axis=-1)
    return sc, mn


def decode_q4_K(blk: np.ndarray):
    """-> q 0..15 (.., 256), scales (.., 8), mins (.., 8), d, dmin."""
    sc, mn = q4_K_scales(blk[..., 4:16])
    qs = blk[..., 16:].astype(np.int32).reshape(*blk.shape[:-1], 4, 32)  # 64-element chunks
    q = np.stack([qs & 15, qs >> 4], axis=-2).reshape(*blk.shape[:-1], QK_K)
    return q, sc, mn, _fp16(blk[..., 0:2]), _fp16(blk[..., 2:4])


def decode_q6_K(blk: np.ndarray):
    """-> q -32..31 (.., 256), scales (.., 16), d."""
    lead = blk.shape[:-1]
    ql = blk[..., :128].astype(np.int32).reshape(*lead, 2, 2, 32)  # half, ql run, l
    qh = blk[..., 128:192].astype(np.int32).reshape(*lead, 2, 1, 32)  # half, -, l
    # group g of a half: nibble (g >= 2) of run (g % 2), qh bits 2g..2g+1
    lo = np.concatenate([ql & 15, ql >> 4], axis=-2)  # groups 0, 1, 2, 3
    hi = (qh >> (2 * np.arange(4)).reshape(4, 1)) & 3
    q = (lo | hi << 4).reshape(*lead, QK_K) - 32
    return q, blk[..., 192:208].view(np.int8).astype(np.int32), _fp16(blk[..., 208:210])


# ---- dequantization (ggml's float formulas) ------------------------------------------------


def dequantize_f32(data, n_rows: int, n_cols: int) -> np.ndarray:
    return np.frombuffer(np.ascontiguousarray(data).tobytes(), np.float32).reshape(n_rows, n_cols)


def dequantize_f16(data, n_rows: int, n_cols: int) -> np.ndarray:
    h = np.frombuffer(np.ascontiguousarray(data).tobytes(), np.float16)
    return h.astype(np.float32).reshape(n_rows, n_cols)


def dequantize_bf16(data, n_rows: int, n_cols: int) -> np.ndarray:
    h = np.frombuffer(np.ascontiguousarray(data).tobytes(), np.uint16).astype(np.uint32)
    return (h << 16).view(np.float32).reshape(n_rows, n_cols)


def _dequantize_32(decode, type_id: int, data, n_rows: int, n_cols: int) -> np.ndarray:
    q, d = decode(_blocks(data, n_rows, n_cols, type_id))
    return (q.astype(np.float32) * d[..., None]).reshape(n_rows, n_cols)


def dequantize_q8_0(data, n_rows: int, n_cols: int) -> np.ndarray:
    return _dequantize_32(decode_q8_0, Q8_0, data, n_rows, n_cols)


def dequantize_q4_0(data, n_rows: int, n_cols: int) -> np.ndarray:
    return _dequantize_32(decode_q4_0, Q4_0, data, n_rows, n_cols)


def dequantize_q5_0(data, n_rows: int, n_cols: int) -> np.ndarray:
    return _dequantize_32(decode_q5_0, Q5_0, data, n_rows, n_cols)


def dequantize_q4_K(data, n_rows: int, n_cols: int) -> np.ndarray:
    q, sc, mn, d, dmin = decode_q4_K(_blocks(data, n_rows, n_cols, Q4_K))
    d1 = (d[..., None] * sc.astype(np.float32))[..., None]  # per 32-element sub-block
    m1 = (dmin[..., None] * mn.astype(np.float32))[..., None]
    qf = q.reshape(*q.shape[:-1], 8, 32).astype(np.float32)
    return (d1 * qf - m1).reshape(n_rows, n_cols)


def dequantize_q6_K(data, n_rows: int, n_cols: int) -> np.ndarray:
    q, sc, d = decode_q6_K(_blocks(data, n_rows, n_cols, Q6_K))
    d1 = (d[..., None] * sc.astype(np.float32))[..., None]  # per 16-element sub-block
    qf = q.reshape(*q.shape[:-1], 16, 16).astype(np.float32)
    return (d1 * qf).reshape(n_rows, n_cols)


DEQUANTIZE = {
    F32: dequantize_f32, F16: dequantize_f16, BF16: dequantize_bf16, Q8_0: dequantize_q8_0,
    Q4_0: dequantize_q4_0, Q5_0: dequantize_q5_0, Q4_K: dequantize_q4_K, Q6_K: dequantize_q6_K,
}


def dequantize(type_id: int, data, n_rows: int, n_cols: int) -> np.ndarray:
    return DEQUANTIZE[type_id](data, n_rows, n_cols)


# ---- activation quantization (ggml's reference quantizers) -----------------------------------


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C roundf, exactly: floor(|v|) plus one if the (exact) fraction is at least one half."""
    a = np.abs(v)
    whole = np.floor(a)
    return np.sign(v) * (whole + np.floor(2 * (a - whole)))


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n_tok, n) float32 -> d float32 (n_tok, n / 32) rounded to fp16, qs int8 (n_tok, n / 32, 32)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, QK8_0)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    qs = _round_half_away(blocks * inv[..., None]).astype(np.int8)
    return d.astype(np.float16).astype(np.float32), qs


def quantize_q8_K(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n_tok, n) float32 -> d float32 (n_tok, n / 256), qs int8 (.., 256), bsums int (.., 16).

    The scale maps the largest-magnitude value (first one on ties) to -127; rounding is to
    nearest even, capped at 127."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, QK_K)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    zero = peak == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, np.float32(0), np.float32(-127) / peak).astype(np.float32)
        d = np.where(zero, np.float32(0), np.float32(1) / iscale).astype(np.float32)
    qs = np.minimum(np.rint(iscale[..., None] * blocks), 127).astype(np.int8)
    bsums = qs.reshape(*qs.shape[:-1], 16, 16).astype(np.int32).sum(axis=-1)
    return d, qs, bsums


# ---- the canonical reduction -----------------------------------------------------------------


def fma_f32(a, b, c) -> np.ndarray:
    """float32 a * b + c with one rounding, as C fmaf.

    The product of two float32 is exact in float64; the float64 sum is made round-to-odd
    (nudged off an even last bit when inexact), which makes the final float32 rounding
    correct: 53 bits are at least 24 + 2."""
    p = np.float64(1) * np.asarray(a, np.float32) * np.asarray(b, np.float32)
    c = np.asarray(c, np.float32).astype(np.float64)
    s = p + c
    bp = s - c
    err = (p - bp) + (c - (s - bp))  # two-sum: s + err == p + c exactly
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def _fold(acc: np.ndarray, isum: np.ndarray, d: np.ndarray) -> np.ndarray:
    return fma_f32(isum.astype(np.float32), d, acc)


def _matmul_float(type_id: int, w, n_out: int, n_in: int, x: np.ndarray) -> np.ndarray:
    W = dequantize(type_id, w, n_out, n_in)
    acc = np.zeros((x.shape[0], n_out), np.float32)
    for k in range(n_in):
        acc = fma_f32(W[None, :, k], x[:, k, None], acc)
    return acc


def _matmul_q8_0_family(decode, type_id: int, w, n_out: int, n_in: int, x: np.ndarray) -> np.ndarray:
    q, dw = decode(_blocks(w, n_out, n_in, type_id))  # (n_out, nb, 32), (n_out, nb)
    dx, qx = quantize_q8_0(x)  # (n_tok, nb), (n_tok, nb, 32)
    acc = np.zeros((x.shape[0], n_out), np.float32)
    for b in range(n_in // QK8_0):
        isum = qx[:, b].astype(np.int64) @ q[:, b].astype(np.int64).T
        acc = _fold(acc, isum, dw[None, :, b] * dx[:, b, None])
    return acc


def matmul_q8_0(w, n_out: int, n_in: int, x: np.ndarray) -> np.ndarray:
    return _matmul_q8_0_family(decode_q8_0, Q8_0, w, n_out, n_in, x)


def matmul_q4_0(w, n_out: int, n_in: int, x: np.ndarray) -> np.ndarray:
    return _matmul_q8_0_family(decode_q4_0, Q4_0, w, n_out, n_in, x)


def matmul_q5_0(w, n_out: int, n_in: int, x: np.ndarray) -> np.ndarray:
    return _matmul_q8_0_family(decode_q5_0, Q5_0, w, n_out, n_in, x)


def matmul_q4_K(w, n_out: int, n_in: int, x: np.ndarray) -> np.ndarray:
    q, sc, mn, dw, dmin = decode_q4_K(_blocks(w, n_out, n_in, Q4_K))
    dx, qx, bsums = quantize_q8_K(x)
    acc = np.zeros((x.shape[0], n_out), np.float32)
    for b in range(n_in // QK_K):
        # per 32-element sub-block j: integer dot, times its 6-bit scale
        dots = np.einsum("tjl,rjl->trj", qx[:, b].reshape(-1, 8, 32).astype(np.int64),
                         q[:, b].reshape(-1, 8, 32).astype(np.int64))
        isum = (dots * sc[None, :, b]).sum(axis=-1)
        sub_sums = bsums[:, b].reshape(-1, 8, 2).sum(axis=-1)  # (n_tok, 8)
        msum = sub_sums.astype(np.int64) @ mn[:, b].astype(np.int64).T
        acc = _fold(acc, isum, dw[None, :, b] * dx[:, b, None])
        acc = _fold(acc, -msum, dmin[None, :, b] * dx[:, b, None])
    return acc


def matmul_q6_K(w, n_out: int, n_in: int, x: np.ndarray) -> np.ndarray:
    q, sc, dw = decode_q6_K(_blocks(w, n_out, n_in, Q6_K))
    dx, qx, _ = quantize_q8_K(x)
    acc = np.zeros((x.shape[0], n_out), np.float32)
    for b in range(n_in // QK_K):
        # per 16-element sub-block j: integer dot, times its int8 scale
        dots = np.einsum("tjl,rjl->trj", qx[:, b].reshape(-1, 16, 16).astype(np.int64),
                         q[:, b].reshape(-1, 16, 16).astype(np.int64))
        isum = (dots * sc[None, :, b]).sum(axis=-1)
        acc = _fold(acc, isum, dw[None, :, b] * dx[:, b, None])
    return acc


def pack(type_id: int, w, n_out: int, n_in: int) -> np.ndarray:
    """The tile layout (native pack) of a row-layout matrix, from the type's tile_segments: rows
    padded with zeros to whole tiles, then in each tile and block, `width` bytes of each row
    side by side, segment by segment. Flat uint8."""
    t = BY_ID[type_id]
    rows = -(-n_out // TILE_ROWS) * TILE_ROWS
    blk = np.zeros((rows, n_in // t.block_elems, t.block_bytes), np.uint8)
    blk[:n_out] = _blocks(w, n_out, n_in, type_id)
    blk = blk.reshape(rows // TILE_ROWS, TILE_ROWS, -1, t.block_bytes)  # (tile, row, block, byte)
    parts = []
    for off, n, width in t.tile_segments:
        seg = blk[..., off : off + n].reshape(*blk.shape[:3], n // width, width)  # (tile, row, block, piece, byte)
        parts.append(seg.transpose(0, 2, 3, 1, 4).reshape(blk.shape[0], blk.shape[2], -1))  # pieces, then rows
    return np.concatenate(parts, axis=-1).reshape(-1)


def matmul(type_id: int, w, n_out: int, n_in: int, x: np.ndarray) -> np.ndarray:
    """y[t, r] = sum_k W[r, k] x[t, k] with the native kernels' semantics: (n_tok, n_out) float32."""
    x = np.ascontiguousarray(x, np.float32)
    if type_id in (F32, F16, BF16):
        return _matmul_float(type_id, w, n_out, n_in, x)
    fn = {Q8_0: matmul_q8_0, Q4_0: matmul_q4_0, Q5_0: matmul_q5_0, Q4_K: matmul_q4_K,
          Q6_K: matmul_q6_K}[type_id]
    return fn(w, n_out, n_in, x)
