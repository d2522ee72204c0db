"""The compute slot: one job at a time, the most urgent waiter next, cancellation-safe."""

from __future__ import annotations

import anyio

from lever.compute import AHEAD, DRAFT, VERIFY, ComputeSlot


async def test_waiters_go_by_priority_then_arrival():
    slot, order = ComputeSlot(), []

    async def job(name, priority):
        async with slot.hold(priority):
            order.append(name)
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        await slot.acquire(VERIFY)  # busy: everyone below queues
        for name, prio in (("ahead", AHEAD), ("draft1", DRAFT), ("verify", VERIFY), ("draft2", DRAFT)):
            tg.start_soon(job, name, prio)
            await anyio.sleep(0.005)
        slot.release()
    assert order == ["verify", "draft1", "draft2", "ahead"]


async def test_a_cancelled_waiter_leaves_the_queue():
    slot = ComputeSlot()
    await slot.acquire(VERIFY)
    with anyio.move_on_after(0.02):
        await slot.acquire(AHEAD)
    slot.release()  # nobody is waiting any more: the slot is free
    with anyio.fail_after(1):
        await slot.acquire(DRAFT)
    slot.release()
