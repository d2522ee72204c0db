"""`lever pull OWNER/REPO/FILE` against a stand-in hub (tests/hub/fake_hub.py): the file lands
under $LEVER_MODELS/OWNER/REPO, checked by the digest the hub gives; a dropped connection is
resumed by Range, a pull cut short resumes in the next; a wrong sha256 leaves nothing behind;
the hub's refusals are one line naming the repository and file."""

from __future__ import annotations

import hashlib
import os
import random
import socket

import pytest

from lever.errors import LeverError
from lever.hub.download import Transfer
from lever.hub.hf import parse_spec
from lever.hub.pull import pull
from lever.hub.store import held, models_dir

REPO = "acme/tiny-GGUF"


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def test_a_pull_lands_under_the_repository_checked_by_the_hubs_sha256(hub):
    data = blob(3_000_000)
    spec = hub.add(REPO, "tiny-q4_k_m.gguf", data)
    (got,) = pull(spec)
    assert got.path == models_dir() / REPO / "tiny-q4_k_m.gguf" and got.path.read_bytes() == data
    assert got.fetched and got.checked == "sha256" and hub.gets == [None]
    again = pull(spec)[0]  # there already: checked against the hub's digest, not fetched
    assert not again.fetched and again.checked == "sha256" and hub.gets == [None]
    assert [h.relative for h in held()] == [f"{REPO}/tiny-q4_k_m.gguf"]


def test_a_file_kept_in_git_is_checked_by_its_blob_id(hub):
    data = blob(5000, seed=1)
    (got,) = pull(hub.add(REPO, "sub/dir/config.json", data, lfs=False))
    assert got.checked == "git-sha1" and got.path.read_bytes() == data
    assert got.path == models_dir() / REPO / "sub" / "dir" / "config.json"


def test_a_dropped_connection_is_resumed_where_it_stopped(hub):
    data = blob(2_500_000, seed=2)
    hub.drops = [1_000_000, 700_000]
    (got,) = pull(hub.add(REPO, "m.gguf", data))
    assert got.path.read_bytes() == data
    assert hub.gets == [None, "bytes=1000000-", "bytes=1700000-"]
    assert hub.served == len(data)  # no byte sent twice


def test_a_pull_cut_short_resumes_in_the_next_one(hub):
    data = blob(2_000_000, seed=3)
    spec = hub.add(REPO, "m.gguf", data)
    hub.drops, hub.statuses = [1_234_567], [503]  # dropped, then the hub fails the retry
    with pytest.raises(LeverError, match="HTTP 503") as e:
        pull(spec)
    assert "\n" not in str(e.value)
    dest = models_dir() / REPO / "m.gguf"
    part = dest.with_name("m.gguf.part")
    assert not dest.exists() and part.stat().st_size == 1_234_567
    assert [h.partial for h in held()] == [True]
    (got,) = pull(spec)
    assert got.fetched and got.path.read_bytes() == data and not part.exists()
    assert hub.gets[-1] == "bytes=1234567-" and hub.served == len(data)


def test_a_wrong_sha256_is_refused_and_nothing_is_left_as_if_good(hub):
    spec = hub.add(REPO, "bad.gguf", blob(400_000, seed=4), lie=True)
    with pytest.raises(LeverError) as e:
        pull(spec)
    msg = str(e.value)
    assert "\n" not in msg and "sha256" in msg and "bad.gguf" in msg and "removed" in msg
    assert held() == [] and not any(p.is_file() for p in models_dir().rglob("*"))


def test_a_copy_that_differs_from_the_hubs_is_replaced(hub):
    spec = hub.add(REPO, "m.gguf", blob(300_000, seed=5))
    dest = models_dir() / REPO / "m.gguf"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(blob(300_000, seed=6))  # same size, other bytes: an older revision, or damage
    (got,) = pull(spec)
    assert got.fetched and "replaced" in got.note and dest.read_bytes() == hub.files[f"{REPO}/main/m.gguf"]


@pytest.mark.parametrize("spec,needles", [
    (f"{REPO}/missing.gguf", [REPO, "no file missing.gguf", "revision main", "404"]),
    ("nobody/nothing/x.gguf", ["nobody/nothing", "no such repository", "401"]),
])
def test_the_hubs_refusals_are_one_line_naming_the_file(hub, spec, needles):
    hub.add(REPO, "m.gguf", b"x" * 10)
    with pytest.raises(LeverError) as e:
        pull(spec)
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)
    assert held() == []


def test_an_unreachable_hub_is_one_line_and_a_file_there_is_kept_unchecked(monkeypatch, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("LEVER_MODELS", str(tmp_path))
    with pytest.raises(LeverError, match="cannot reach the hub") as e:
        pull(f"{REPO}/m.gguf")
    assert "\n" not in str(e.value) and f"127.0.0.1:{port}" in str(e.value)
    (tmp_path / REPO).mkdir(parents=True)
    (tmp_path / REPO / "m.gguf").write_bytes(b"GGUF")
    (got,) = pull(f"{REPO}/m.gguf")
    assert not got.fetched and got.checked.startswith("not checked (")


def test_retries_without_progress_give_up_in_one_line(hub):
    data = blob(100_000, seed=7)
    spec = hub.add(REPO, "m.gguf", data)
    hub.drops = [10_000, 0, 0, 0]  # bytes once, then connections that die before any
    with pytest.raises(LeverError, match="failed 3 times at byte 10,000") as e:
        pull(spec, transfer=Transfer(retries=2, pause_s=0))
    assert "pull again to resume" in str(e.value)
    (got,) = pull(spec)  # the faults are used up: the next pull finishes from byte 10,000
    assert got.path.read_bytes() == data and hub.gets[-1] == "bytes=10000-"


def test_specs_that_are_not_repo_files_are_refused():
    for bad in ["qwen", "a/b", "a//b/c", "a/../c", "/a/b/c", "a/b/", "a/b/c d"]:
        with pytest.raises(LeverError, match="not a catalogue name nor OWNER/REPO/FILE"):
            parse_spec(bad)
    assert parse_spec("a/b/c/d.gguf") == ("a/b", "c/d.gguf")


def test_the_hub_progress_is_reported_to_the_end(hub):
    data = blob(2_200_000, seed=8)
    seen = []
    pull(hub.add(REPO, "m.gguf", data), progress=lambda label, done, total: seen.append((label, done, total)))
    fetched = [d for label, d, t in seen if label == "m.gguf"]
    assert fetched == sorted(fetched) and fetched[-1] == len(data)
    assert {t for label, _, t in seen} == {len(data)}
    assert hashlib.sha256(data).hexdigest() in hub.sha256(f"{REPO}/main/m.gguf")
    assert os.path.getsize(models_dir() / REPO / "m.gguf") == len(data)
