"""MemoryWatch: the memory the system grants, watched while a run goes, moving the engine's budget.

Above the Engine (lever.pipelines.engine), whose `set_memory` it calls from a thread of its own;
`lever run`, lever.api and `lever serve` start one when [memory] follow holds and the resident
layers fill a limit ([flash] dram_budget = "fill"). A phone's OS reclaims memory as other apps
open and kills the largest process that cannot give it back; a memory cgroup is how Linux (and
Android's lmkd) says so, in two ways this watches:

- its limit (cgroup v2 `memory.max`, v1 `memory.limit_in_bytes`), read every `poll_s`: a new
  one is the budget from then on, the least of it and the run's own [memory] limit;
- pressure: cgroup v1 refuses a limit below what the group holds and reclaims instead, so the
  new limit cannot be read until it is met; what can be seen at once is the reclaim's pressure
  (`memory.pressure_level`, critical, through an eventfd). Once it has gone on a quarter second
  (a brief burst is the kernel reclaiming page cache at the run's own limit), the engine drops
  every resident layer (its floor) at once, which lets the lower limit take, and fills it again as soon as it
  reads it. Pressure that goes on a second after that is a cap below the floor: the engine stops
  its passes with one line rather than wait to be killed. Under v2 a lower limit takes at once
  (the kernel reclaims or kills while writing it), and the next poll reads it.

Scripts have two signals, handled by the same thread (the handlers only note them): SIGUSR1
squeezes, as pressure does, and the run stays there; SIGUSR2 fills again to what the group and the
run's limit grant now.
Without a cgroup a watch serves the signals alone.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from lever.errors import LeverError

if TYPE_CHECKING:
    from lever.pipelines.residency import MemoryChange

POLL_S = 0.05  # a low-memory killer's grace is seconds (memcap's: 2 s); a read of one small file is microseconds
QUIET_S = 2.0  # after a squeeze with no new limit seen: pressure from elsewhere, so fill the old limit again
# Critical pressure also comes, briefly, when the group reaches the run's own limit and the kernel reclaims
# page cache; a lower cap refused comes back at every retry (memcap's: 50 ms). So pressure squeezes once it
# has gone on PERSIST_S (gaps under GAP_S), which leaves most of a low-memory killer's grace (2 s).
PERSIST_S = 0.25
GAP_S = 0.25
# pressure still coming this long after a squeeze freed what it could: the cap is below the floor (a squeeze
# frees in milliseconds)
FLOOR_S = 1.0


@attrs.frozen
class Cgroup:
    """A memory cgroup's files: its limit, and (v1) its pressure level."""

    path: Path
    version: int  # 1 or 2

    @classmethod
    def of_process(cls, proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Cgroup | None:
        """This process's memory cgroup, or None when it has none with a limit file."""
        try:
            lines = Path(proc_cgroup).read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            _, controllers, rel = line.split(":", 2)
            if "memory" in controllers.split(","):  # v1's memory hierarchy wins: its limit is the one enforced
                d = Path(root, "memory", rel.lstrip("/"))
                if (d / "memory.limit_in_bytes").exists():
                    return cls(d, 1)
        for line in lines:
            if line.startswith("0::"):
                d = Path(root, line[3:].lstrip("/"))
                if (d / "memory.max").exists():
                    return cls(d, 2)
        return None

    def limit_bytes(self) -> int | None:
        """The group's limit now; None: unlimited."""
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        text = (self.path / name).read_text().strip()
        if text == "max":
            return None
        n = int(text)
        return None if n >= 1 << 62 else n  # v1 says "unlimited" as a page-rounded LONG_MAX

    def pressure_fd(self) -> int | None:
        """An eventfd signalled at each critical-pressure event (v1), or None where there is none."""
        if self.version != 1:
            return None
        try:
            efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            level = os.open(self.path / "memory.pressure_level", os.O_RDONLY | os.O_CLOEXEC)
            try:
                (self.path / "cgroup.event_control").write_text(f"{efd} {level} critical")
            finally:
                os.close(level)
            return efd
        except (OSError, AttributeError):  # not permitted, or no eventfd here: the limit's poll alone
            return None


@attrs.define(eq=False)
class MemoryWatch:
    """Calls `set_memory(bytes)` with the budget the system grants, and `squeeze()` at pressure,
    from a thread of its own until `stop` (or the end of its `with`)."""

    cgroup: Cgroup | None  # None: signals alone
    set_memory: Callable[[int], MemoryChange | None]  # Engine.set_memory
    squeeze: Callable[[], object]  # drop to the floor at once (Engine.squeeze)
    at_floor: Callable[[], object] = lambda: None  # pressure goes on at the floor: stop (Engine.stop_at_floor)
    own_limit_bytes: int | None = None  # the run's [memory] limit: never more than it
    # a limit -> the run's part of it, a pure function: a server's leaves its own parts (lever.serve.admin.split)
    run_part: Callable[[int], int] | None = None
    # told each limit before the run's part is applied: a server resizes its kept conversations to the rest
    on_limit: Callable[[int], object] | None = None
    poll_s: float = POLL_S
    events: list[tuple[float, str, int]] = attrs.field(factory=list)  # (monotonic s, what, bytes or layers): figures
    error: LeverError | None = None  # a budget below the floor, last seen
    _stop: threading.Event = attrs.field(factory=threading.Event)
    _thread: threading.Thread | None = None
    _fd: int | None = None
    _signalled: list[int] = attrs.field(factory=list)  # signals noted by the handlers, taken by the thread
    _handlers: dict = attrs.field(factory=dict)  # the handlers ours replaced, restored at stop

    def budget_bytes(self, limit: int | None) -> int | None:
        """The run's budget under a cgroup `limit` (None: no limit seen), never past its own."""
        if limit is not None and self.run_part is not None:
            limit = self.run_part(limit)
        if limit is None:
            return self.own_limit_bytes
        return limit if self.own_limit_bytes is None else min(limit, self.own_limit_bytes)

    def start(self) -> MemoryWatch:
        self._fd = self.cgroup.pressure_fd() if self.cgroup is not None else None
        if threading.current_thread() is threading.main_thread():  # only there may handlers be set
            for sig in (signal.SIGUSR1, signal.SIGUSR2):
                self._handlers[sig] = signal.signal(sig, lambda n, frame: self._signalled.append(n))
        seen = self.follow_below_plan()
        self._thread = threading.Thread(target=self._run, args=(seen,), name="lever-memory-watch", daemon=True)
        self._thread.start()
        return self

    def follow_below_plan(self) -> int | None:
        """The cgroup's limit now, applied in the caller's thread if it grants less than the run's
        plan, before what the caller does next (loads the layers; serves): the watch's own thread
        came too late on a loaded machine, and the load was killed. Returns the limit seen."""
        limit = self._limit()
        budget = self.budget_bytes(limit)
        if limit is not None and budget is not None and self.own_limit_bytes is not None \
                and budget < self.own_limit_bytes:
            self._apply(limit)
        return limit

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if threading.current_thread() is threading.main_thread():
            for sig, old in self._handlers.items():
                signal.signal(sig, old)
            self._handlers.clear()

    def __enter__(self) -> MemoryWatch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self, seen: int | None) -> None:
        burst = squeezed = None  # when the pressure under way began; when the squeeze came
        last, by_signal, floor_said = 0.0, False, False
        while not self._stop.is_set():
            signalled = self._signalled[:]
            del self._signalled[: len(signalled)]
            pressed, now = self._pressed(), time.monotonic()
            if pressed:
                burst, last = now if burst is None or now - last > GAP_S else burst, now
            elif burst is not None and now - last > GAP_S:
                burst = None  # it passed: the kernel found what it wanted (page cache, at the run's own limit)
            if squeezed is None and (signal.SIGUSR1 in signalled or (burst is not None and last - burst >= PERSIST_S)):
                self.squeeze()
                self.events.append((now, "squeeze", 0))
                squeezed, by_signal, floor_said = now, burst is None or signal.SIGUSR1 in signalled, False
            elif squeezed is not None and burst is not None and last - squeezed >= FLOOR_S and not floor_said:
                self.at_floor()  # nothing left to give and the kernel still asks: a cap below the floor
                self.events.append((now, "floor", 0))
                floor_said = True
            limit = self._limit()
            quiet = squeezed is not None and not by_signal and burst is None and now - max(last, squeezed) > QUIET_S
            if limit != seen or quiet or signal.SIGUSR2 in signalled:
                seen, squeezed = limit, None
                self._apply(limit)

    def _pressed(self) -> bool:
        """Waits up to poll_s for a critical-pressure event; whether one came."""
        if self._fd is None:
            return self._stop.wait(self.poll_s) and False
        ready, _, _ = select.select([self._fd], [], [], self.poll_s)
        if not ready:
            return False
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:
            return False
        return True

    def _limit(self) -> int | None:
        if self.cgroup is None:
            return None
        try:
            return self.cgroup.limit_bytes()
        except (OSError, ValueError):
            return None

    def _apply(self, limit: int | None) -> None:
        budget = self.budget_bytes(limit)
        if budget is None:
            return
        self.events.append((time.monotonic(), "limit", budget))
        if limit is not None and self.on_limit is not None:
            self.on_limit(limit)
        try:
            change = self.set_memory(budget)
            self.error = None
            if change is not None:
                self.events.append((time.monotonic(), "resident_layers", change.layers_after))
        except LeverError as e:  # below the floor: the engine stops its passes with this line
            self.error = e
