"""Hyperparameters of a model, read from its GGUF metadata; no hard-coded model tables.

The architectures Lever runs differ in a few switches only (rope pairing, QKV biases, q/k
norms), kept in ARCHS. Everything else (sizes, heads, rope base and scaling) comes from the
file's `{arch}.*` keys, the way llama.cpp reads them.
"""

from __future__ import annotations

import attrs
import numpy as np

from lever.errors import LeverError
from lever.gguf_file import GGUFFile


@attrs.frozen
class ArchTraits:
    rope_neox: bool  # rotate (i, i + n_rot/2) instead of adjacent pairs
    qk_norm: bool  # RMSNorm on each head of q and k before rope (qwen3)


ARCHS: dict[str, ArchTraits] = {
    "llama": ArchTraits(rope_neox=False, qk_norm=False),
    "qwen2": ArchTraits(rope_neox=True, qk_norm=False),
    "qwen3": ArchTraits(rope_neox=True, qk_norm=True),
}


@attrs.frozen
class ModelSpec:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_neox: bool
    qk_norm: bool
    rope_freq_scale: float = 1.0  # linear rope scaling: positions are multiplied by this
    rope_freq_factors: np.ndarray | None = attrs.field(default=None, eq=False)  # (n_rot/2,) llama3

    def inv_freq(self) -> np.ndarray:
        """Per-pair rotation frequencies (n_rot/2,), with any scaling folded in."""
        i = np.arange(0, self.n_rot, 2, dtype=np.float64)
        inv = self.rope_freq_scale / (self.rope_base ** (i / self.n_rot))
        if self.rope_freq_factors is not None:
            inv = inv / self.rope_freq_factors.astype(np.float64)
        return inv.astype(np.float32)

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def read_spec(f: GGUFFile) -> ModelSpec:
    arch = f.arch
    if arch not in ARCHS:
        raise LeverError(f"{f.path}: unsupported architecture {arch!r} (supported: {', '.join(ARCHS)})")
    traits = ARCHS[arch]

    def key(name: str, default=None):
        value = f.get(f"{arch}.{name}", default)
        if value is None:
            raise LeverError(f"{f.path}: missing metadata key {arch}.{name}")
        return value

    n_embd = int(key("embedding_length"))
    n_head = int(key("attention.head_count"))
    n_head_kv = int(key("attention.head_count_kv", n_head))
    head_dim = int(key("attention.key_length", n_embd // n_head))
    n_rot = int(key("rope.dimension_count", head_dim))
    if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv:
        raise LeverError(f"{f.path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    if n_rot % 2 or n_rot > head_dim:
        raise LeverError(f"{f.path}: rope.dimension_count {n_rot} does not fit head size {head_dim}")

    scaling = str(f.get(f"{arch}.rope.scaling.type", "none"))
    freq_scale = 1.0
    if scaling == "linear":
        freq_scale = 1.0 / float(key("rope.scaling.factor"))
    elif scaling not in ("none", ""):
        raise LeverError(f"{f.path}: unsupported rope scaling {scaling!r} ({arch}.rope.scaling.type)")
    factors = f.floats("rope_freqs.weight").reshape(-1) if "rope_freqs.weight" in f.tensors else None

    emb = f.tensor("token_embd.weight")
    return ModelSpec(
        arch=arch,
        n_layer=int(key("block_count")),
        n_embd=n_embd,
        n_ff=int(key("feed_forward_length")),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_rot=n_rot,
        n_vocab=emb.shape[0],
        n_ctx_train=int(key("context_length", 2048)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(key("rope.freq_base", 10000.0)),
        rope_neox=traits.rope_neox,
        qk_norm=traits.qk_norm,
        rope_freq_scale=freq_scale,
        rope_freq_factors=factors,
    )
