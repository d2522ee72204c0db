"""A child process under a memory cap that counts the page cache, as a phone's DRAM does
(`lever bench cap`).

A phone's DRAM holds the process and the file pages it reads; an mmap of a model larger than
that re-reads from storage what the kernel evicted. A memory cgroup's limit counts both, so a
child in a cgroup of its own, capped, sees what it would see there: past the cap the kernel
reclaims (or, when nothing can be reclaimed, kills). Before each run the model files' cached
pages are dropped (`evict`), so an earlier run gives it no free hits. What it read from storage
is the kernel's own count (the children's `ru_inblock`, 512-byte blocks: page-cache misses and
O_DIRECT reads alike), the same for Lever and for llama.cpp.

Needs a writable memory controller (cgroup v2 or v1): root, here.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import threading
import time
from pathlib import Path

import attrs

from lever.errors import LeverError

V2_ROOT, V1_ROOT = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")
BLOCK_BYTES = 512  # ru_inblock's unit


@attrs.frozen
class Capped:
    """What one capped child did."""

    returncode: int  # negative: killed by that signal (the cap's OOM kill is SIGKILL)
    stdout: str
    stderr: str
    peak_bytes: int  # the cgroup's peak: the process and the page cache it filled
    read_bytes: int  # read from storage, by the kernel's count
    wall_s: float
    timed_out: bool = False

    @property
    def killed(self) -> bool:
        return self.returncode == -signal.SIGKILL and not self.timed_out


def evict(path: str | Path) -> None:
    """Drop the file's clean pages from the page cache (that file only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _controller() -> tuple[Path, str, str]:
    """(parent directory, limit file, peak file) of the writable memory controller."""
    ctl = V2_ROOT / "cgroup.controllers"
    if ctl.exists() and "memory" in ctl.read_text().split():
        return V2_ROOT, "memory.max", "memory.peak"
    if V1_ROOT.is_dir():
        return V1_ROOT, "memory.limit_in_bytes", "memory.max_usage_in_bytes"
    raise LeverError("bench cap: no memory cgroup controller is mounted (cgroup v2 or v1 memory)")


@attrs.frozen
class Group:
    """A memory cgroup made for one command: its directory and the file its peak is read from."""

    path: Path
    peak_file: str

    def joined(self, cmd: list[str]) -> list[str]:
        """`cmd` as run inside the group: a shell joins it, then becomes the command, so
        everything the command maps is counted."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *cmd]

    @property
    def peak_bytes(self) -> int:
        return int((self.path / self.peak_file).read_text())


@contextlib.contextmanager
def memory_group(cap_bytes: int):
    """A fresh memory cgroup limited to `cap_bytes` (swap off, which would hide the cap),
    removed once its last process has left."""
    parent, limit_file, peak_file = _controller()
    group = parent / f"lever-cap-{os.getpid()}-{time.monotonic_ns()}"
    try:
        group.mkdir()
        (group / limit_file).write_text(str(cap_bytes))
        swap = group / "memory.swap.max"  # v2; v1's memsw counts swap inside the limit already
        if limit_file == "memory.max" and swap.exists():
            swap.write_text("0")
    except OSError as e:
        raise LeverError(f"bench: cannot make a memory cgroup in {parent}: {e.strerror} (it needs root)") from None
    try:
        yield Group(group, peak_file)
    finally:
        for _ in range(50):  # the group goes once its last process has left it
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def run_capped(cmd: list[str], cap_bytes: int, *, evict_paths=(), timeout_s: float = 3600.0) -> Capped:
    """Run `cmd` in a fresh memory cgroup limited to `cap_bytes`, after evicting `evict_paths`."""
    with memory_group(cap_bytes) as group:
        for p in evict_paths:
            evict(p)
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
        t0 = time.perf_counter()
        proc = subprocess.Popen(group.joined(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True)
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            timed_out = True
        wall = time.perf_counter() - t0
        read = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - before) * BLOCK_BYTES
        return Capped(proc.returncode, out, err, group.peak_bytes, read, wall, timed_out)


@attrs.frozen
class Scheduled:
    """What one child did under a cap that moved (`run_scheduled`)."""

    returncode: int | None  # None: stopped by the bench after its time (`stop_after_s`), alive till then
    stdout: str
    stderr: str
    chunks: tuple[tuple[float, str], ...]  # (monotonic s, text) as its stdout came
    samples: tuple[tuple[float, int, int], ...]  # (monotonic s, bytes the group held, its limit then)
    changes: tuple[tuple[float, int, float | None], ...]  # (monotonic s asked, new cap, s it took; None: never)
    killed_by_cap: bool  # held more than a lowered cap for the grace: killed, as a low-memory killer does
    peak_bytes: int
    started_s: float  # monotonic, as it was spawned
    wall_s: float


def held_bytes(group: Path) -> int:
    for name in ("memory.current", "memory.usage_in_bytes"):
        if (group / name).exists():
            return int((group / name).read_text())
    return -1


def write_limit(path: Path, n: int) -> bool:
    """Whether the kernel took it (v1 refuses a limit below what the group holds: EBUSY)."""
    try:
        path.write_text(str(n))
        return True
    except OSError:
        return False


@attrs.define
class CapMover:
    """A group's cap moved along a schedule as ../shared/tools/memcap --then moves it: each
    (seconds after `t0`, bytes) in turn; a cap the kernel cannot meet yet (v1 refuses a limit
    below what the group holds) is retried, and a process still over it after `grace_s` killed."""

    group: Group
    limit: Path
    cap: int  # the cap now
    pending: list[tuple[float, int]]  # the changes to come
    grace_s: float
    t0: float  # monotonic: the schedule's zero
    changes: list[list] = attrs.field(factory=list)  # [monotonic s asked, new cap, s it took; None: not yet]
    samples: list[tuple[float, int, int]] = attrs.field(factory=list)  # (monotonic s, held, cap)
    killed: bool = False
    _wanted: int | None = None  # a lower cap not met yet
    _since: float = 0.0

    def tick(self, proc: subprocess.Popen) -> None:
        """One look: the next change if its time came, a wanted cap written again (or the
        process killed past the grace), the group's usage sampled."""
        now = time.monotonic()
        if self.pending and now - self.t0 >= self.pending[0][0]:
            _, self.cap = self.pending.pop(0)
            self._wanted, self._since = self.cap, now
            self.changes.append([now, self.cap, None])
        if self._wanted is not None:
            if write_limit(self.limit, self._wanted):
                self.changes[-1][2], self._wanted = time.monotonic() - self._since, None
            elif now - self._since > self.grace_s:
                proc.kill()
                self.killed, self._wanted = True, None
        self.samples.append((now, held_bytes(self.group.path), self.cap))


