"""lever.hub.download: whatever the connection does, the file that takes its name is the
source's bytes, each sent once; a second pull of the same .part is refused, not interleaved."""

from __future__ import annotations

import hashlib
import random
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lever.errors import LeverError
from lever.hub.download import Digest, Transfer, fetch, locked_part
from tests.hub.fake_hub import FakeHub
from tests.sizes import cases


@pytest.fixture(scope="module")
def server():
    with FakeHub() as h:
        yield h


@settings(max_examples=cases(40), deadline=None)
@given(size=st.integers(1, 300_000), cuts=st.lists(st.floats(0.0, 1.0), max_size=6), seed=st.integers(0, 2**16),
       left=st.floats(0.0, 1.0))
def test_any_drops_and_any_partial_start_end_in_the_exact_bytes_each_sent_once(server, size, cuts, seed, left):
    """A .part left by an earlier pull (`left` of the file), then connections cut after random
    byte counts: the fetch ends with the exact bytes, and the server sent each byte once."""
    data = random.Random(seed).randbytes(size)
    sha = hashlib.sha256(data).hexdigest()
    server.files[f"r/x/main/{seed}-{size}"] = data
    have = int(left * size) if left < 1 else size - 1
    server.drops = [max(1, int(c * (size - have))) for c in cuts]  # each cut moves at least a byte
    server.served, server.gets = 0, []
    with tempfile.TemporaryDirectory() as d:
        dest = Path(d) / "m.gguf"
        dest.with_name("m.gguf.part").write_bytes(data[:have])
        fetch(f"{server.endpoint}/cdn/{sha}", dest, size=size, digest=Digest("sha256", sha),
              transfer=Transfer(pause_s=0))
        assert dest.read_bytes() == data and not dest.with_name("m.gguf.part").exists()
    assert server.served == size - have
    assert server.gets[0] == (f"bytes={have}-" if have else None)


def test_a_part_longer_than_the_file_starts_over(server, tmp_path):
    data = b"0123456789" * 1000
    sha = hashlib.sha256(data).hexdigest()
    server.files["r/x/main/long"] = data
    dest = tmp_path / "m.gguf"
    dest.with_name("m.gguf.part").write_bytes(b"z" * (len(data) + 5))
    fetch(f"{server.endpoint}/cdn/{sha}", dest, size=len(data), digest=Digest("sha256", sha))
    assert dest.read_bytes() == data


def test_a_part_another_pull_writes_is_refused(tmp_path):
    dest = tmp_path / "m.gguf"
    with locked_part(dest):
        with pytest.raises(LeverError, match="another pull is writing it"):
            fetch("http://127.0.0.1:9/never", dest, size=1, digest=None)
    assert not dest.exists()
