"""A draft whose tokenizer is not the target's is refused at load with figures; another table of
the same tokenizer is mapped (tests/gguf/test_vocab_map.py); special ids that do not correspond
are warned."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from lever.config import load_config
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.vocab_map import compare_vocabularies
from lever.pipelines.engine import Engine
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


def test_permuted_tokens_are_mapped_not_refused(tmp_path):
    def permute(toks):
        rng = np.random.default_rng(0)
        body = toks[300:]
        return toks[:300] + [body[i] for i in rng.permutation(len(body))]

    draft = _draft_with(tmp_path, "tokenizer.ggml.tokens", permute)
    assert compare_vocabularies(GGUFFile(TARGET), GGUFFile(draft)) == []
    cfg = load_config(None, [f'model.target="{TARGET}"', f'model.draft="{draft}"'])
    Engine.open(cfg, "speculative").close()


def test_a_renamed_special_token_is_unmapped_and_its_ids_warned(tmp_path, capsys):
    draft = _draft_with(tmp_path, "tokenizer.ggml.tokens", lambda t: [b"<|endoftexx|>"] + t[1:])  # id 0 is CONTROL
    (w,) = compare_vocabularies(GGUFFile(TARGET), GGUFFile(draft))
    assert "special ids differ (bos_token_id 0 (target id none) vs 0, eos_token_id 0 (target id none) vs 0)" in w
    cfg = load_config(None, [f'model.target="{TARGET}"', f'model.draft="{draft}"'])
    Engine.open(cfg, "speculative").close()
    assert "lever: warning: " in capsys.readouterr().err


def test_other_merges_are_refused_and_special_ids_warned(tmp_path):
    draft = _draft_with(tmp_path, "tokenizer.ggml.merges", lambda m: [m[1], m[0], *m[2:]])
    with pytest.raises(LeverError) as e:
        compare_vocabularies(GGUFFile(TARGET), GGUFFile(draft))
    msg = str(e.value)
    assert f"draft {draft} and target {TARGET}: merges differ (2 of 3,839): the same text would be cut" in msg, msg
    assert "\n" not in msg
    cfg = load_config(None, [f'model.target="{TARGET}"', f'model.draft="{draft}"'])
    with pytest.raises(LeverError, match=r"merges differ \(2 of 3,839\)"):  # where the pair is opened, before loading
        Engine.open(cfg, "speculative")
    data = bytearray(DRAFT.read_bytes())
    key = b"tokenizer.ggml.eos_token_id"
    pos = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<I", data, pos)[0] == 4  # a uint32
    struct.pack_into("<I", data, pos + 4, 7)
    moved = tmp_path / "eos.gguf"
    moved.write_bytes(bytes(data))
    (w,) = compare_vocabularies(GGUFFile(TARGET), GGUFFile(moved))
    assert "special ids differ (eos_token_id 7 vs 0)" in w


def test_the_comparison_passes_the_shipped_qwen_pair_and_counts_every_differing_merge(tmp_path):
    """On the real tables (151,936 tokens, 151,387 merges). How long it takes is a figure, not a
    test: a whole-list comparison and one pass over the merges, tens of ms on the shared box."""
    if not (QWEN_TARGET.exists() and QWEN_DRAFT.exists()):
        pytest.skip("the Qwen2.5-Coder pair is not fetched")
    t, d = GGUFFile(QWEN_TARGET), GGUFFile(QWEN_DRAFT)
    assert compare_vocabularies(t, d) == []
    # and when every merge differs, the figures too (a table with every id moved: test_vocab_map.py)
    _with_strings(QWEN_DRAFT, tmp_path / "d.gguf", "tokenizer.ggml.merges", lambda m: m[1:] + m[:1])
    d = GGUFFile(tmp_path / "d.gguf")
    with pytest.raises(LeverError, match=r"merges differ \(151,387 of 151,387\)"):
        compare_vocabularies(t, d)
