"""The flash backend against real files: bytes, device reads, residency, the window, faults, convert.

Every read is checked against the file's own bytes (GGUFFile.raw), and "flash is real" is
checked with the kernel's count of bytes fetched from the device, after the file was put in
the page cache on purpose. Timing is asserted only as loose lower bounds of the emulation.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from lever.backends.flash import Budget, BufferPool, FlashConfig, FlashStore, parse_budget, plan_residency
from lever.backends.flash.device import process_read_bytes
from lever.errors import LeverError
from lever.gguf.convert import convert
from lever.gguf.file import GGUFFile
from tests.conftest import QWEN_DRAFT, require
from tests.tiny_gguf import write_tiny_model

MODES = ("direct", "mmap")


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


@pytest.fixture
def qwen_small() -> Path:
    return require(QWEN_DRAFT)


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


# -- bytes read equal the file's bytes, in both modes


def test_stories_layers_match_file(stories_copy):
    assert GGUFFile(stories_copy).tensors["blk.0.attn_norm.weight"].offset % 4096  # unaligned: rounding slack
    assert_layers_match(stories_copy)


def test_converted_layers_match_file(stories_aligned):
    assert_layers_match(stories_aligned)


def test_qwen_layers_match_file(qwen_small):
    assert_layers_match(qwen_small)


def test_chunked_layer_in_any_read_order(streaming_model):
    with FlashStore(streaming_model, FlashConfig(chunk_bytes=1 << 20)) as store:
        buf = store.pool.acquire()
        reads = store.plan_reads(3)
        assert len(reads) > 4
        for r in reversed(reads):
            store.read(r, buf)
        f = GGUFFile(streaming_model)
        for name, view in store.tensors(3, buf).items():
            assert np.array_equal(view, f.raw(name))


def test_streamed_bytes_build_a_layer(stories_copy):
    from lever.backends.cpu import layer as model
    from lever.gguf.spec import read_spec

    f = GGUFFile(stories_copy)
    spec = read_spec(f)
    with FlashStore(stories_copy, file=f) as store:
        buf = store.pool.acquire()
        lw = model.load_layer(f, spec, 2, raws=store.read_layer(2, buf))
        assert np.array_equal(lw.wq.data, f.raw("blk.2.attn_q.weight"))
        assert not np.shares_memory(lw.wq.data, f.raw("blk.2.attn_q.weight"))


# -- flash is real: the device is read even when the file sits in the page cache


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which", ["generated", "qwen"])
def test_device_bytes_match_streamed_bytes(which, mode, streaming_model, request):
    if process_read_bytes() is None:
        pytest.skip("/proc/self/io read_bytes unavailable")
    path = streaming_model if which == "generated" else request.getfixturevalue("qwen_small")
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


# -- residency


def test_parse_budget_syntax():
    assert parse_budget(1 << 20) == Budget("bytes", 1 << 20)
    assert parse_budget("512MiB") == Budget("bytes", 512 << 20)
    assert parse_budget("2GB") == Budget("bytes", 2_000_000_000)
    assert parse_budget("0") == Budget("bytes", 0)
    assert parse_budget(0.25) == Budget("fraction", 0.25)
    assert parse_budget("0.25") == Budget("fraction", 0.25)
    assert parse_budget("25%") == Budget("fraction", 0.25)
    assert parse_budget("1.0") == Budget("fraction", 1.0)
    assert parse_budget("8L") == Budget("layers", 8)
    assert parse_budget("8 layers") == Budget("layers", 8)
    for bad in ("lots", "1.5", "-3", "150%", -1, True, "3.5L"):
        with pytest.raises(LeverError, match="dram_budget"):
            parse_budget(bad)


def test_plan_residency_bytes_fraction_count():
    sizes = [100] * 10
    assert plan_residency(sizes, 0) == frozenset()
    assert plan_residency(sizes, "0%") == frozenset()
    assert plan_residency(sizes, 1.0) == frozenset(range(10))
    assert plan_residency(sizes, "100%") == frozenset(range(10))
    assert plan_residency(sizes, 1000) == frozenset(range(10))
    assert plan_residency(sizes, 999) != frozenset(range(10))
    assert plan_residency(sizes, "0L") == frozenset()
    assert plan_residency(sizes, "50L") == frozenset(range(10))
    # Evenly spread: 2 of 10 are the middles of each half, so streaming runs are equal.
    assert plan_residency(sizes, "2L") == frozenset({2, 7})
    assert plan_residency(sizes, 250) == frozenset({2, 7})
    assert plan_residency(sizes, 0.25) == frozenset({2, 7})
    assert sorted(plan_residency(sizes, "5L")) == [1, 3, 5, 7, 9]


def test_plan_residency_never_exceeds_budget():
    rng = np.random.default_rng(1)
    for _ in range(200):
        sizes = [int(x) for x in rng.integers(1, 1000, rng.integers(1, 40))]
        budget = int(rng.integers(0, sum(sizes) + 1))
        chosen = plan_residency(sizes, budget)
        assert sum(sizes[i] for i in chosen) <= budget
        assert all(0 <= i < len(sizes) for i in chosen)


def test_resident_layers_are_read_once(streaming_model):
    f = GGUFFile(streaming_model)
    with FlashStore(streaming_model, FlashConfig(dram_budget="2L"), file=f) as store:
        assert store.resident == {2, 6} and store.streamed == (0, 1, 3, 4, 5, 7)
        assert store.streamed_bytes == sum(store.layer_bytes[i] for i in store.streamed)
        first = store.resident_layer(2)
        reads = store.stats().reads
        again = store.resident_layer(2)
        assert store.stats().reads == reads  # kept, not re-read
        for name, view in again.items():
            assert np.array_equal(view, f.raw(name)) and np.shares_memory(view, first[name])
        with pytest.raises(LeverError, match="layer 3 is streamed"):
            store.resident_layer(3)


def test_every_layer_resident_leaves_no_window(stories_copy):
    with FlashStore(stories_copy, FlashConfig(dram_budget=1.0)) as store:
        assert store.resident == frozenset(range(store.n_layer)) and store.streamed == ()
        store.load_resident()
        with pytest.raises(LeverError, match="no buffers"):
            store.pool.acquire()


# -- the staging window


def test_pool_exhaustion_blocks_then_fails_clearly(stories_copy):
    with FlashStore(stories_copy, FlashConfig(window_layers=2)) as store:
        pool = store.pool
        a, b = pool.acquire(), pool.acquire()
        assert pool.n_free == 0 and a is not b
        assert a.array.ctypes.data % 4096 == 0 and b.array.ctypes.data % 4096 == 0
        with pytest.raises(LeverError, match="exhausted: all 2 buffers in use"):
            pool.acquire(timeout_s=0)
        threading.Timer(0.05, pool.release, (a,)).start()
        c = pool.acquire(timeout_s=5)  # blocks until the timer releases a
        assert c is a
        with pytest.raises(ValueError, match="released twice"):
            pool.release(b)
            pool.release(b)
        with pytest.raises(ValueError, match="does not belong"):
            BufferPool(1, 4096).release(c)


def test_pool_buffers_fit_the_largest_streamed_layer(streaming_model):
    with FlashStore(streaming_model, FlashConfig(window_layers=3)) as store:
        assert store.pool.n_buffers == 3
        assert store.pool.buffer_bytes == max(store.layer_bytes)


def test_partly_read_buffer_is_never_handed_out(streaming_model):
    with FlashStore(streaming_model) as store:
        buf = store.pool.acquire()
        reads = store.plan_reads(0)
        store.read(reads[0], buf)
        with pytest.raises(LeverError, match="does not hold the whole layer"):
            store.tensors(0, buf)
        for r in reads[1:]:
            store.read(r, buf)
        store.tensors(0, buf)
        store.read(store.plan_reads(1)[0], buf)  # another layer now owns the buffer
        with pytest.raises(LeverError, match="layer 0"):
            store.tensors(0, buf)


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


# -- faults


def test_eio_names_file_layer_and_offset(stories_copy, monkeypatch):
    with FlashStore(stories_copy) as store:
        buf = store.pool.acquire()
        r = store.plan_reads(3)[0]

        def eio(fd, buffers, offset):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(os, "preadv", eio)
        with pytest.raises(LeverError) as e:
            store.read_layer(3, buf)
        msg = str(e.value)
        assert msg.startswith(f"{stories_copy}: layer 3, offset {r.file_offset}: read of ")
        assert "Input/output error" in msg and "\n" not in msg
        with pytest.raises(LeverError, match="does not hold the whole layer"):
            store.tensors(3, buf)


@pytest.mark.parametrize("returns", ["zero", "unaligned"])
def test_short_read_is_an_error(stories_copy, monkeypatch, returns):
    real = os.preadv

    def short(fd, buffers, offset):
        n = real(fd, buffers, offset)
        return 0 if returns == "zero" else min(n, 1000)

    with FlashStore(stories_copy) as store:
        buf = store.pool.acquire()
        r = store.plan_reads(1)[0]
        monkeypatch.setattr(os, "preadv", short)
        with pytest.raises(LeverError, match=rf"layer 1, offset {r.file_offset}: short read: "):
            store.read(r, buf)
        monkeypatch.undo()
        with pytest.raises(LeverError):
            store.tensors(1, buf)
        store.read(r, buf)
        assert store.tensors(1, buf)


@pytest.mark.parametrize("mode", MODES)
def test_file_truncated_while_open(stories_copy, disk_dir, mode):
    path = disk_dir / f"truncated-{mode}.gguf"
    shutil.copyfile(stories_copy, path)
    with FlashStore(path, FlashConfig(mode=mode)) as store:
        buf = store.pool.acquire()
        last = store.plan_reads(store.n_layer - 1)[-1]
        os.truncate(path, last.file_offset + 100)
        where = rf"layer {store.n_layer - 1}, offset {last.file_offset}: "
        with pytest.raises(LeverError, match=where + ".*truncated or replaced while open"):
            store.read(last, buf)


def test_file_rewritten_while_open(stories_copy, disk_dir):
    path = disk_dir / "rewritten.gguf"
    shutil.copyfile(stories_copy, path)
    with FlashStore(path) as store:
        buf = store.pool.acquire()
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as an in-place rewrite would
        with pytest.raises(LeverError, match=r"layer 0, offset \d+: file changed while open"):
            store.read_layer(0, buf)


def test_file_system_without_o_direct_says_use_mmap(stories_copy, monkeypatch):
    real_open = os.open

    def tmpfs_open(path, flags, *args):  # what tmpfs before Linux 6.6 and some FUSE mounts do
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", tmpfs_open)
    with pytest.raises(LeverError, match="does not support O_DIRECT.*'mmap'"):
        FlashStore(stories_copy)
    with FlashStore(stories_copy, FlashConfig(mode="mmap")) as store:
        store.read_layer(0, store.pool.acquire())


def test_close_releases_the_file(stories_copy):
    with FlashStore(stories_copy, FlashConfig(mode="mmap")) as store:
        fd = store._fd
        views = store.read_layer(0, store.pool.acquire())
    with pytest.raises(OSError):
        os.fstat(fd)
    assert views  # views handed out stay valid after close
    with pytest.raises(LeverError, match="closed"):
        store.read(store.plan_reads(0)[0], store.pool._all[0])
    store.close()  # idempotent


# -- config


@pytest.mark.parametrize("key, value", [
    ("mode", "o_direct"), ("queue_depth", 0), ("queue_depth", 2.5), ("chunk_bytes", 1000),
    ("window_layers", 0), ("bandwidth_cap_bytes_per_s", -1), ("read_latency_ms", float("nan")),
    ("dram_budget", "a lot"),
])
def test_config_errors_name_key_and_value(key, value):
    with pytest.raises(LeverError) as e:
        FlashConfig(**{key: value})
    msg = str(e.value)
    assert msg.startswith(f"[flash] {key}: ") and repr(value) in msg


def test_missing_layer_is_an_error(tmp_path):
    path = tmp_path / "gap.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for i in (0, 2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LeverError, match="no tensors for layer 1"):
        FlashStore(path, FlashConfig(mode="mmap"))


# -- convert


def test_convert_round_trip(stories, stories_aligned):
    src, out = gguf.GGUFReader(stories), gguf.GGUFReader(stories_aligned)
    assert out.alignment == 4096 and out.fields["general.alignment"].contents() == 4096
    keys = [k for k in src.fields if k != "general.alignment"]
    assert keys == [k for k in out.fields if k != "general.alignment"]
    for k in keys:
        if not k.startswith("GGUF."):
            assert src.fields[k].types == out.fields[k].types
            assert src.fields[k].contents() == out.fields[k].contents(), k
    assert [t.name for t in src.tensors] == [t.name for t in out.tensors]
    for a, b in zip(src.tensors, out.tensors):
        assert b.data_offset % 4096 == 0
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape)
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8))
    # Whole pages: each layer is one run read with no slack before its first tensor.
    with FlashStore(stories_aligned) as store:
        for e in store.extents:
            assert len(e.runs) == 1 and e.runs[0].file_start == e.runs[0].data_start


def test_convert_keeps_every_kv_type(tmp_path):
    src = write_tiny_model(tmp_path / "tiny.gguf", "qwen2", "Q8_0")  # strings, arrays, ints, floats, bools
    out = tmp_path / "tiny.aligned.gguf"
    convert(src, out, alignment=8192)
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(out)
    assert b.alignment == 8192
    types = {a.fields[k].types[0] for k in a.fields}
    assert {gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL} <= types
    for k in a.fields:
        if not k.startswith("GGUF."):
            assert a.fields[k].contents() == b.fields[k].contents(), k
    assert (out.stat().st_mode & 0o777) == (src.stat().st_mode & 0o777)


def test_convert_in_place_and_errors(stories, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copyfile(stories, path)
    convert(path, path)
    assert gguf.GGUFReader(path).alignment == 4096
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(LeverError, match="power of two"):
        convert(path, tmp_path / "x.gguf", alignment=3000)
    with pytest.raises(LeverError, match="no such file"):
        convert(tmp_path / "absent.gguf", tmp_path / "x.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(LeverError, match="junk.gguf"):
        convert(tmp_path / "junk.gguf", tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