def run_scheduled(cmd: list[str], cap_bytes: int, *, schedule: list[tuple[float, int]], grace_s: float = 2.0,
                  evict_paths=(), stop_after_s: float | None = None, sample_s: float = 0.1) -> Scheduled:
    """Run `cmd` in a fresh memory cgroup of `cap_bytes` whose cap moves to each (seconds after
    the start, bytes) of `schedule` (CapMover). Its stdout is timed as it comes, the group's
    usage sampled every `sample_s`; `stop_after_s`: stopped then (SIGTERM, then SIGKILL), alive
    or not being what is measured."""
    _, limit_file, _ = _controller()
    with memory_group(cap_bytes) as group:
        for p in evict_paths:
            evict(p)
        t0 = time.monotonic()
        proc = subprocess.Popen(group.joined(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, bufsize=1)
        chunks: list[tuple[float, str]] = []
        err: list[str] = []
        readers = [threading.Thread(target=lambda: [chunks.append((time.monotonic(), c)) for c in
                                                    iter(lambda: proc.stdout.read(1), "")], daemon=True),
                   threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)]
        for r in readers:
            r.start()
        mover, stopped = CapMover(group, group.path / limit_file, cap_bytes, sorted(schedule), grace_s, t0), False
        while proc.poll() is None:
            mover.tick(proc)
            if stop_after_s is not None and time.monotonic() - t0 > stop_after_s and not stopped:
                stop_process(proc)
                stopped = True
            time.sleep(sample_s)
        proc.wait()
        for r in readers:
            r.join(10)
        return Scheduled(returncode=None if stopped and not mover.killed else proc.returncode,
                         stdout="".join(c for _, c in chunks), stderr="".join(err), chunks=tuple(chunks),
                         samples=tuple(mover.samples), changes=tuple(tuple(c) for c in mover.changes),
                         killed_by_cap=mover.killed, peak_bytes=group.peak_bytes, started_s=t0,
                         wall_s=time.monotonic() - t0)


def stop_process(proc: subprocess.Popen, wait_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not gone within `wait_s`."""
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(wait_s)
    if proc.poll() is None:
        proc.kill()
