"""Hyperparameters and tensors checked when a model opens: a crafted file gives one line naming
the file, the key or tensor and what is wrong, never an exception from inside the model.

Files are tiny models from lever.fuzz.inputs (consistent to begin with) with one value changed.
"""

from __future__ import annotations

import random
import struct
import warnings

import numpy as np
import pytest

from lever.errors import LeverError
from lever.fuzz.inputs import ARR, F32, I32, STR, U32, U64, RandomChooser, TensorDesc, serialize
from lever.fuzz.models import model_desc
from lever.gguf.file import GGUFFile
from lever.gguf.spec import MAX_LAYERS, read_spec
from lever.model.transformer import Model


def desc(arch: str = "llama", vocab: str = "gpt2"):
    return model_desc(RandomChooser(random.Random(0)), arch, vocab)


def hp(d, key: str):
    return d.find(f"{d.arch}.{key}").value


def refused(tmp_path, d, *needles: str) -> str:
    """Model(load_layers=False), the flash target's way in, must refuse d with one line."""
    path = tmp_path / "bad.gguf"
    serialize(d).write(path)
    with pytest.raises(LeverError) as e:
        Model(path, load_layers=False)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_the_base_models_open(tmp_path):
    for arch, vocab in (("llama", "gpt2"), ("qwen2", "gpt2"), ("qwen3", "gpt2"), ("llama", "llama")):
        path = tmp_path / f"{arch}.gguf"
        serialize(desc(arch, vocab)).write(path)
        assert Model(path).spec.arch == arch


@pytest.mark.parametrize("key,vtype,value,needle", [
    ("block_count", STR, "5", "llama.block_count is the string '5', expected an integer"),
    ("block_count", I32, -1, "llama.block_count = -1 is out of range [1, 4096]"),
    ("block_count", U32, 0, "llama.block_count = 0 is out of range"),
    ("block_count", U64, 2**40, f"llama.block_count = {2**40} is out of range [1, {MAX_LAYERS}]"),
    ("embedding_length", ARR, [1, 2], "llama.embedding_length is an array of 2, expected an integer"),
    ("feed_forward_length", F32, 1.5, "llama.feed_forward_length is float 1.5, expected an integer"),
    ("feed_forward_length", U64, 2**63, "llama.feed_forward_length = 9223372036854775808 is out of range"),
    ("attention.head_count", U32, 0, "llama.attention.head_count = 0 is out of range"),
    ("context_length", U64, 2**40, "llama.context_length = 1099511627776 is out of range [1, 2147483647]"),
    ("attention.layer_norm_rms_epsilon", F32, float("nan"), "layer_norm_rms_epsilon = nan is out of range (0, 1]"),
    ("attention.layer_norm_rms_epsilon", F32, 0.0, "layer_norm_rms_epsilon = 0.0 is out of range"),
    ("attention.layer_norm_rms_epsilon", STR, "1e-5", "layer_norm_rms_epsilon is the string '1e-5', expected a number"),
    ("rope.freq_base", F32, 0.0, "llama.rope.freq_base = 0.0 is out of range (1, 1e+15]"),
    ("rope.freq_base", F32, float("inf"), "llama.rope.freq_base = inf is out of range"),
    ("rope.dimension_count", U32, 3, "llama.rope.dimension_count = 3 is odd"),
    ("rope.dimension_count", U32, 10**6, "llama.rope.dimension_count = 1000000 is out of range"),
    ("rope.scaling.type", STR, "yarn", "llama.rope.scaling.type = 'yarn' is not supported"),
    ("rope.scaling.type", U32, 1, "llama.rope.scaling.type is int 1, expected a string"),
    ("vocab_size", U32, 7, "llama.vocab_size = 7 but token_embd.weight has"),
])
def test_bad_hyperparameter(tmp_path, key, vtype, value, needle):
    d = desc()
    d.set(f"llama.{key}", vtype, value)
    refused(tmp_path, d, needle)


def test_missing_hyperparameter(tmp_path):
    d = desc()
    d.drop("llama.block_count")
    refused(tmp_path, d, "missing metadata key llama.block_count")


def test_linear_rope_scaling_factor_is_checked(tmp_path):
    d = desc()
    d.set("llama.rope.scaling.type", STR, "linear")
    d.set("llama.rope.scaling.factor", F32, 0.0)
    refused(tmp_path, d, "llama.rope.scaling.factor = 0.0 is out of range")


def test_heads_must_divide(tmp_path):
    d = desc()
    d.set("llama.attention.head_count", U32, 4)
    d.set("llama.attention.head_count_kv", U32, 3)
    refused(tmp_path, d, "llama.attention.head_count_kv = 3 does not divide head_count 4")
    d.set("llama.attention.head_count_kv", U32, 8)
    refused(tmp_path, d, "llama.attention.head_count_kv = 8 is out of range [1, 4]")
    n_embd = hp(d, "embedding_length")
    d.set("llama.attention.head_count", U32, n_embd + 1)
    d.set("llama.attention.head_count_kv", U32, 1)
    refused(tmp_path, d, f"head_count = {n_embd + 1} does not divide embedding_length {n_embd}")


