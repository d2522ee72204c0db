"""lever.hub.pull: a catalogue file from a URL (as the small test models come), checked by the
catalogue's sha256, a wrong copy under its name removed; the catalogue's state as `lever list`
shows it."""

from __future__ import annotations

import hashlib
import random

import pytest

from lever.errors import LeverError
from lever.hub.catalogue import ENTRIES, PAIRS, Entry, Url
from lever.hub.pull import catalogue_state, find_model, name_of, pull, pull_entry
from lever.hub.store import held, models_dir


def url_entry(hub, data: bytes, sha256: str | None = None) -> Entry:
    sha = hashlib.sha256(data).hexdigest()
    hub.files[f"gh/raw/main/{sha}"] = data
    return Entry(name="tiny", filename="tiny.gguf", size=len(data), sha256=sha256 or sha,
                 source=Url(url=f"{hub.endpoint}/cdn/{sha}", origin="a test"), about="a test file")


def test_a_url_entry_is_fetched_checked_and_then_found(hub):
    data = random.Random(0).randbytes(250_000)
    e = url_entry(hub, data)
    got = pull_entry(e, root=models_dir())
    assert got.fetched and got.checked == "sha256" and got.path.read_bytes() == data
    again = pull_entry(e, root=models_dir())
    assert not again.fetched and len(hub.gets) == 1


def test_a_wrong_copy_under_the_name_is_removed_and_fetched_again(hub):
    data = random.Random(1).randbytes(100_000)
    e = url_entry(hub, data)
    root = models_dir()
    root.mkdir(parents=True)
    (root / "tiny.gguf").write_bytes(data[:-1] + b"!")
    got = pull_entry(e, root=root)
    assert got.fetched and "removed and fetched again" in got.note and got.path.read_bytes() == data


def test_a_source_whose_bytes_are_not_the_catalogues_leaves_nothing(hub):
    e = url_entry(hub, b"x" * 50_000, sha256="1" * 64)
    with pytest.raises(LeverError, match="sha256 .* is not the expected 1111") as err:
        pull_entry(e, root=models_dir())
    assert "\n" not in str(err.value) and held(models_dir()) == []


def test_an_unwritable_models_folder_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("LEVER_MODELS", str(tmp_path / "file" / "models"))
    with pytest.raises(LeverError, match="cannot make the models folder .* set LEVER_MODELS"):
        pull("stories260k")


def test_the_catalogue_state_follows_the_folder(tmp_path):
    small = next(e for e in ENTRIES if e.name == "stories260k")
    pair, (target, draft) = next(iter(PAIRS.items()))
    state = {k.name: k.state for k in catalogue_state(tmp_path)}
    assert set(state.values()) == {"absent"}
    (tmp_path / f"{small.filename}.part").write_bytes(b"x")
    (tmp_path / next(e.filename for e in ENTRIES if e.name == target)).write_bytes(b"short")
    state = {k.name: k.state for k in catalogue_state(tmp_path)}
    assert state[small.name] == "partial" and state[target] == "absent" and state[pair] == "absent"
    with open(tmp_path / small.filename, "wb") as f:
        f.truncate(small.size)  # the right size: `list` says pulled, `pull` would check the bytes
    assert {k.name: k.state for k in catalogue_state(tmp_path)}[small.name] == "pulled"
    assert [name_of(h) for h in held(tmp_path)] == ["qwen2.5-coder-1.5b", small.name, small.name]
    assert draft in {e.name for e in ENTRIES}


def test_a_model_is_found_by_its_name_or_its_path_in_the_folder(tmp_path):
    small = next(e for e in ENTRIES if e.name == "stories260k")
    assert find_model(small.name, tmp_path) is None  # not pulled: nothing to run
    (tmp_path / small.filename).write_bytes(b"GGUF")
    hub = tmp_path / "owner" / "repo" / "m.gguf"
    hub.parent.mkdir(parents=True)
    hub.write_bytes(b"GGUF")
    (tmp_path / "notes.txt").write_bytes(b"x")
    assert find_model(small.name, tmp_path) == find_model(small.filename, tmp_path) == tmp_path / small.filename
    assert find_model("owner/repo/m.gguf", tmp_path) == hub
    for bad in ("notes.txt", "../" + small.filename, "/etc/passwd", "owner", "stories"):
        assert find_model(bad, tmp_path) is None, bad
