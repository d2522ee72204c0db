"""lever.gguf.convert: a rewrite with 4096-byte alignment keeps every tensor and key."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest

from lever.backends.flash import FlashStore
from lever.errors import LeverError
from lever.gguf.convert import convert
from tests.tiny_gguf import write_tiny_model

# -- convert


def test_convert_round_trip(stories, stories_aligned):
    src, out = gguf.GGUFReader(stories), gguf.GGUFReader(stories_aligned)
    assert out.alignment == 4096 and out.fields["general.alignment"].contents() == 4096
    keys = [k for k in src.fields if k != "general.alignment"]
    assert keys == [k for k in out.fields if k != "general.alignment"]
    for k in keys:
        if not k.startswith("GGUF."):
            assert src.fields[k].types == out.fields[k].types
            assert src.fields[k].contents() == out.fields[k].contents(), k
    assert [t.name for t in src.tensors] == [t.name for t in out.tensors]
    for a, b in zip(src.tensors, out.tensors):
        assert b.data_offset % 4096 == 0
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape)
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8))
    # Whole pages: each layer is one run read with no slack before its first tensor.
    with FlashStore(stories_aligned) as store:
        for e in store.extents:
            assert len(e.runs) == 1 and e.runs[0].file_start == e.runs[0].data_start


def test_convert_keeps_every_kv_type(tmp_path):
    src = write_tiny_model(tmp_path / "tiny.gguf", "qwen2", "Q8_0")  # strings, arrays, ints, floats, bools
    out = tmp_path / "tiny.aligned.gguf"
    convert(src, out, alignment=8192)
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(out)
    assert b.alignment == 8192
    types = {a.fields[k].types[0] for k in a.fields}
    assert {gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL} <= types
    for k in a.fields:
        if not k.startswith("GGUF."):
            assert a.fields[k].contents() == b.fields[k].contents(), k
    assert (out.stat().st_mode & 0o777) == (src.stat().st_mode & 0o777)


def test_convert_in_place_and_errors(stories, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copyfile(stories, path)
    convert(path, path)
    assert gguf.GGUFReader(path).alignment == 4096
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(LeverError, match="power of two"):
        convert(path, tmp_path / "x.gguf", alignment=3000)
    with pytest.raises(LeverError, match="no such file"):
        convert(tmp_path / "absent.gguf", tmp_path / "x.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(LeverError, match="junk.gguf"):
        convert(tmp_path / "junk.gguf", tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
