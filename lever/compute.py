"""The compute slot: one kernel job at a time, the most urgent first.

The native kernels use every core, so stages that compute (PrunedVerify's layers, Draft's
forwards) take turns on one slot instead of slowing each other down. Turns go by priority, not
arrival: a verification layer whose weights have landed goes before drafting ahead, which
only fills the time the pass spends waiting on flash. PrunedVerify also keeps the slot from one
layer to the next while the next layer's weights are already there: otherwise a queued
draft-ahead forward would take the slot in the moment between two layers, verification would
advance one layer per draft forward, and the reads behind it would stall.
"""

from __future__ import annotations

import heapq
from contextlib import asynccontextmanager

import anyio

VERIFY, DRAFT, AHEAD = 0, 1, 2  # priorities, most urgent first


class ComputeSlot:
    def __init__(self) -> None:
        self._busy = False
        self._waiting: list[tuple[int, int, anyio.Event]] = []  # heap of (priority, arrival, wake-up)
        self._arrivals = 0

    async def acquire(self, priority: int) -> None:
        if not self._busy:
            self._busy = True
            return
        woken = anyio.Event()
        entry = (priority, self._arrivals, woken)
        self._arrivals += 1
        heapq.heappush(self._waiting, entry)
        try:
            await woken.wait()
        except BaseException:  # cancelled: leave the queue, or pass on a slot just handed over
            if woken.is_set():
                self.release()
            else:
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
            raise

    def release(self) -> None:
        if self._waiting:  # handed straight to the most urgent waiter: the slot stays busy
            heapq.heappop(self._waiting)[2].set()
        else:
            self._busy = False

    @asynccontextmanager
    async def hold(self, priority: int):
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()


async def run_on(slot: ComputeSlot | None, priority: int, fn, *args):
    """`fn(*args)` in a worker thread, holding the slot (when there is one)."""
    if slot is None:
        return await anyio.to_thread.run_sync(fn, *args)
    async with slot.hold(priority):
        return await anyio.to_thread.run_sync(fn, *args)
