"""Ratios of speed from runs paired one to one, with their noise band (`lever bench sources`,
`lever bench pipelines`)."""

from __future__ import annotations

import math
import statistics


def paired_speedup(base_ms: list[float], new_ms: list[float]) -> tuple[float, float, float]:
    """`new`'s speed over `base`'s from runs paired one to one: the geometric mean of the
    ratios and its band of about 95% (two standard errors of the mean log ratio). One pair
    has no spread: its band is the point."""
    if not base_ms or len(base_ms) != len(new_ms):
        raise ValueError("paired_speedup: needs as many runs of each, at least one")
    logs = [math.log(b / n) for b, n in zip(base_ms, new_ms)]
    mean = statistics.fmean(logs)
    half = 2 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)
