"""lever.backends.cpu.kv_cache: keeping a tree's accepted path moves exactly the rows a reference gather would."""

from __future__ import annotations

import types

import numpy as np
import pytest

from lever.backends.cpu.kv_cache import KVCache

SPEC = types.SimpleNamespace(n_layer=2, n_head_kv=2, head_dim=4)  # what a cache reads of a ModelSpec


def cache(n_rows: int, seed: int) -> KVCache:
    """A cache of 64 rows with n_rows in use, filled with random values."""
    c = KVCache(SPEC, 64)
    rng = np.random.default_rng(seed)
    for a in c.k + c.v:
        a[:] = rng.standard_normal(a.shape)
    c.reserve(n_rows)
    return c


@pytest.mark.parametrize("seed", range(20))
def test_keep_after_equals_a_gather(seed):
    rng = np.random.default_rng(seed)
    base, n_tree = int(rng.integers(0, 30)), int(rng.integers(1, 20))
    rows = np.sort(rng.choice(n_tree, int(rng.integers(0, n_tree + 1)), replace=False))
    c = cache(base + n_tree, seed)
    want = [a[np.concatenate([np.arange(base), base + rows])].copy() for a in c.k + c.v]
    c.keep_after(base, rows)
    assert c.n_rows == base + rows.size
    for a, w in zip(c.k + c.v, want):
        np.testing.assert_array_equal(a[: c.n_rows], w)


def test_keep_is_keep_after_its_fixed_prefix():
    a, b = cache(30, 1), cache(30, 1)
    rows = np.array([0, 1, 2, 3, 7, 9, 20])
    a.keep(rows)
    b.keep_after(4, rows[4:] - 4)
    for x, y in zip(a.k + a.v, b.k + b.v):
        np.testing.assert_array_equal(x[: a.n_rows], y[: b.n_rows])


def test_rows_out_of_order_or_unused_are_refused():
    c = cache(10, 0)
    with pytest.raises(ValueError):
        c.keep_after(2, np.array([3, 1]))
    with pytest.raises(ValueError):
        c.keep_after(2, np.array([1, 8]))
