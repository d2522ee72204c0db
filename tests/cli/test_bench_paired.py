"""Paired speed ratios and their band (lever.cli.bench.paired)."""

from __future__ import annotations

import pytest

from lever.cli.bench.paired import paired_speedup


def test_paired_speedup_is_the_geometric_mean_with_a_band_from_the_pairs_spread():
    sp, lo, hi = paired_speedup([100.0, 100.0], [50.0, 200.0])  # 2x and 0.5x: no gain, a wide band
    assert sp == pytest.approx(1.0) and lo < 0.5 and hi > 2.0
    sp, lo, hi = paired_speedup([100.0, 90.0, 110.0], [50.0, 45.0, 55.0])  # 2x, every pair alike
    assert sp == pytest.approx(2.0) and lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    sp, lo, hi = paired_speedup([100.0, 102.0, 98.0, 100.0], [101.0, 99.0, 103.0, 97.0])
    assert lo < sp < hi and lo < 1 < hi
    assert paired_speedup([10.0], [5.0]) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError):
        paired_speedup([1.0], [1.0, 2.0])
