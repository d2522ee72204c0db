"""FlashStore against real files: every read equals the file's own bytes, resident layers are
read once, and the file is held as it was checked (faults end a run with one line)."""

from __future__ import annotations

import errno
import os
import shutil

import numpy as np
import pytest

from lever.backends.flash import Budget, FlashConfig, FlashStore, parse_budget, plan_residency
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from tests.backends.flash.files import MODES, assert_layers_match

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
    assert parse_budget("2G") == Budget("bytes", 2 << 30)  # a bare unit is binary, as --mem 2G means
    assert parse_budget("512m") == Budget("bytes", 512 << 20)
    assert parse_budget("fill") == Budget("fill", 0)
    for bad in ("lots", "1.5", "-3", "150%", -1, True, "3.5L"):
        with pytest.raises(LeverError, match="dram_budget"):
            parse_budget(bad)


def test_fill_is_placed_by_a_runs_memory_plan_not_by_layer_sizes():
    with pytest.raises(LeverError, match=r'dram_budget: "fill" is placed by a run'):
        plan_residency([100] * 10, "fill")


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


def cached_share(path, start: int, n_bytes: int) -> float:
    """The share of a file range's pages in the page cache (mincore on a private mapping)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    lo, hi = start // page * page, -(-(start + n_bytes) // page) * page
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
        vec = (ctypes.c_ubyte * ((hi - lo) // page))()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m)) + lo
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        assert libc.mincore(ctypes.c_void_p(addr), hi - lo, vec) == 0, os.strerror(ctypes.get_errno())
        share = sum(b & 1 for b in vec) / len(vec)
        del vec
    return share


@pytest.mark.parametrize("mode, kept", [("direct", False), ("mmap", False), ("cached", True)])
def test_only_cached_mode_leaves_a_released_layer_in_the_page_cache(streaming_model, mode, kept):
    fd = os.open(streaming_model, os.O_RDONLY)
    os.fsync(fd)  # just written: a dirty page cannot be evicted
    os.close(fd)
    with FlashStore(streaming_model, FlashConfig(mode=mode)) as store:
        run = store.extents[3].runs[0]
        assert cached_share(streaming_model, run.file_start, run.n_bytes) < 0.5  # evicted at open
        buf = store.pool.acquire()
        store.read_layer(3, buf)
        store.release_layer(3)
        store.pool.release(buf)
        share = cached_share(streaming_model, run.file_start, run.n_bytes)
        assert share > 0.9 if kept else share < 0.5


def test_every_layer_resident_keeps_a_window_any_layer_can_stream_through_later(stories_copy):
    # a live memory budget may stream any layer later (lever.pipelines.residency); the window's
    # pages hold nothing until a layer is read into them
    with FlashStore(stories_copy, FlashConfig(dram_budget=1.0)) as store:
        assert store.resident == frozenset(range(store.n_layer)) and store.streamed == ()
        assert store.pool.n_buffers == store.config.window_layers
        assert store.pool.buffer_bytes == max(store.layer_bytes)
        buf = store.pool.acquire()
        store.read_layer(store.n_layer - 1, buf)
        store.pool.release(buf)

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
        fd = store.reader.fd
        views = store.read_layer(0, store.pool.acquire())
    with pytest.raises(OSError):
        os.fstat(fd)
    assert views  # views handed out stay valid after close
    with pytest.raises(LeverError, match="closed"):
        store.read(store.plan_reads(0)[0], store.pool._all[0])
    store.close()  # idempotent
