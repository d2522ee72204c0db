"""Hyperparameters of a model, read from its GGUF metadata; no hard-coded model tables.

The architectures Lever runs differ in a few switches only (rope pairing, QKV biases, q/k
norms), kept in ARCHS. Everything else (sizes, heads, rope base and scaling) comes from the
file's `{arch}.*` keys, the way llama.cpp reads them, each checked for type and range (and
against the others and the token embedding) before anything is sized from it: a file from
anywhere gives one line naming the key, never an exception from deep inside the model.
"""

from __future__ import annotations

import attrs
import numpy as np

from lever.errors import LeverError, kind_of
from lever.gguf.file import GGUFFile


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


# Bounds on the sizes a file may declare: far past any model Lever could run, small enough that
# nothing sized from them is absurd before the tensors' own shapes are checked against them.
MAX_LAYERS = 1 << 12
MAX_WIDTH = 1 << 20  # n_embd, n_ff, head counts and sizes
MAX_CTX = (1 << 31) - 1  # positions are int32
MAX_VOCAB = (1 << 31) - 1  # token ids are int32


class _Keys:
    """Typed, range-checked reads of `{arch}.*` keys: one line naming the key for any bad value."""

    def __init__(self, f: GGUFFile, arch: str):
        self.f, self.arch = f, arch

    def fail(self, name: str, why: str) -> LeverError:
        return LeverError(f"{self.f.path}: metadata key {self.arch}.{name} {why}")

    def raw(self, name: str, default):
        value = self.f.get(f"{self.arch}.{name}", default)
        if value is None:
            raise LeverError(f"{self.f.path}: missing metadata key {self.arch}.{name}")
        return value

    def int(self, name: str, default=None, lo: int = 1, hi: int = MAX_WIDTH) -> int:
        value = self.raw(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(name, f"is {kind_of(value)}, expected an integer")
        if not lo <= value <= hi:
            raise self.fail(name, f"= {value} is out of range [{lo}, {hi}]")
        return value

    def float(self, name: str, default=None, lo: float = 0.0, hi: float = 1e30) -> float:
        """A finite number in (lo, hi]."""
        value = self.raw(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(name, f"is {kind_of(value)}, expected a number")
        if not lo < value <= hi:  # NaN fails this too
            raise self.fail(name, f"= {value} is out of range ({lo:g}, {hi:g}]")
        return float(value)


def _rope_scale(k: _Keys) -> float:
    """RoPE's frequency scale: 1 unscaled, 1 / factor for linear scaling (the one supported)."""
    scaling = k.raw("rope.scaling.type", "none")
    if not isinstance(scaling, str):
        raise k.fail("rope.scaling.type", f"is {kind_of(scaling)}, expected a string")
    if scaling == "linear":
        return 1.0 / k.float("rope.scaling.factor", lo=1e-6, hi=1e6)
    if scaling not in ("none", ""):
        raise k.fail("rope.scaling.type", f"= {scaling[:40]!r} is not supported (none, linear)")
    return 1.0


def _n_vocab(f: GGUFFile, k: _Keys, n_embd: int) -> int:
    """The vocabulary's size: the token embedding's rows, checked against its width and any
    vocab_size the file states."""
    emb = f.tensor("token_embd.weight")
    if len(emb.shape) != 2 or emb.shape[1] != n_embd:
        raise LeverError(f"{f.path}: tensor token_embd.weight has shape {emb.shape}, expected (n_vocab, {n_embd})")
    n_vocab = emb.shape[0]
    if n_vocab > MAX_VOCAB:
        raise LeverError(f"{f.path}: tensor token_embd.weight has {n_vocab} rows, more than token ids can number")
    if f.has(f"{f.arch}.vocab_size") and k.int("vocab_size", hi=MAX_VOCAB) != n_vocab:
        raise k.fail("vocab_size", f"= {f.get(f'{f.arch}.vocab_size')} but token_embd.weight has {n_vocab} rows")
    return n_vocab


def read_spec(f: GGUFFile) -> ModelSpec:
    """The hyperparameters, each checked for type and range, and against each other and the
    token embedding, before anything is sized from them."""
    arch = f.arch
    if arch not in ARCHS:
        raise LeverError(f"{f.path}: unsupported architecture {arch!r} (supported: {', '.join(ARCHS)})")
    traits = ARCHS[arch]
    k = _Keys(f, arch)

    n_layer = k.int("block_count", hi=MAX_LAYERS)
    n_embd = k.int("embedding_length")
    n_ff = k.int("feed_forward_length")
    n_head = k.int("attention.head_count")
    n_head_kv = k.int("attention.head_count_kv", n_head, hi=n_head)
    if n_head % n_head_kv:
        raise k.fail("attention.head_count_kv", f"= {n_head_kv} does not divide head_count {n_head}")
    if f.has(f"{arch}.attention.key_length"):
        head_dim = k.int("attention.key_length")
    elif n_embd % n_head:
        raise k.fail("attention.head_count", f"= {n_head} does not divide embedding_length {n_embd} "
                                             f"(and there is no {arch}.attention.key_length)")
    else:
        head_dim = n_embd // n_head
    if k.int("attention.value_length", head_dim) != head_dim:
        raise k.fail("attention.value_length", f"= {f.get(f'{arch}.attention.value_length')} differs from the "
                                               f"key length {head_dim} (Lever needs them equal)")
    n_rot = k.int("rope.dimension_count", head_dim, hi=head_dim)
    if n_rot % 2:
        raise k.fail("rope.dimension_count", f"= {n_rot} is odd (rope turns pairs)")

    freq_scale = _rope_scale(k)
    n_vocab = _n_vocab(f, k, n_embd)

    return ModelSpec(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=n_ff,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_rot=n_rot,
        n_vocab=n_vocab,
        n_ctx_train=k.int("context_length", 2048, hi=MAX_CTX),
        rms_eps=k.float("attention.layer_norm_rms_epsilon", 1e-5, hi=1.0),
        rope_base=k.float("rope.freq_base", 10000.0, lo=1.0, hi=1e15),
        rope_neox=traits.rope_neox,
        qk_norm=traits.qk_norm,
        rope_freq_scale=freq_scale,
        rope_freq_factors=_rope_factors(f, n_rot),
    )


def _rope_factors(f: GGUFFile, n_rot: int) -> np.ndarray | None:
    """llama3's per-pair divisors of the rope frequencies: n_rot/2 finite positive numbers."""
    if "rope_freqs.weight" not in f.tensors:
        return None
    info = f.tensor("rope_freqs.weight")
    if info.shape != (n_rot // 2,):
        raise LeverError(f"{f.path}: tensor rope_freqs.weight has shape {info.shape}, expected ({n_rot // 2},)")
    factors = f.floats("rope_freqs.weight").reshape(-1)
    with np.errstate(invalid="ignore"):  # a NaN may set the invalid flag in a comparison; it is refused all the same
        bad = ~((factors > 1e-6) & (factors <= 1e6))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LeverError(f"{f.path}: tensor rope_freqs.weight[{i}] = {factors[i]} is out of range (1e-06, 1e+06]")
    return factors
