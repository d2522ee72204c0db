"""A numpy reference of the whole forward pass, written for reading, not speed.

Float64 throughout, weights dequantized with gguf-py (the format's own code), attention as a
plain softmax over an explicit mask. Tests hold the native forward (lever.model) to it; it
shares nothing with the native path but the GGUF reader and the model spec.
"""

from __future__ import annotations

import gguf
import numpy as np

from lever.gguf.file import GGUFFile
from lever.gguf.spec import ModelSpec, read_spec


def _rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, spec: ModelSpec):  # x: (n_tok, n_head, head_dim)
    inv = spec.inv_freq().astype(np.float64)
    theta = pos[:, None].astype(np.float64) * inv[None, :]  # (n_tok, n_rot/2)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x = x.copy()
    half = spec.n_rot // 2
    if spec.rope_neox:
        a, b = x[..., :half].copy(), x[..., half : spec.n_rot].copy()
        x[..., :half], x[..., half : spec.n_rot] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., 0 : spec.n_rot : 2].copy(), x[..., 1 : spec.n_rot : 2].copy()
        x[..., 0 : spec.n_rot : 2], x[..., 1 : spec.n_rot : 2] = a * cos - b * sin, a * sin + b * cos
    return x


class ReferenceModel:
    def __init__(self, path):
        self.file = f = GGUFFile(path)
        self.spec = read_spec(f)

    def w(self, name: str) -> np.ndarray:
        """Dequantized by gguf-py on each use, so a 1.5B model never sits in memory as float64."""
        t = self.file.tensor(name)
        qtype = gguf.GGMLQuantizationType(t.type.ggml_id)
        return gguf.quants.dequantize(np.asarray(self.file.raw(name)), qtype).reshape(t.shape).astype(np.float64)

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Causal logits after every position: (n_tokens, n_vocab) float64."""
        s, w = self.spec, self.w
        n = len(tokens)
        pos = np.arange(n)
        x = w("token_embd.weight")[np.asarray(tokens)]
        mask = np.tri(n, dtype=bool)
        for i in range(s.n_layer):
            p = f"blk.{i}."
            h = _rmsnorm(x, w(p + "attn_norm.weight"), s.rms_eps)
            q, k, v = (h @ w(p + f"attn_{c}.weight").T + self._bias(p + f"attn_{c}.bias") for c in "qkv")
            q = q.reshape(n, s.n_head, s.head_dim)
            k = k.reshape(n, s.n_head_kv, s.head_dim)
            v = v.reshape(n, s.n_head_kv, s.head_dim)
            if self.has(p + "attn_q_norm.weight"):
                q = _rmsnorm(q, w(p + "attn_q_norm.weight"), s.rms_eps)
                k = _rmsnorm(k, w(p + "attn_k_norm.weight"), s.rms_eps)
            q, k = _rope(q, pos, s), _rope(k, pos, s)
            group = s.n_head // s.n_head_kv
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(s.head_dim)
            scores = np.where(mask[None], scores, -np.inf)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            attn = np.einsum("hts,shd->thd", scores, v).reshape(n, -1)
            x = x + attn @ w(p + "attn_output.weight").T
            h = _rmsnorm(x, w(p + "ffn_norm.weight"), s.rms_eps)
            g, u = h @ w(p + "ffn_gate.weight").T, h @ w(p + "ffn_up.weight").T
            x = x + (g / (1 + np.exp(-g)) * u) @ w(p + "ffn_down.weight").T
        out = w("output.weight" if self.has("output.weight") else "token_embd.weight")
        return _rmsnorm(x, w("output_norm.weight"), s.rms_eps) @ out.T

    def _bias(self, name: str):
        return self.w(name) if self.has(name) else 0.0
