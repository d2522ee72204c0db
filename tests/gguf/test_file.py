"""The GGUF header parser: same metadata and tensor table as gguf-py's reader, and one-line
errors for corrupt headers (checked before anything is allocated from their counts)."""

from __future__ import annotations

import random
import struct

import gguf
import numpy as np
import pytest

from lever.errors import LeverError
from lever.fuzz.inputs import BOOL, KV, STR, U32, RandomChooser, serialize
from lever.fuzz.models import model_desc
from lever.gguf.file import GGUFFile
from tests.conftest import LLAMA2, QWEN_DRAFT, STORIES

FILES = [STORIES, LLAMA2, QWEN_DRAFT]


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_matches_gguf_py(path):
    if not path.exists():
        pytest.skip(f"{path} absent")
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's view of the header, not a stored key
        want = field.contents()
        got = ours.get(key)
        if isinstance(got, np.ndarray):
            got = got.tolist()
        assert got == want, key
    assert len(ours.metadata) == sum(not k.startswith("GGUF.") for k in ref.fields)
    for t in ref.tensors:
        info = ours.tensor(t.name)
        assert info.offset == t.data_offset and info.n_bytes == t.n_bytes
        assert info.shape == tuple(int(d) for d in reversed(t.shape)) and info.type.ggml_id == int(t.tensor_type)
        assert np.array_equal(ours.raw(t.name).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))


def header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def kv_string(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, len(v)) + v


def kv_u32(key: str, value: int) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<II", 4, value)


@pytest.mark.parametrize("blob,needle", [
    (header(0, 1), "metadata entry 0: needs 8 bytes"),
    (header(0, 10**15), "cannot fit"),
    (header(2**40, 0), "cannot fit"),
    (header(0, 1) + struct.pack("<Q", 2**62), "needs 4611686018427387904 bytes"),
    (header(0, 2) + kv_string("a", "x") + kv_string("a", "y"), "metadata key a: duplicate key"),
    (header(0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 99), "unknown value type 99"),
    (header(0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 2**50),
     "array of 1125899906842624 strings"),
    (header(0, 1) + kv_u32("general.alignment", 24), "general.alignment: 24 is not a power of two"),
    (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "version 1 is not supported"),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian GGUF (version 3 byte-swapped), which Lever does not read"),
])
def test_corrupt_headers_are_one_line_errors(tmp_path, blob, needle):
    p = tmp_path / "bad.gguf"
    p.write_bytes(blob)
    with pytest.raises(LeverError) as info:
        GGUFFile(p)
    msg = str(info.value)
    assert msg.startswith(str(p)) and needle in msg and "\n" not in msg


def test_tensor_past_end_of_file(tmp_path, stories):
    data = bytearray(stories.read_bytes())
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:-1000])
    with pytest.raises(LeverError, match="tensor output.weight|tensor blk.4.ffn_norm.weight|extends past the end"):
        GGUFFile(p)


def write_desc(tmp_path, d):
    p = tmp_path / "bad.gguf"
    serialize(d).write(p)
    return p


def one_line_error(p, *needles):
    with pytest.raises(LeverError) as info:
        GGUFFile(p)
    msg = str(info.value)
    assert msg.startswith(f"{p}: ") and "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, msg


def tiny_desc():
    return model_desc(RandomChooser(random.Random(0)), "llama", "gpt2")


def test_overlapping_tensor_data(tmp_path):
    d = tiny_desc()
    d.tensors[1].offset = 0  # output_norm placed over token_embd's first bytes
    one_line_error(write_desc(tmp_path, d), "corrupt GGUF: tensor token_embd.weight: data at offset",
                   "overlaps tensor output_norm.weight, which ends at")


def test_names_from_the_file_are_escaped_in_errors(tmp_path):
    d = tiny_desc()
    d.kvs += [KV("bad\nkey", U32, 1), KV("bad\nkey", STR, "again")]
    one_line_error(write_desc(tmp_path, d), "metadata key 'bad\\nkey': duplicate key")
    d = tiny_desc()
    d.tensors[0].name = "evil\nname"
    d.tensors[0].dims = [0, 5]
    one_line_error(write_desc(tmp_path, d), "tensor 'evil\\nname': dimension 0 out of range")
    d = tiny_desc()
    d.kvs.append(KV("", U32, 1))
    d.kvs.append(KV("", U32, 1))
    one_line_error(write_desc(tmp_path, d), "metadata key '': duplicate key")


def test_boolean_alignment_is_refused(tmp_path):
    d = tiny_desc()
    d.set("general.alignment", BOOL, 1)
    one_line_error(write_desc(tmp_path, d), "general.alignment: True is not a power of two")


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
def test_floats_reads_every_float_type_as_the_kernels_dequantize_it(tmp_path, qtype):
    from lever.backends.cpu import native

    path, rng = tmp_path / f"n-{qtype}.gguf", np.random.default_rng(0)
    values = rng.standard_normal(64).astype(np.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    t = gguf.GGMLQuantizationType[qtype]
    raw = {"F32": values, "F16": values.astype(np.float16),
           "BF16": (values.view(np.uint32) >> 16).astype(np.uint16)}[qtype]
    w.add_tensor("norm.weight", raw, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    want = native.dequantize(int(t), f.raw("norm.weight"), 1, 64).reshape(-1)
    np.testing.assert_array_equal(f.floats("norm.weight"), want)
