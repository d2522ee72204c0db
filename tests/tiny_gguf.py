"""Tiny GGUF models written in the tests with gguf.GGUFWriter, for every architecture and type.

Weights are random (seeded), so these test arithmetic, not language: the native forward pass
against the numpy reference (lever.model.reference.forward), batch invariance, cache handling and
the loader's checks. A small byte-level tokenizer makes them usable from the CLI too.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from lever.gguf.tokenizer import byte_level_chars

QUANTIZABLE = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0"}  # gguf-py can quantize these
K_QUANTS = {"Q4_K", "Q6_K"}  # random valid blocks (gguf-py only dequantizes them)


def random_k_blocks(qtype: str, n_rows: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random but well-scaled Q4_K / Q6_K rows (n_rows, row_bytes) uint8: zero-mean weights
    with a standard deviation near 1/sqrt(n_cols), like a trained layer's."""
    n_blocks = n_rows * n_cols // 256
    std = 1.0 / np.sqrt(n_cols)
    if qtype == "Q4_K":
        # d, dmin (f16), 12 bytes of packed 6-bit scales/mins, 128 bytes of nibbles. dmin = d and
        # min = 7.5 x scale centre each sub-block, so weights are zero-mean like real ones.
        sc = rng.integers(4, 9, (n_blocks, 8))
        d = (rng.uniform(0.5, 1.5, (n_blocks, 1)) * std / (6 * 4.6)).astype(np.float16)  # E|sc| 6, std(q-7.5) 4.6
        m = np.rint(7.5 * sc).astype(np.int64)
        packed = np.zeros((n_blocks, 12), np.int64)
        packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
        packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
        packed[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
        qs = rng.integers(0, 256, (n_blocks, 128), dtype=np.uint8)
        blocks = np.concatenate([d.view(np.uint8), d.view(np.uint8), packed.astype(np.uint8), qs], axis=1)
    else:  # Q6_K: 128 ql, 64 qh, 16 int8 scales, f16 d; 6-bit q - 32 is zero-mean already
        q = rng.integers(0, 256, (n_blocks, 192), dtype=np.uint8)
        scales = rng.integers(-24, 25, (n_blocks, 16), dtype=np.int8).view(np.uint8)
        # E|sc| 12, std(q-32) 18.5
        d = (rng.uniform(0.5, 1.5, (n_blocks, 1)) * std / (14 * 18.5)).astype(np.float16).view(np.uint8)
        blocks = np.concatenate([q, scales, d], axis=1)
    return blocks.reshape(n_rows, -1)


def encode_weight(w: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, Q]:
    """w: float32 (n_out, n_in) -> (array to write, its GGML type)."""
    t = Q[qtype]
    if qtype == "F32":
        return w.astype(np.float32), t
    if qtype == "F16":
        return w.astype(np.float16), t
    if qtype in K_QUANTS:
        return random_k_blocks(qtype, *w.shape, rng), t
    return gguf.quants.quantize(w.astype(np.float32), t), t


def _add_shape(w: gguf.GGUFWriter, arch: str, *, n_layer: int, n_ctx: int, n_embd: int, n_ff: int, n_head: int,
               n_head_kv: int, head_dim: int) -> None:
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    if head_dim != n_embd // n_head:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    w.add_layer_norm_rms_eps(1e-6)


def write_tiny_model(path: Path, arch: str = "llama", wtype: str = "F32", *, n_layer: int = 2,
                     n_embd: int = 64, n_ff: int = 128, n_head: int = 4, n_head_kv: int = 2,
                     head_dim: int | None = None, n_vocab: int = 300, tied: bool = False,
                     embd_type: str | None = None, seed: int = 0, n_ctx: int = 256) -> Path:
    if wtype in K_QUANTS:
        n_embd, n_ff = max(n_embd, 256), max(n_ff, 256)
    rng = np.random.default_rng(seed)
    head_dim = head_dim or n_embd // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-{wtype}")
    _add_shape(w, arch, n_layer=n_layer, n_ctx=n_ctx, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
               head_dim=head_dim)
    _add_byte_tokenizer(w, n_vocab)

    def mat(name, n_out, n_in, qtype=wtype, scale=None):
        data = rng.standard_normal((n_out, n_in)).astype(np.float32) * (scale or 1.0 / np.sqrt(n_in))
        arr, t = encode_weight(data, qtype, rng)
        w.add_tensor(name, arr, raw_dtype=t if t not in (Q.F32, Q.F16) else None)

    def vec(name, n, around=1.0):
        w.add_tensor(name, (around + 0.1 * rng.standard_normal(n)).astype(np.float32))

    etype = embd_type or wtype
    mat("token_embd.weight", n_vocab, n_embd, etype, scale=1.0)
    vec("output_norm.weight", n_embd)
    if not tied:
        mat("output.weight", n_vocab, n_embd)
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    for i in range(n_layer):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", n_embd)
        mat(p + "attn_q.weight", q_dim, n_embd)
        mat(p + "attn_k.weight", kv_dim, n_embd)
        mat(p + "attn_v.weight", kv_dim, n_embd)
        if arch == "qwen2":
            vec(p + "attn_q.bias", q_dim, 0.0)
            vec(p + "attn_k.bias", kv_dim, 0.0)
            vec(p + "attn_v.bias", kv_dim, 0.0)
        if arch == "qwen3":
            vec(p + "attn_q_norm.weight", head_dim)
            vec(p + "attn_k_norm.weight", head_dim)
        mat(p + "attn_output.weight", n_embd, q_dim)
        vec(p + "ffn_norm.weight", n_embd)
        mat(p + "ffn_gate.weight", n_ff, n_embd)
        mat(p + "ffn_up.weight", n_ff, n_embd)
        mat(p + "ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _add_byte_tokenizer(w: gguf.GGUFWriter, n_vocab: int) -> None:
    """Byte-level BPE: 256 byte tokens, a few merges, then filler tokens up to n_vocab, eos last."""
    tokens = byte_level_chars()
    merges = []
    for a, b in (("t", "h"), ("th", "e"), ("Ġ", "t"), ("i", "n"), ("h", "e"), ("Ġt", "he")):
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    while len(tokens) < n_vocab - 1:
        tokens.append(f"<unused{len(tokens)}>")
    tokens.append("<|endoftext|>")
    types = [gguf.TokenType.NORMAL] * (n_vocab - 1) + [gguf.TokenType.CONTROL]
    for i, t in enumerate(tokens):
        if t.startswith("<unused"):
            types[i] = gguf.TokenType.UNUSED
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(n_vocab - 1)
    w.add_eos_token_id(n_vocab - 1)
    w.add_add_bos_token(False)
