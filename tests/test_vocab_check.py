"""A draft whose token table is not the target's is refused at load with figures; minor
differences (special tokens, special ids, merges) are warned (issue 18, class 9)."""

from __future__ import annotations

import shutil
import struct
import time

import numpy as np
import pytest

from lever.config import load_config
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.tokenizer import compare_vocabularies
from lever.pipelines.session import Engine
from lever.shipped import shipped
from tests.conftest import QWEN_DRAFT, QWEN_TARGET

TARGET, DRAFT = shipped("models", "stdlib-target-q4_0.gguf"), shipped("models", "stdlib-draft-q8_0.gguf")


def _strings_at(data: bytes, key: str) -> tuple[int, list[bytes]]:
    """Where the string array `key` holds its first string, and its strings (GGUF v3, little-endian)."""
    name = key.encode()
    pos = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    vtype, elem, n = struct.unpack_from("<IIQ", data, pos)
    assert (vtype, elem) == (9, 8)  # an array of strings
    pos += 16
    start, out = pos, []
    for _ in range(n):
        (size,) = struct.unpack_from("<Q", data, pos)
        out.append(data[pos + 8 : pos + 8 + size])
        pos += 8 + size
    return start, out


def _with_strings(src, dst, key: str, change) -> None:
    """A copy of src whose string array `key` is changed by `change` (a list -> a list of the
    same total length, so that no offset after it moves)."""
    data = bytearray(src.read_bytes())
    start, strings = _strings_at(bytes(data), key)
    new = change(list(strings))
    blob = b"".join(struct.pack("<Q", len(s)) + s for s in new)
    assert len(blob) == sum(8 + len(s) for s in strings)
    data[start : start + len(blob)] = blob
    dst.write_bytes(bytes(data))


def _draft_with(tmp_path, key: str, change):
    path = tmp_path / "draft.gguf"
    _with_strings(DRAFT, path, key, change)
    return path


def test_the_shipped_pair_shares_its_table():
    assert compare_vocabularies(GGUFFile(TARGET), GGUFFile(DRAFT)) == []


def test_permuted_tokens_are_refused_with_figures(tmp_path):
    def permute(toks):
        rng = np.random.default_rng(0)
        body = toks[300:]
        return toks[:300] + [body[i] for i in rng.permutation(len(body))]

    draft = _draft_with(tmp_path, "tokenizer.ggml.tokens", permute)
    with pytest.raises(LeverError) as e:
        compare_vocabularies(GGUFFile(TARGET), GGUFFile(draft))
    msg = str(e.value)
    assert f"draft {draft} and target {TARGET}: 4,096 tokens, " in msg and "differ (first at id 300: " in msg, msg
    assert "\n" not in msg
    # and where the pair is opened, before anything is loaded
    cfg = load_config(None, [f'model.target="{TARGET}"', f'model.draft="{draft}"'])
    with pytest.raises(LeverError, match=r"4,096 tokens, [0-9,]+ differ \(first at id 300"):
        Engine.open(cfg, "speculative")


def test_special_tokens_only_are_warned(tmp_path, capsys):
    draft = _draft_with(tmp_path, "tokenizer.ggml.tokens", lambda t: [b"<|endoftexx|>"] + t[1:])  # id 0 is CONTROL
    (w,) = compare_vocabularies(GGUFFile(TARGET), GGUFFile(draft))
    assert "4,096 tokens, 1 differ (first at id 0: '<|endoftexx|>' vs '<|endoftext|>'), special tokens only" in w
    cfg = load_config(None, [f'model.target="{TARGET}"', f'model.draft="{draft}"'])
    Engine.open(cfg, "speculative").close()
    assert "lever: warning: " in capsys.readouterr().err


def test_merges_and_special_ids_are_warned(tmp_path):
    draft = _draft_with(tmp_path, "tokenizer.ggml.merges", lambda m: [m[1], m[0], *m[2:]])
    (w,) = compare_vocabularies(GGUFFile(TARGET), GGUFFile(draft))
    assert "merges differ (2 of 3,839)" in w
    data = bytearray(DRAFT.read_bytes())
    key = b"tokenizer.ggml.eos_token_id"
    pos = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<I", data, pos)[0] == 4  # a uint32
    struct.pack_into("<I", data, pos + 4, 7)
    moved = tmp_path / "eos.gguf"
    moved.write_bytes(bytes(data))
    (w,) = compare_vocabularies(GGUFFile(TARGET), GGUFFile(moved))
    assert "special ids differ (eos_token_id 7 vs 0)" in w


def test_the_comparison_is_cheap_on_qwen(tmp_path):
    if not (QWEN_TARGET.exists() and QWEN_DRAFT.exists()):
        pytest.skip("the Qwen2.5-Coder pair is not fetched")
    t, d = GGUFFile(QWEN_TARGET), GGUFFile(QWEN_DRAFT)
    t0 = time.perf_counter()
    assert compare_vocabularies(t, d) == []
    assert time.perf_counter() - t0 < 0.05
    shutil.copyfile(QWEN_DRAFT, tmp_path / "d.gguf")  # and when every token differs, the figures too
    _with_strings(QWEN_DRAFT, tmp_path / "d.gguf", "tokenizer.ggml.tokens", lambda toks: toks[1:] + toks[:1])
    d = GGUFFile(tmp_path / "d.gguf")
    t0 = time.perf_counter()
    with pytest.raises(LeverError, match="151,936 tokens, "):
        compare_vocabularies(t, d)
    assert time.perf_counter() - t0 < 0.05