def test_value_length_must_equal_key_length(tmp_path):
    d = desc("qwen3")
    d.set("qwen3.attention.value_length", U32, hp(d, "attention.key_length") * 2)
    refused(tmp_path, d, "qwen3.attention.value_length", "differs from the key length")


def tensor(d, name: str) -> TensorDesc:
    return next(t for t in d.tensors if t.name == name)


def test_layer_tensor_shape_is_checked_at_open(tmp_path):
    d = desc()
    q = tensor(d, "blk.1.attn_q.weight")
    n_in, n_out = q.dims
    q.dims = [n_in, n_out + 2]
    refused(tmp_path, d, f"tensor blk.1.attn_q.weight has shape ({n_out + 2}, {n_in}), expected ({n_out}, {n_in})")


@pytest.mark.parametrize("name", ["blk.1.ffn_down.weight", "blk.0.attn_norm.weight", "output_norm.weight"])
def test_missing_required_tensor(tmp_path, name):
    d = desc()
    d.tensors = [t for t in d.tensors if t.name != name]
    refused(tmp_path, d, f"missing tensor {name}")


@pytest.mark.parametrize("arch,name", [("qwen2", "blk.0.attn_k.bias"), ("qwen3", "blk.1.attn_q_norm.weight")])
def test_tensors_the_architecture_needs(tmp_path, arch, name):
    d = desc(arch)
    d.tensors = [t for t in d.tensors if t.name != name]
    refused(tmp_path, d, f"missing tensor {name} ({arch} needs it)")


def test_output_and_norm_shapes(tmp_path):
    d = desc()
    out = tensor(d, "output.weight")
    out.dims = [out.dims[0], out.dims[1] - 1]
    refused(tmp_path, d, "tensor output.weight has shape")
    d = desc()
    tensor(d, "output_norm.weight").dims = [hp(d, "embedding_length") * 2]
    refused(tmp_path, d, "tensor output_norm.weight has shape")
    d = desc()
    emb = tensor(d, "token_embd.weight")
    emb.dims = [emb.dims[0] * 2, emb.dims[1]]
    refused(tmp_path, d, "tensor token_embd.weight has shape", "expected (n_vocab, ")


def test_layer_beyond_block_count(tmp_path):
    d = desc()
    d.tensors.append(TensorDesc("blk.7.attn_norm.weight", [hp(d, "embedding_length")], 0))
    refused(tmp_path, d, "tensor blk.7.attn_norm.weight is beyond the 2 layers of llama.block_count")
    d.tensors[-1].name = "blk." + "9" * 5000 + ".attn_norm.weight"  # more digits than int() takes
    refused(tmp_path, d, "is beyond the 2 layers")


def test_token_list_must_match_the_embedding_rows(tmp_path):
    d = desc()
    tokens = d.find("tokenizer.ggml.tokens")
    n = len(tokens.value)
    tokens.value = tokens.value + ["extra"]
    d.find("tokenizer.ggml.token_type").value.append(1)
    refused(tmp_path, d, f"tokenizer.ggml.tokens has {n + 1} tokens but token_embd.weight has {n} rows")


def rope_freqs(values) -> TensorDesc:
    return TensorDesc("rope_freqs.weight", [len(values)], 0, content=struct.pack(f"<{len(values)}f", *values))


def test_rope_freqs_length_and_values(tmp_path):
    half = hp(desc(), "rope.dimension_count") // 2
    d = desc()
    d.tensors.insert(0, rope_freqs([1.0] * (half + 1)))
    refused(tmp_path, d, f"tensor rope_freqs.weight has shape ({half + 1},), expected ({half},)")
    d = desc()
    d.tensors.insert(0, rope_freqs([1.0] * (half - 1) + [0.0]))
    refused(tmp_path, d, f"tensor rope_freqs.weight[{half - 1}] = 0.0 is out of range")
    d = desc()
    d.tensors.insert(0, rope_freqs([2.0] * half))
    path = tmp_path / "ok.gguf"
    serialize(d).write(path)
    assert np.allclose(read_spec(GGUFFile(path)).rope_freq_factors, 2.0)


def test_signalling_nan_rope_freqs_are_refused_without_a_warning(tmp_path):
    half = hp(desc(), "rope.dimension_count") // 2
    d = desc()
    d.tensors.insert(0, TensorDesc("rope_freqs.weight", [half], 0, content=struct.pack("<I", 0x7F800001) * half))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        refused(tmp_path, d, "tensor rope_freqs.weight[0] = nan is out of range")
