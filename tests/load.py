"""Time bounds that hold on a loaded machine.

A test that bounds how long something takes (a stop within a second, /health within 500 ms)
states its bound for an idle machine. `within(elapsed_s, bound_s)` holds when the time is
under the bound, or under the bound times how much slower this machine runs now: the wall time
over the CPU time of a short busy loop on the calling thread, about 1 when the thread has a core
to itself and about n when n runnable threads share each core. So a bound is as tight as
written on an idle machine and still holds beside other work (`.ci/under-load`). What is slow
for a reason of its own (a wait for a timeout, a sleep) stays slow: scaling a 1 s bound by a busy
machine's 3 or 5 does not let a 60 s timeout through.
"""

from __future__ import annotations

import statistics
import time


def slowdown(samples: int = 5, sample_s: float = 0.02) -> float:
    """How many times slower than an idle machine this thread runs now (at least 1)."""
    ratios = []
    for _ in range(samples):
        t0, c0 = time.perf_counter(), time.thread_time()
        while time.perf_counter() - t0 < sample_s:
            pass
        ratios.append((time.perf_counter() - t0) / max(time.thread_time() - c0, 1e-9))
    return max(1.0, statistics.median(ratios))


def within(elapsed_s: float, bound_s: float) -> bool:
    """elapsed_s is within bound_s, a bound for an idle machine, on this machine as it is now
    (measured only when the plain bound is missed)."""
    return elapsed_s < bound_s or elapsed_s < bound_s * slowdown()
