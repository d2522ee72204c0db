"""lever.hub.store: what the models folder holds (GGUFs and partial downloads, hidden staging
left out), names that cannot leave the folder, and digests as git and sha256sum compute them."""

from __future__ import annotations

import hashlib
import shutil
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lever.errors import LeverError
from lever.hub.store import file_digest, held, inside, models_dir


def test_held_lists_models_and_partial_downloads_by_path(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / ".m.gguf.wheels").mkdir()
    files = {"z.gguf": 3, "a/b/x.gguf": 5, "a/y.gguf.part": 7, ".m.gguf.wheels/w.gguf": 1, "notes.txt": 2,
             "z.gguf.lever-profile.msgpack": 4, ".hidden.gguf": 1}
    for name, n in files.items():
        (tmp_path / name).write_bytes(b"x" * n)
    assert [(h.relative, h.size, h.partial) for h in held(tmp_path)] == [
        ("a/b/x.gguf", 5, False), ("a/y.gguf.part", 7, True), ("z.gguf", 3, False)]
    assert held(tmp_path / "absent") == []


def test_models_dir_is_lever_models_else_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LEVER_MODELS", str(tmp_path))
    assert models_dir() == tmp_path
    monkeypatch.delenv("LEVER_MODELS")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models_dir() == tmp_path / "home" / ".cache" / "lever" / "models"


@given(st.lists(st.sampled_from(["a", "..", ".", "", "b.gguf", "/", "x/../.."]), min_size=1, max_size=5))
def test_a_name_inside_the_folder_stays_inside(parts):
    root = models_dir().parent / "root-for-names"
    name = "/".join(parts)
    try:
        path = inside(root, name)
    except LeverError as e:
        assert "\n" not in str(e) and "not a file name inside" in str(e)
        return
    assert path.resolve().is_relative_to(root.resolve()) and path.resolve() != root.resolve()


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed: its blob ids are the reference")
def test_digests_are_git_blob_ids_and_sha256(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 1000)
    git = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True, check=True).stdout.strip()
    assert file_digest(path, "git-sha1") == git
    assert file_digest(path) == hashlib.sha256(path.read_bytes()).hexdigest()
