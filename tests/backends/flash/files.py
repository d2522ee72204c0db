"""Model files on a real disk (fixtures tests/conftest.py makes available to every test, and the
helpers the flash tests call)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from lever.backends.flash import FlashConfig, FlashStore
from lever.gguf.convert import convert
from lever.gguf.file import GGUFFile

MODES = ("direct", "mmap", "cached")


# -- files


def _direct_io_works(d: Path) -> bool:
    probe = d / "odirect.probe"
    probe.write_bytes(b"\0" * 8192)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.fixture(scope="session")
def disk_dir(tmp_path_factory) -> Path:
    """A directory on a real disk: O_DIRECT fails on tmpfs, and a page cache test needs a device."""
    d = tmp_path_factory.mktemp("flash")
    if _direct_io_works(d):
        yield d
        return
    d = Path("/var/tmp") / f"lever-flash-tests-{os.getpid()}"
    d.mkdir(exist_ok=True)
    try:
        if not _direct_io_works(d):
            pytest.skip("no directory with O_DIRECT support for the flash tests")
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def write_streaming_model(path: Path, n_layer: int = 8, seed: int = 0) -> Path:
    """A GGUF of n_layer layers of random F16 and Q8_0 matrices, ~8 MiB a layer: big enough
    for /proc/self/io to measure, and written with the default 32-byte alignment."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layer)
    w.add_tensor("token_embd.weight", rng.standard_normal((256, 1024)).astype(np.float32))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(1024, np.float32))
        for name in ("attn_q", "attn_k"):  # 2 MiB each
            bits = rng.integers(0, 2**16, (1024, 1024), dtype=np.uint16)
            w.add_tensor(f"blk.{i}.{name}.weight", bits.view(np.float16))
        for name in ("ffn_up", "ffn_down"):  # 2.1 MiB each: 2048 rows of 1024 Q8_0 weights
            w.add_tensor(f"blk.{i}.{name}.weight", rng.integers(0, 256, (2048, 1088), dtype=np.uint8),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def streaming_model(disk_dir) -> Path:
    return write_streaming_model(disk_dir / "streaming.gguf")


@pytest.fixture(scope="session")
def stories_copy(stories, disk_dir) -> Path:
    """stories260K on the test disk (../shared may be read-only or not O_DIRECT-capable)."""
    dst = disk_dir / "stories260K.gguf"
    shutil.copyfile(stories, dst)
    return dst


@pytest.fixture(scope="session")
def stories_aligned(stories, disk_dir) -> Path:
    dst = disk_dir / "stories260K.aligned.gguf"
    convert(stories, dst)
    return dst



def read_into_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(16 * 2**20):
            pass


def assert_layers_match(path: Path) -> None:
    """Every layer read in each mode equals the file's bytes (one parse of the file for both)."""
    f = GGUFFile(path)
    for mode in MODES:
        with FlashStore(path, FlashConfig(mode=mode, chunk_bytes=64 * 1024), file=f) as store:
            buf = store.pool.acquire()
            seen = set()
            for layer in range(store.n_layer):
                for name, view in store.read_layer(layer, buf).items():
                    raw = f.raw(name)
                    assert view.shape == raw.shape and view.dtype == np.uint8
                    assert np.array_equal(view, raw), f"{mode}: layer {layer} {name}"
                    seen.add(name)
                store.release_layer(layer)
            assert seen == {n for n in f.tensors if n.startswith("blk.")}
