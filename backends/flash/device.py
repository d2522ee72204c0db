"""The storage device as the flash store sees it: an optional phone-flash emulation, and counters.

Every read of the store passes through here twice: `Throttle.deadline` before it (when the
emulated device would finish it) and `Counters.add` after. The counters are what the run
summary and the tests trust to say flash was really read: besides what was asked, they
sample the kernel's own count of bytes fetched from the block device (/proc/self/io).
"""

from __future__ import annotations

import threading
import time

import attrs

N_BUCKETS = 32  # log2 µs buckets: the last one starts at 2^31 µs (36 min)


def process_read_bytes() -> int | None:
    """Bytes this process (all its threads) caused to be fetched from storage, or None where
    the kernel does not say. Page-cache hits do not count; O_DIRECT and faults that go to the
    device do."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class Throttle:
    """Emulated flash: a latency per read, and a bandwidth shared by all reads in flight.

    The bandwidth is a token bucket without burst credit (the GCRA form): the device is busy
    until `_free_at`, and each read of n bytes extends that by n / cap from when it may
    start. Reads in flight overlap their latencies, as commands queued on UFS do, but share
    the link. The caller sleeps out the remainder after its real read, so the emulation is a
    floor: a device slower than the cap shows its own speed.
    """

    def __init__(self, cap_bytes_per_s: float, latency_ms: float):
        self.cap_bytes_per_s = float(cap_bytes_per_s)
        self.latency_s = latency_ms / 1000.0
        self._free_at = 0.0
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.cap_bytes_per_s > 0 or self.latency_s > 0

    def deadline(self, n_bytes: int) -> float:
        """time.monotonic() before which a read of n_bytes issued now may not complete."""
        ready = time.monotonic() + self.latency_s
        if self.cap_bytes_per_s <= 0:
            return ready
        with self._lock:
            self._free_at = max(ready, self._free_at) + n_bytes / self.cap_bytes_per_s
            return self._free_at

    @staticmethod
    def wait_until(deadline: float) -> None:
        left = deadline - time.monotonic()
        if left > 0:
            time.sleep(left)  # releases the GIL, so emulated reads overlap like real ones


@attrs.frozen
class FlashStats:
    """A snapshot of the store's reads since open (or the last `reset_stats`)."""

    reads: int
    requested_bytes: int  # asked of storage: whole chunks, page rounding included
    data_bytes: int  # the layers' own bytes among them: requested minus page-rounding slack
    device_read_bytes: int | None  # fetched from the device by the whole process (/proc/self/io)
    read_s: float  # summed over reads, so > elapsed_s when reads overlap
    elapsed_s: float
    latency_hist_us: tuple[int, ...]  # [i] = reads that took [2^i, 2^(i+1)) µs; [0] also < 1 µs

class Counters:
    """Thread-safe tallies behind FlashStats; reads finish on many worker threads at once."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._reads = 0
            self._requested_bytes = 0
            self._data_bytes = 0
            self._read_s = 0.0
            self._hist = [0] * N_BUCKETS
            self._t0 = time.monotonic()
            self._device0 = process_read_bytes()

    def add(self, requested_bytes: int, data_bytes: int, seconds: float) -> None:
        bucket = min(max(int(seconds * 1e6).bit_length() - 1, 0), N_BUCKETS - 1)
        with self._lock:
            self._reads += 1
            self._requested_bytes += requested_bytes
            self._data_bytes += data_bytes
            self._read_s += seconds
            self._hist[bucket] += 1

    def snapshot(self) -> FlashStats:
        device = process_read_bytes()
        with self._lock:
            return FlashStats(
                reads=self._reads,
                requested_bytes=self._requested_bytes,
                data_bytes=self._data_bytes,
                device_read_bytes=None if device is None or self._device0 is None else device - self._device0,
                read_s=self._read_s,
                elapsed_s=time.monotonic() - self._t0,
                latency_hist_us=tuple(self._hist),
            )
