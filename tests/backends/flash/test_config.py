"""[flash]: every bad value is one line naming the key; a layer missing from the file is an error."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lever.backends.flash import FlashConfig, FlashStore
from lever.backends.flash.config import respread, spread
from lever.errors import LeverError
from tests.sizes import cases

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


@given(n=st.integers(1, 200), data=st.data())
@settings(max_examples=cases(300), deadline=None)
def test_respread_changes_as_few_layers_as_a_new_count_needs(n, data):
    held = frozenset(data.draw(st.sets(st.integers(0, n - 1))))
    k = data.draw(st.integers(0, n))
    got = respread(n, held, k)
    assert len(got) == k and got <= frozenset(range(n))
    assert got <= held if k <= len(held) else held <= got  # a shrink reads nothing, a grow drops nothing
    if k == len(held):
        assert got == held
    if not held:  # from nothing, as a run started there: spread evenly
        assert got == frozenset(spread(n, k)) if k else got == frozenset()
