"""Tiny consistent models for the loader fuzzer, and the semantic faults injected into them.

`model_desc` draws a small llama, qwen2 or qwen3 model with a byte-level BPE or a SentencePiece
vocabulary, every hyperparameter, tensor shape and tokenizer array consistent, so it loads,
runs and tokenizes. `faulty_model` then applies a few faults of the kinds crafted files carry:
a string or an array where an int belongs, zero, negative or huge sizes, heads that do not
divide, a tensor missing, misshapen, of an unknown type, overlapping another or duplicated,
tokenizer arrays of the wrong length or element type, merges that are no pair of tokens,
special ids out of range, lying counts. The loader must refuse each with one line.
`nonfinite_model` instead leaves the file valid and sets some values of one tensor to NaN or Inf
(a float's bits, or a block's float16 scale): loading and running it must end in one line naming
the file, or give finite logits, never NaN presented as output.
"""

from __future__ import annotations

import struct
from typing import Any

from lever.fuzz.inputs import (
    ARR,
    BOOL,
    F32,
    F64,
    FLOATS,
    I8,
    I16,
    I32,
    I64,
    INTS,
    KV,
    STR,
    U8,
    U16,
    U32,
    U64,
    Blob,
    Chooser,
    Desc,
    TensorDesc,
    chance,
    choice,
    serialize,
    tensor_bytes,
)
from lever.gguf.tokenizer import byte_level_chars
from lever.gguf.types import TYPES

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _gpt2_vocab(ch: Chooser, d: Desc) -> int:
    merges = ["t h", "th e", "Ġ t", "i n", "h e", "Ġt he", "Ġ a", "1 2"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = byte_level_chars() + ["".join(m.split(" ")) for m in merges] + specials
    types = [NORMAL] * (len(tokens) - 3) + [CONTROL] * 3
    d.set("tokenizer.ggml.model", STR, "gpt2")
    d.set("tokenizer.ggml.pre", STR, choice(ch, ["default", "gpt2", "qwen2", "llama-bpe"]))
    d.set("tokenizer.ggml.tokens", ARR, tokens, STR)
    d.set("tokenizer.ggml.token_type", ARR, types, I32)
    d.set("tokenizer.ggml.merges", ARR, merges, STR)
    d.set("tokenizer.ggml.bos_token_id", U32, len(tokens) - 3)
    d.set("tokenizer.ggml.eos_token_id", U32, len(tokens) - 1)
    d.set("tokenizer.ggml.add_bos_token", BOOL, chance(ch, 50))
    return len(tokens)


def _spm_vocab(ch: Chooser, d: Desc) -> int:
    pieces = ["\u2581", "t", "h", "e", "a", "\u2581t", "he", "\u2581the", "\u2581a", "in", "\u2581in"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    d.set("tokenizer.ggml.model", STR, "llama")
    d.set("tokenizer.ggml.tokens", ARR, tokens, STR)
    d.set("tokenizer.ggml.scores", ARR, scores, F32)
    d.set("tokenizer.ggml.token_type", ARR, types, I32)
    d.set("tokenizer.ggml.unknown_token_id", U32, 0)
    d.set("tokenizer.ggml.bos_token_id", U32, 1)
    d.set("tokenizer.ggml.eos_token_id", U32, 2)
    if chance(ch, 30):
        d.set("tokenizer.ggml.add_space_prefix", BOOL, chance(ch, 50))
    return len(tokens)


def model_desc(ch: Chooser, arch: str | None = None, vocab: str | None = None) -> Desc:
    """A small model every check should accept: consistent hyperparameters, tensors and vocab
    (`vocab`: "gpt2" or "llama"; both it and `arch` are drawn when not given)."""
    arch = arch or choice(ch, ["llama", "qwen2", "qwen3"])
    n_embd = choice(ch, [12, 16, 24, 32, 40, 64, 256])
    n_head = choice(ch, [h for h in (1, 2, 3, 4) if n_embd % h == 0 and n_embd // h % 2 == 0])
    n_head_kv = choice(ch, [k for k in (1, 2, 3, 4) if n_head % k == 0])
    head_dim = n_embd // n_head
    d = Desc([KV("general.architecture", STR, arch)], [])
    if arch == "qwen3" and chance(ch, 50):  # heads wider than n_embd / n_head, as qwen3 has
        head_dim *= 2
        d.set(f"{arch}.attention.key_length", U32, head_dim)
        d.set(f"{arch}.attention.value_length", U32, head_dim)
    n_ff, n_layer = choice(ch, [8, 32, 64, 256]), ch.int(1, 3)
    n_rot = head_dim if arch != "llama" or chance(ch, 50) else head_dim // 2 // 2 * 2 or 2
    for key, value in (("block_count", n_layer), ("context_length", choice(ch, [1, 64, 2048])),
                       ("embedding_length", n_embd), ("feed_forward_length", n_ff), ("attention.head_count", n_head),
                       ("attention.head_count_kv", n_head_kv), ("rope.dimension_count", n_rot)):
        d.set(f"{arch}.{key}", U32, value)
    d.set(f"{arch}.rope.freq_base", F32, 10000.0)
    d.set(f"{arch}.attention.layer_norm_rms_epsilon", F32, 1e-6)
    n_vocab = _gpt2_vocab(ch, d) if (vocab == "gpt2" if vocab else chance(ch, 50)) else _spm_vocab(ch, d)
    if chance(ch, 30):
        d.set(f"{arch}.vocab_size", U32, n_vocab)
    widths = (n_embd, head_dim * n_head, n_ff)  # every matrix's row length
    quants = [t.name for t in TYPES.values() if all(w % t.block_elems == 0 for w in widths)]
    wt = TYPES[choice(ch, quants)].ggml_id
    f32 = TYPES["F32"].ggml_id
    t = d.tensors
    if arch == "llama" and chance(ch, 30):
        ones = struct.pack(f"<{n_rot // 2}f", *[1.0] * (n_rot // 2))
        t.append(TensorDesc("rope_freqs.weight", [n_rot // 2], f32, content=ones))
    t += [TensorDesc("token_embd.weight", [n_embd, n_vocab], wt), TensorDesc("output_norm.weight", [n_embd], f32)]
    if chance(ch, 50):
        t.append(TensorDesc("output.weight", [n_embd, n_vocab], wt))
    q, kv = n_head * head_dim, n_head_kv * head_dim
    for i in range(n_layer):
        p = f"blk.{i}."
        t += [TensorDesc(p + "attn_norm.weight", [n_embd], f32), TensorDesc(p + "attn_q.weight", [n_embd, q], wt),
              TensorDesc(p + "attn_k.weight", [n_embd, kv], wt), TensorDesc(p + "attn_v.weight", [n_embd, kv], wt)]
        if arch == "qwen2":
            t += [TensorDesc(p + "attn_q.bias", [q], f32), TensorDesc(p + "attn_k.bias", [kv], f32),
                  TensorDesc(p + "attn_v.bias", [kv], f32)]
        if arch == "qwen3":
            t += [TensorDesc(p + "attn_q_norm.weight", [head_dim], f32),
                  TensorDesc(p + "attn_k_norm.weight", [head_dim], f32)]
        t += [TensorDesc(p + "attn_output.weight", [q, n_embd], wt),
              TensorDesc(p + "ffn_norm.weight", [n_embd], f32),
              TensorDesc(p + "ffn_gate.weight", [n_embd, n_ff], wt),
              TensorDesc(p + "ffn_up.weight", [n_embd, n_ff], wt),
              TensorDesc(p + "ffn_down.weight", [n_ff, n_embd], wt)]
    return d


# --- semantic faults --------------------------------------------------------------------------

HPARAMS = ["block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
           "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
           "rope.freq_base", "attention.layer_norm_rms_epsilon", "rope.scaling.type", "rope.scaling.factor",
           "vocab_size"]
TOKEN_IDS = ["bos_token_id", "eos_token_id", "unknown_token_id", "eot_token_id", "eom_token_id", "padding_token_id",
             "fim_pad_token_id", "fim_sep_token_id"]
FLAGS = ["add_bos_token", "add_eos_token", "add_space_prefix"]
ODD_STRINGS = ["", " ", "  ", "a", "a b c", "zz qq", "Ġ Ġ", "\u2581 x", "12", "-1", "nan", "llama", "gpt2", "qwen2",
               "linear", "yarn", "<0xZZ>", "<0x41>", "\udcff", b"\xff\xfe", "\x00", "x" * 300]


def any_value(ch: Chooser) -> tuple[int, Any, int]:
    """(type, value, element type) of any kind, biased to the values that break parsers."""
    vt = choice(ch, [U32, I32, U64, I64, U8, I8, U16, I16, F32, F64, BOOL, STR, ARR])
    if vt in (F32, F64):
        return vt, choice(ch, FLOATS), 0
    if vt == BOOL:
        return vt, ch.int(0, 255), 0  # a bool byte other than 0 and 1 too
    if vt == STR:
        return vt, choice(ch, ODD_STRINGS), 0
    if vt == ARR:
        elem = choice(ch, [U32, I32, F32, STR, BOOL, ARR])
        n = ch.int(0, 4)
        return vt, [any_value_of(ch, elem) for _ in range(n)], elem
    return vt, choice(ch, INTS) if chance(ch, 70) else ch.int(-5, 5000), 0


def any_value_of(ch: Chooser, vt: int) -> Any:
    if vt == STR:
        return choice(ch, ODD_STRINGS)
    if vt in (F32, F64):
        return choice(ch, FLOATS)
    return choice(ch, INTS)


def _fault_hparam(ch, d):
    key = f"{d.arch}.{choice(ch, HPARAMS)}"
    r = ch.int(0, 9)
    if r < 5:
        d.set(key, choice(ch, [U32, I32, U64, I64]), choice(ch, INTS) if chance(ch, 70) else ch.int(0, 300))
    elif r < 8:
        d.set(key, *any_value(ch))
    else:
        d.drop(key)


def _fault_general(ch, d):
    key = choice(ch, ["general.architecture", "general.alignment", "general.name"])
    if chance(ch, 20):
        d.drop(key)
    elif key == "general.alignment" and chance(ch, 70):
        d.set(key, choice(ch, [U32, I32, U64, U8]), choice(ch, [0, 1, 3, 8, 24, 64, 4096, 2**31, 2**32 - 1, -1]))
    elif key == "general.architecture" and chance(ch, 60):
        d.set(key, STR, choice(ch, ["llama", "qwen2", "qwen3", "mamba", "", "llama\x00", "Llama"]))
    else:
        d.set(key, *any_value(ch))


def _fault_tensor(ch, d):
    if not d.tensors:
        return
    i = ch.int(0, len(d.tensors) - 1)
    t = d.tensors[i]
    r = ch.int(0, 9)
    if r == 0:
        del d.tensors[i]
    elif r <= 3 and not t.dims:
        t.dims = [choice(ch, [1, 32, 2**32])]
    elif r <= 3:
        j = ch.int(0, len(t.dims) - 1)
        t.dims = list(t.dims)
        op = ch.int(0, 6)
        if op == 0:
            t.dims[j] += choice(ch, [1, -1, 32])
        elif op == 1:
            t.dims[j] = choice(ch, INTS)
        elif op == 2:
            t.dims = t.dims[::-1]
        elif op == 3:
            t.dims.append(choice(ch, [1, 2]))
        elif op == 4:
            t.dims = t.dims[:-1] or [1]
        elif op == 5:
            t.dims = t.dims + [1] * ch.int(2, 4)
        else:
            t.dims = []
    elif r <= 5:
        t.ggml_type = choice(ch, [0, 1, 2, 3, 6, 8, 10, 12, 14, 15, 16, 30, 39, 99, 2**31, 2**32 - 1])
    elif r <= 7:
        other = choice(ch, d.tensors)
        base = 0 if other.offset is None else other.offset
        t.offset = choice(ch, [base, base + 32, base + 1, 0, 2**63, 2**64 - 32, 64, ch.int(0, 4096) * 32])
    elif r == 8:
        d.tensors.append(TensorDesc(choice(ch, d.tensors).name, list(t.dims), t.ggml_type))
    else:
        t.name = choice(ch, ["", "blk.9.attn_q.weight", "token_embd.weight", "blk.0.attn_q.weight", "\udcff", "x" * 100,
                             "blk.-1.ffn_up.weight", "blk.99999999999999999999.attn_norm.weight"])


def _fault_token_arrays(ch, d):
    key = "tokenizer.ggml." + choice(ch, ["tokens", "scores", "token_type", "merges"])
    kv = d.find(key)
    r = ch.int(0, 5)
    if kv is None or kv.vtype != ARR or kv.elem == ARR or r == 0:
        d.set(key, *any_value(ch))
    elif r == 1:
        kv.value = kv.value[: ch.int(0, len(kv.value))]
    elif r == 2:
        kv.value = kv.value + [any_value_of(ch, kv.elem) for _ in range(ch.int(1, 3))]
    elif r == 3 and kv.value:
        j = ch.int(0, len(kv.value) - 1)
        kv.value = list(kv.value)
        kv.value[j] = any_value_of(ch, kv.elem) if kv.elem != STR or chance(ch, 50) else \
            choice(ch, ["", "x" * ch.int(100, 3000), kv.value[0], "<0x41>", "\udcff", b"\xc3("])
    elif r == 4:
        elem = choice(ch, [STR, I32, U8, F32, BOOL, U64])
        d.set(key, ARR, [any_value_of(ch, elem) for _ in range(len(kv.value))], elem)
    else:
        d.drop(key)


def _fault_token_values(ch, d):
    r = ch.int(0, 3)
    if r == 0:
        d.set("tokenizer.ggml." + choice(ch, TOKEN_IDS), choice(ch, [U32, I32, U64, I64]), choice(ch, INTS))
    elif r == 1:
        d.set("tokenizer.ggml." + choice(ch, TOKEN_IDS + FLAGS), *any_value(ch))
    elif r == 2:
        key = "tokenizer.ggml." + choice(ch, ["model", "pre"])
        if chance(ch, 70):
            d.set(key, STR, choice(ch, ODD_STRINGS + ["bert", "qwen2", "llama-bpe", "default"]))
        else:
            d.set(key, *any_value(ch))
    else:
        kv = d.find("tokenizer.ggml.token_type")
        if kv is not None and kv.vtype == ARR and kv.elem != STR and kv.value:
            kv.value = list(kv.value)
            kv.value[ch.int(0, len(kv.value) - 1)] = choice(ch, [0, 1, 2, 3, 4, 5, 6, 7, -1, 255, 2**31 - 1])


def _fault_counts(ch, d):
    r = ch.int(0, 3)
    if r == 0:
        d.n_kv = len(d.kvs) + choice(ch, [-1, 1, 2**32, 2**63])
    elif r == 1:
        d.n_tensors = len(d.tensors) + choice(ch, [-1, 1, 2**32])
    elif r == 2:
        d.version = choice(ch, [0, 1, 2, 4, 2**32 - 1])
    elif d.kvs:
        d.kvs.append(KV(choice(ch, d.kvs).key, *any_value(ch)))


FAULTS = [_fault_hparam, _fault_hparam, _fault_general, _fault_tensor, _fault_tensor, _fault_token_arrays,
          _fault_token_values, _fault_counts]


def faulty_model(ch: Chooser) -> Blob:
    d = model_desc(ch)
    for _ in range(ch.int(0, 3)):
        choice(ch, FAULTS)(ch, d)
    return serialize(d)


# --- non-finite values ------------------------------------------------------------------------

NONFINITE = {"nan": (float("nan"), 0x7E00), "inf": (float("inf"), 0x7C00), "-inf": (float("-inf"), 0xFC00)}


def nonfinite_model(ch: Chooser) -> tuple[Blob, str]:
    """A consistent tiny model (model_desc) with some values of one tensor NaN, Inf or -Inf, and
    that tensor's name. F32 tensors get the float's bits at a few indices; F16 and BF16 the half's;
    block-quantized ones a float16 scale (the first field of every block type here but Q6_K,
    whose d is its last two bytes) in a few blocks, which makes every value of those blocks so.
    A caller asserts: `lever.model.finite.scan` lists exactly this tensor; and loading the file
    (Model(file=f)), a forward and `model.check_logits` on its logits either raise one line naming
    the file (a LeverError) or return finite logits: the poisoned values were never read."""
    d = model_desc(ch)
    t = choice(ch, d.tensors)
    value, half = NONFINITE[choice(ch, list(NONFINITE))]
    tt = next(x for x in TYPES.values() if x.ggml_id == t.ggml_type)
    data = bytearray(t.content or bytes(tensor_bytes(t.ggml_type, t.dims)))
    n_blocks = len(data) // tt.block_bytes
    for _ in range(ch.int(1, 4)):
        i = ch.int(0, n_blocks - 1) * tt.block_bytes
        if tt.name == "F32":
            data[i : i + 4] = struct.pack("<f", value)
        elif tt.name == "BF16":
            data[i : i + 2] = struct.pack("<I", struct.unpack("<I", struct.pack("<f", value))[0] >> 16)[:2]
        else:  # F16, and the float16 scale d of a block
            at = i + (208 if tt.name == "Q6_K" else 0)
            data[at : at + 2] = struct.pack("<H", half)
    t.content = bytes(data)
    return serialize(d), t.name
