"""Flash is real, and a phone's flash can be emulated: device bytes are counted after the file
was put in the page cache on purpose; bandwidth caps and latency are asserted as loose lower bounds."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from lever.backends.flash import FlashConfig, FlashStore
from lever.backends.flash.device import process_read_bytes
from tests.backends.flash.files import MODES, read_into_page_cache
from tests.conftest import QWEN_DRAFT, require

# -- flash is real: the device is read even when the file sits in the page cache


@pytest.fixture(scope="session")
def qwen_own(disk_dir) -> Path:
    """The Qwen draft copied to a file of this run's own. The shared one may be mapped by another
    process on the machine (a test run beside this one that loaded the pair), and pages mapped
    elsewhere stay in the page cache whatever this process advises: fewer bytes would come from
    the device than were read, and the device counts below would fail beside other work."""
    shared = require(QWEN_DRAFT)
    path = disk_dir / f"own-{shared.name}"
    if not path.exists():
        shutil.copyfile(shared, path)
    return path


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which", ["generated", "qwen"])
def test_device_bytes_match_streamed_bytes(which, mode, streaming_model, request):
    if process_read_bytes() is None:
        pytest.skip("/proc/self/io read_bytes unavailable")
    path = streaming_model if which == "generated" else request.getfixturevalue("qwen_own")
    read_into_page_cache(path)
    with FlashStore(path, FlashConfig(mode=mode)) as store:
        assert store.streamed_bytes >= 40 * 2**20
        buf = store.pool.acquire()
        for layer in store.streamed:
            store.read_layer(layer, buf)
            store.release_layer(layer)
        stats = store.stats()
    assert stats.requested_bytes == store.streamed_bytes
    assert stats.data_bytes <= stats.requested_bytes
    assert stats.reads == sum(stats.latency_hist_us) == sum(len(store.plan_reads(i)) for i in store.streamed)
    assert abs(stats.device_read_bytes - stats.requested_bytes) <= 0.1 * stats.requested_bytes, stats


def test_mmap_mode_leaves_no_layer_in_page_cache(streaming_model):
    with FlashStore(streaming_model, FlashConfig(mode="mmap")) as store:
        buf = store.pool.acquire()
        store.read_layer(1, buf)
        store.release_layer(1)
        run = store.extents[1].runs[0]
        assert _cached_bytes(streaming_model, run.file_start, run.n_bytes) <= 2 * 4096


def _cached_bytes(path: Path, start: int, n: int) -> int:
    """Bytes of [start, start + n) in the page cache, by mincore on a fresh mapping."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
        arr = np.frombuffer(m, np.uint8)
        vec = (ctypes.c_ubyte * (-(-n // 4096)))()
        assert libc.mincore(ctypes.c_void_p(arr.ctypes.data + start), ctypes.c_size_t(n), vec) == 0
        del arr
        return int((np.frombuffer(vec, np.uint8) & 1).sum()) * 4096

# -- emulated phone flash


def test_bandwidth_cap(streaming_model):
    cfg = FlashConfig(bandwidth_cap_bytes_per_s=40e6, chunk_bytes=1 << 20)
    with FlashStore(streaming_model, cfg) as store:
        buf = store.pool.acquire()
        reads = store.plan_reads(0)
        assert sum(r.n_bytes for r in reads) >= 8 * 10**6
        t0 = time.monotonic()
        # Concurrent readers share the cap rather than each getting it.
        threads = [threading.Thread(target=store.read, args=(r, buf)) for r in reads]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        store.tensors(0, buf)
    assert elapsed >= 0.18


def test_read_latency(stories_copy):
    with FlashStore(stories_copy, FlashConfig(read_latency_ms=20)) as store:
        buf = store.pool.acquire()
        t0 = time.monotonic()
        for layer in range(5):
            store.read_layer(layer, buf)
        assert time.monotonic() - t0 >= 5 * 0.018
        assert store.stats().read_s >= 5 * 0.018
