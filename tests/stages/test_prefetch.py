"""Prefetch reads a layer into a window buffer: the weights equal those mapped from the file."""

from __future__ import annotations

import anyio
import numpy as np

from lever.backends.cpu.layer import MATRICES, load_layer
from lever.backends.flash import FlashConfig, FlashStore
from lever.gguf.file import GGUFFile
from lever.gguf.spec import read_spec
from lever.stages.prefetch import Prefetch


def test_streamed_layers_equal_the_mapped_ones(stories):
    f = GGUFFile(stories)
    spec = read_spec(f)
    with FlashStore(stories, FlashConfig(mode="direct"), file=f) as store:
        stage = Prefetch("prefetch", store, f, spec, anyio.CapacityLimiter(2))
        buf = store.pool.acquire()
        for layer in store.streamed:
            got, want = stage.read_layer(layer, buf), load_layer(f, spec, layer)
            for name in MATRICES:
                assert np.array_equal(getattr(got, name).data, getattr(want, name).data)
            assert np.array_equal(got.attn_norm, want.attn_norm)
        store.pool.release(buf)
