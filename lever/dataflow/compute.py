"""The compute slot: who computes on the cores, the most urgent first.

The native kernels use every core, so stages that compute (PrunedVerify's layers, Draft's
forwards) take turns on one slot instead of slowing each other down. Turns go by priority, not
arrival: a verification layer whose weights have landed goes before drafting ahead, which
only fills the time the pass spends waiting on flash. PrunedVerify also keeps the slot from one
layer to the next while the next layer's weights are already there: otherwise a queued
draft-ahead forward would take the slot in the moment between two layers, verification would
advance one layer per draft forward, and the reads behind it would stall.

With `ahead_cores` > 0 the cores are split instead, as a phone splits the NPU (verification)
from the CPU (drafting): drafting ahead runs beside a pass on its own cores and the pass's
layers use the others while it does. Small-batch kernels scale poorly across cores (memory
bound), so two jobs side by side finish sooner than the same jobs in turns on every core.
"""

from __future__ import annotations

import heapq
import os
from contextlib import asynccontextmanager

import anyio

VERIFY, DRAFT, AHEAD = 0, 1, 2  # priorities, most urgent first


class ComputeSlot:
    def __init__(self, ahead_cores: int = 0, n_cores: int | None = None) -> None:
        self.n_cores = n_cores or os.cpu_count() or 1
        # splitting needs a core left for each side
        self.ahead_cores = ahead_cores if 0 < ahead_cores < self.n_cores else 0
        self._holders: dict[int, int] = {}  # priority -> jobs holding the slot
        self._waiting: list[tuple[int, int, anyio.Event]] = []  # heap of (priority, arrival, wake-up)
        self._arrivals = 0

    def _fits(self, priority: int) -> bool:
        """Whether a job of this priority may start beside the jobs holding the slot."""
        if not self._holders:
            return True
        return bool(self.ahead_cores) and set(self._holders) | {priority} == {VERIFY, AHEAD} \
            and self._holders.get(priority, 0) == 0

    def threads(self, priority: int) -> int:
        """Kernel threads for a job of this priority now (0: every core)."""
        if not self.ahead_cores:
            return 0
        if priority == AHEAD:
            return self.ahead_cores
        return self.n_cores - self.ahead_cores if self._holders.get(AHEAD) else 0

    async def acquire(self, priority: int) -> None:
        if self._fits(priority) and not any(p <= priority for p, _, _ in self._waiting):
            self._take(priority)
            return
        woken = anyio.Event()
        entry = (priority, self._arrivals, woken)
        self._arrivals += 1
        heapq.heappush(self._waiting, entry)
        try:
            await woken.wait()
        except BaseException:  # cancelled: leave the queue, or pass on a slot just handed over
            if woken.is_set():
                self.release(priority)
            else:
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
            raise

    def _take(self, priority: int) -> None:
        self._holders[priority] = self._holders.get(priority, 0) + 1

    def release(self, priority: int) -> None:
        self._holders[priority] -= 1
        if not self._holders[priority]:
            del self._holders[priority]
        # hand over to the most urgent waiters that fit beside what still runs
        while self._waiting and self._fits(self._waiting[0][0]):
            p, _, woken = heapq.heappop(self._waiting)
            self._take(p)
            woken.set()

    @asynccontextmanager
    async def hold(self, priority: int):
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release(priority)


async def run_on(slot: ComputeSlot | None, priority: int, fn, *args):
    """`fn(*args)` in a worker thread, holding the slot (when there is one)."""
    if slot is None:
        return await anyio.to_thread.run_sync(fn, *args)
    async with slot.hold(priority):
        return await anyio.to_thread.run_sync(fn, *args)
