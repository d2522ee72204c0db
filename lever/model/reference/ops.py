"""Numpy references of the per-token operators in native/ops.c, written for reading.

Float64 inside; results are returned as float32 like the native kernels. Tests hold every
native ISA path to these within named tolerances. Conventions follow ggml (llama.cpp):

- rmsnorm: x / sqrt(mean(x^2) + eps) * w over the last axis.
- rope: theta_i = pos * inv_freq[i] rounded to float32 (ggml and HF both form theta in
  float32, and at large positions that rounding is visible), then cos/sin in float64 times
  attn_factor. Pairs mode rotates (2i, 2i+1), neox mode (i, i + n_rot/2); dims >= n_rot stay.
- attention: grouped-query, explicit boolean mask, softmax over allowed rows only, a token
  that may see nothing gets zeros.
- swiglu: silu(gate) * up = gate / (1 + exp(-gate)) * up.
"""

from __future__ import annotations

import numpy as np


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = np.asarray(x, np.float64)
    out = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)
    return out.astype(np.float32)


def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, inv_freq: np.ndarray, neox: bool,
         attn_factor: float = 1.0) -> np.ndarray:
    """x: (n_tok, n_head, head_dim); returns a rotated copy."""
    x = np.asarray(x, np.float64).copy()
    half = n_rot // 2
    theta = np.asarray(pos, np.float32)[:, None] * np.asarray(inv_freq[:half], np.float32)[None, :]
    theta = theta.astype(np.float64)  # the float32 product above is the convention
    cos = (np.cos(theta) * attn_factor)[:, None, :]  # (n_tok, 1, half): same for all heads
    sin = (np.sin(theta) * attn_factor)[:, None, :]
    if neox:
        ia, ib = np.arange(half), np.arange(half) + half
    else:
        ia, ib = np.arange(0, 2 * half, 2), np.arange(1, 2 * half, 2)
    a, b = x[..., ia].copy(), x[..., ib].copy()
    x[..., ia] = a * cos - b * sin
    x[..., ib] = a * sin + b * cos
    return x.astype(np.float32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    """q: (n_tok, n_head, hd); k, v: (n_kv, n_kv_head, hd); mask: (n_tok, n_kv) bool."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    mask = np.asarray(mask, bool)
    n_tok, n_head, hd = q.shape
    group = n_head // k.shape[1]
    out = np.zeros((n_tok, n_head, hd))
    for t in range(n_tok):
        rows = np.flatnonzero(mask[t])  # masked rows are never looked at
        if rows.size == 0:
            continue
        for h in range(n_head):
            kh, vh = k[rows, h // group], v[rows, h // group]  # (m, hd)
            s = kh @ q[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = p @ vh / p.sum()
    return out.astype(np.float32)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    g = np.asarray(gate, np.float64)
    with np.errstate(over="ignore"):  # exp(-g) -> inf for very negative g gives the right 0
        return (g / (1.0 + np.exp(-g)) * np.asarray(up, np.float64)).astype(np.float32)
