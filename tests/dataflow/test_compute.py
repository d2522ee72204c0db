"""The compute slot: one job at a time, the most urgent waiter next, cancellation-safe."""

from __future__ import annotations

import anyio

from lever.dataflow.compute import AHEAD, DRAFT, VERIFY, ComputeSlot


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
        slot.release(VERIFY)
    assert order == ["verify", "draft1", "draft2", "ahead"]


async def test_a_cancelled_waiter_leaves_the_queue():
    slot = ComputeSlot()
    await slot.acquire(VERIFY)
    with anyio.move_on_after(0.02):
        await slot.acquire(AHEAD)
    slot.release(VERIFY)  # nobody is waiting any more: the slot is free
    with anyio.fail_after(1):
        await slot.acquire(DRAFT)
    slot.release(DRAFT)


async def test_split_cores_run_drafting_ahead_beside_a_pass():
    slot = ComputeSlot(ahead_cores=1, n_cores=4)
    await slot.acquire(VERIFY)
    assert slot.threads(VERIFY) == 0  # alone: every core
    with anyio.fail_after(1):
        await slot.acquire(AHEAD)  # beside the pass, not after it
    assert (slot.threads(VERIFY), slot.threads(AHEAD)) == (3, 1)
    with anyio.move_on_after(0.02) as scope:
        await slot.acquire(DRAFT)  # drafting for the tree itself still waits for both
    assert scope.cancelled_caught
    slot.release(AHEAD)
    assert slot.threads(VERIFY) == 0
    slot.release(VERIFY)
    with anyio.fail_after(1):
        await slot.acquire(DRAFT)
    slot.release(DRAFT)


async def test_split_cores_hand_over_to_every_waiter_that_fits():
    slot, started = ComputeSlot(ahead_cores=1, n_cores=2), []

    async def job(name, priority):
        async with slot.hold(priority):
            started.append(name)
            await anyio.sleep(0.05)

    async with anyio.create_task_group() as tg:
        await slot.acquire(DRAFT)
        tg.start_soon(job, "verify", VERIFY)
        tg.start_soon(job, "ahead", AHEAD)
        await anyio.sleep(0.01)
        assert started == []
        slot.release(DRAFT)
        await anyio.sleep(0.01)
        assert sorted(started) == ["ahead", "verify"]  # both at once


def test_one_core_cannot_be_split():
    assert ComputeSlot(ahead_cores=1, n_cores=1).ahead_cores == 0
