"""The staging window: buffers sized for the largest streamed layer, exhaustion that fails clearly."""

from __future__ import annotations

import threading

import pytest

from lever.backends.flash import BufferPool, FlashConfig, FlashStore
from lever.errors import LeverError

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
        c = pool.acquire(timeout_s=60)  # blocks until the timer releases a (returns then, loaded or not)
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
