"""The target's resident layers, which a live memory budget changes while a run goes (issue 50).

Below FlashTarget (lever.pipelines.target), which opens it with the plan's layers, and above
the flash store. Prefetch fixes each pass's streamed layers from it when it begins the pass
(`streamed`, sent as a PassLayers); PrunedVerify and the shared passes take every other layer
from it (`get`). A layer dropped is freed at once, not when a pass ends: a pass that planned to
find it resident reads it itself (`read_late`), so a shrink never waits for the passes already
planned, which on a phone-sized target take seconds while a low-memory killer waits for no one.
A layer added is read and packed beside the passes, one at a time (`grow`), and a pass planned
after it lands finds it. Safe from any thread.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from collections.abc import Iterable

import attrs

from lever.backends.cpu.layer import LayerWeights, layer_nbytes, load_layer
from lever.backends.flash import FlashStore
from lever.backends.flash.pool import StagingBuffer
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.spec import ModelSpec
from lever.policy.memory import MemoryPlan


@attrs.frozen
class MemoryChange:
    """What a new memory budget did (Engine.set_memory)."""

    limit_bytes: int
    layers_before: int  # resident layers held before it
    layers_after: int  # planned now: those dropped are gone, those added are being read back
    dropped_bytes: int  # freed at once
    plan: MemoryPlan  # the run's plan within the limit
    seconds: float  # to re-plan and drop
    floor_bytes: int  # the least a budget may be: every layer streamed (RunPlan.live_bounds)
    whole_bytes: int  # the least that keeps every layer resident


@attrs.define(eq=False)
class Residency:
    """Layer -> packed weights kept in DRAM; the rest streams. Reads as a mapping."""

    store: FlashStore
    file: GGUFFile
    spec: ModelSpec
    _layers: dict[int, LayerWeights] = attrs.field(factory=dict)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _epoch: int = 0  # bumped by every resize: a grow under way stops when a later one comes
    _grower: threading.Thread | None = None
    late_reads: int = 0  # layers a pass read itself, dropped after the pass was planned
    late_bytes: int = 0
    grown: int = 0  # layers read back and packed by grow
    dropped: int = 0
    grow_error: Exception | None = None  # the last read back that failed
    stopped: LeverError | None = None  # a cap below the run's floor: every pass stops with it, at its next layer

    def __attrs_post_init__(self) -> None:
        self._sync()

    # -- the mapping the passes read

    def get(self, layer: int) -> LayerWeights | None:
        with self._lock:
            return self._layers.get(layer)

    def __contains__(self, layer: object) -> bool:
        with self._lock:
            return layer in self._layers

    def __getitem__(self, layer: int) -> LayerWeights:
        with self._lock:
            return self._layers[layer]

    def __len__(self) -> int:
        with self._lock:
            return len(self._layers)

    def keys(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._layers)

    def values(self) -> list[LayerWeights]:
        with self._lock:
            return list(self._layers.values())

    @property
    def nbytes(self) -> int:
        """What the resident layers hold now (packed matrices, norms, biases)."""
        return sum(layer_nbytes(lw) for lw in self.values())

    def streamed(self) -> tuple[int, ...]:
        """The layers a pass planned now streams, in execution order."""
        with self._lock:
            return tuple(i for i in range(self.store.n_layer) if i not in self._layers)

    # -- changes

    def put(self, layer: int, weights: LayerWeights) -> None:
        with self._lock:
            self._layers[layer] = weights
            self._sync_locked()

    def resize(self, wanted: Iterable[int]) -> int:
        """Keep exactly `wanted`: the others are dropped now (their bytes freed as the passes
        computing them let go) and the missing ones grown in the background. Returns the bytes
        dropped. A later resize supersedes a grow still under way."""
        wanted = frozenset(wanted)
        with self._lock:
            self._epoch += 1
            epoch = self._epoch
            gone = [self._layers.pop(i) for i in sorted(set(self._layers) - wanted)]
            missing = sorted(wanted - set(self._layers))
            self._sync_locked()
        freed = sum(layer_nbytes(lw) for lw in gone)
        self.dropped += len(gone)
        del gone
        give_back()
        if missing:
            self._grower = threading.Thread(target=self._grow, args=(missing, epoch), name="lever-grow", daemon=True)
            self._grower.start()
        return freed

    def wait_grown(self, timeout_s: float | None = None) -> bool:
        """Waits for the grow under way and any that superseded it (Engine.open's load, tests);
        whether none is left."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while (t := self._grower) is not None and t.is_alive():
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            t.join(left)
        return True

    def _grow(self, layers: list[int], epoch: int) -> None:
        for i in layers:
            if self._epoch != epoch or self.store.reader.closed:
                return
            try:
                weights = self.load(i)
            except Exception as e:  # noqa: BLE001 - a failed read back leaves the layer streamed, as planned before
                self.grow_error = e  # (a load's: Engine.open raises it)
                return
            with self._lock:
                if self._epoch != epoch:
                    return
                self._layers[i] = weights
                self._sync_locked()
            self.grown += 1

    # -- reads

    def load(self, layer: int) -> LayerWeights:
        """One layer read from flash and packed into the tile layout, as kept resident."""
        buf = StagingBuffer(-1 - layer, self.store.extents[layer].buffer_bytes)
        try:
            return load_layer(self.file, self.spec, layer, raws=self.store.read_layer(layer, buf), tiles=True)
        finally:
            buf.close()  # the packed copy is what stays

    def read_late(self, layer: int) -> tuple[LayerWeights, int, float]:
        """A layer a pass planned to find resident, dropped since: read now into a buffer of its
        own (row layout, as a streamed layer), which goes when the weights do. (weights, bytes
        read, seconds)."""
        t0 = time.perf_counter()
        buf = StagingBuffer(-1 - layer, self.store.extents[layer].buffer_bytes)
        weights = load_layer(self.file, self.spec, layer, raws=self.store.read_layer(layer, buf))
        n = sum(r.n_bytes for r in self.store.plan_reads(layer))
        self.late_reads += 1
        self.late_bytes += n
        return weights, n, time.perf_counter() - t0

    def _sync(self) -> None:
        with self._lock:
            self._sync_locked()

    def _sync_locked(self) -> None:
        # the store's own view, for what reads it (figures, the pass's bytes); the passes read here
        self.store.resident = frozenset(self._layers)
        self.store.streamed = tuple(i for i in range(self.store.n_layer) if i not in self._layers)


def give_back() -> None:
    """Returns freed memory to the system: glibc keeps freed arenas mapped, so what a drop freed
    would still count against the cap (and a later plan made from RSS would count it twice)."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc():
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_LIBC = _libc()
