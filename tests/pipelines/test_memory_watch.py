"""lever.pipelines.memory_watch: a memory cgroup's limit and pressure move the engine's budget.
Here over cgroup files made in a temporary directory and an eventfd the test signals itself; the
kernel's own cgroups are tests/cli/test_live_memory.py's."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from lever.errors import LeverError
from lever.pipelines import memory_watch
from lever.pipelines.memory_watch import Cgroup, MemoryWatch


def until(cond, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.mark.parametrize("text, version, rel", [
    ("4:memory:/process_api/abc\n0::/\n", 1, "memory/process_api/abc"),
    ("0::/user.slice/app\n", 2, "user.slice/app"),
    ("12:cpu,cpuacct:/x\n3:memory:/\n0::/\n", 1, "memory"),
])
def test_the_process_cgroup_is_found_in_either_hierarchy(tmp_path, text, version, rel):
    (tmp_path / "cgroup").write_text(text)
    d = tmp_path / "fs" / rel
    d.mkdir(parents=True)
    (d / ("memory.limit_in_bytes" if version == 1 else "memory.max")).write_text("1073741824\n")
    cg = Cgroup.of_process(str(tmp_path / "cgroup"), str(tmp_path / "fs"))
    assert cg == Cgroup(d, version) and cg.limit_bytes() == 1 << 30


def test_no_limit_file_is_no_cgroup_and_unlimited_is_none(tmp_path):
    (tmp_path / "cgroup").write_text("0::/a\n")
    assert Cgroup.of_process(str(tmp_path / "cgroup"), str(tmp_path / "fs")) is None
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "memory.max").write_text("max\n")
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    assert Cgroup(tmp_path / "v2", 2).limit_bytes() is None and Cgroup(tmp_path / "v1", 1).limit_bytes() is None


class Seen:
    def __init__(self, fail_below: int = 0):
        self.limits: list[int] = []
        self.squeezes = 0
        self.fail_below = fail_below
        self.lock = threading.Lock()

    def set_memory(self, n: int) -> None:
        with self.lock:
            self.limits.append(n)
        if n < self.fail_below:
            raise LeverError(f"memory: a cap of {n >> 20} MiB is below this run's floor")

    def squeeze(self) -> None:
        self.squeezes += 1


def test_a_new_limit_is_the_budget_never_past_the_runs_own(tmp_path):
    limit = tmp_path / "memory.max"
    limit.write_text(str(3 << 30))
    seen = Seen(fail_below=1 << 30)
    with MemoryWatch(Cgroup(tmp_path, 2), seen.set_memory, seen.squeeze, own_limit_bytes=2 << 30) as w:
        time.sleep(0.2)
        assert seen.limits == []  # the limit it started under is the one its plan was made for
        for cap, budget in [(1536 << 20, 1536 << 20), (4 << 30, 2 << 30), (512 << 20, 512 << 20)]:
            limit.write_text(str(cap))
            assert until(lambda b=budget: seen.limits and seen.limits[-1] == b)
        assert w.error is not None and "below this run's floor" in str(w.error)  # and it goes on watching
        limit.write_text("max")
        assert until(lambda: seen.limits[-1] == 2 << 30 and w.error is None)
    assert [what for _, what, _ in w.events] == ["limit"] * 4


class Pressed(Cgroup):
    """A cgroup whose pressure events are the test's own eventfd."""

    def pressure_fd(self) -> int:
        return self.__dict__.setdefault("_fd", os.eventfd(0, os.EFD_NONBLOCK))


def press(fd: int, seconds: float, done=lambda: False) -> None:
    """Pressure as a refused cap makes it: an event at each of the kernel's retries (memcap's 50 ms),
    for `seconds` or until `done()` (a loaded machine may starve the watch for a while: the
    pressure goes on until it acts, as a kernel's would)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not done():
        os.eventfd_write(fd, 1)
        time.sleep(0.05)


def test_pressure_that_goes_on_squeezes_then_the_limit_read_fills_again(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_watch, "QUIET_S", 0.3)
    limit = tmp_path / "memory.limit_in_bytes"
    limit.write_text(str(3 << 30))
    cg = Pressed(tmp_path, 1)
    seen = Seen()
    with MemoryWatch(cg, seen.set_memory, seen.squeeze) as w:
        fd = cg.pressure_fd()
        for _ in range(5):  # a burst at once: the kernel reclaiming page cache at the run's own limit
            os.eventfd_write(fd, 1)
        time.sleep(0.6)
        assert seen.squeezes == 0
        press(fd, 30.0, lambda: seen.squeezes == 1)  # pressure that goes on: a lower cap refused at every retry
        assert until(lambda: seen.squeezes == 1)
        limit.write_text(str(1536 << 20))  # v1: the lower limit takes once the group is under it
        assert until(lambda: seen.limits == [1536 << 20])
        press(fd, 30.0, lambda: seen.squeezes == 2)  # pressure with no new limit behind it: squeezed, then
        assert until(lambda: seen.squeezes == 2)  # the same budget again
        assert until(lambda: seen.limits == [1536 << 20, 1536 << 20])
    assert seen.squeezes == 2 and [what for _, what, _ in w.events] == ["squeeze", "limit", "squeeze", "limit"]


def test_pressure_that_goes_on_after_the_squeeze_stops_at_the_floor_once(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_watch, "FLOOR_S", 0.3)
    monkeypatch.setattr(memory_watch, "QUIET_S", 60.0)
    (tmp_path / "memory.limit_in_bytes").write_text(str(3 << 30))
    cg, seen, floors = Pressed(tmp_path, 1), Seen(), []
    with MemoryWatch(cg, seen.set_memory, seen.squeeze, lambda: floors.append(1)) as w:
        press(cg.pressure_fd(), 30.0, lambda: floors)  # a cap below the floor: refused at every retry, after
        press(cg.pressure_fd(), 0.5)  # the squeeze too; and pressure on after the floor's stop says it once
        assert until(lambda: floors == [1])
    assert seen.squeezes == 1 and floors == [1] and seen.limits == []
    assert [what for _, what, _ in w.events] == ["squeeze", "floor"]


def test_the_scripts_signals_squeeze_and_fill_again(tmp_path):
    (tmp_path / "memory.max").write_text(str(2 << 30))
    seen = Seen()
    with MemoryWatch(Cgroup(tmp_path, 2), seen.set_memory, seen.squeeze, own_limit_bytes=1 << 30) as w:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert until(lambda: seen.squeezes == 1)
        time.sleep(memory_watch.QUIET_S + 0.5)
        assert seen.limits == []  # a script's squeeze holds until it says otherwise
        os.kill(os.getpid(), signal.SIGUSR2)
        assert until(lambda: seen.limits == [1 << 30])
    assert [what for _, what, _ in w.events] == ["squeeze", "limit"]
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the handlers it replaced are back
