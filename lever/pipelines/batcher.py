"""The batcher: several requests' trees verified in one pass of the target's layers (issue 49).

Between each request's TreeExpand and its PrunedVerify. Every request keeps its own stages, caches,
stop rule, sampler and grammar; what they share is the pass. A request's verifier hands its tree
to `Batcher.verify` from its own thread and gets its Verified back; the first tree to arrive
leads: it waits for the other requests that have joined (at most `wait_s`), then runs one pass
over the layers for every tree gathered (PrunedVerify.verify_batch), which reads each streamed
layer once for all of them (`StreamedLayers`). Trees that arrive while a pass runs go into the
next. Each request's result is what it gets alone, bit for bit (the kernels are batch-invariant,
each request attends only to its own cache): tests/pipelines/test_batcher.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import attrs

from lever.backends.cpu.layer import LayerWeights, load_layer
from lever.backends.flash import FlashStore
from lever.backends.flash.pool import StagingBuffer
from lever.dataflow.messages import TokenTree, Verified
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.spec import ModelSpec
from lever.policy.cost import Others
from lever.stages.pruned_verify import PrunedVerify

WAIT_S = 0.005  # how long a pass's first tree waits for the other joined requests' trees


@attrs.define(eq=False)
class StreamedLayers:
    """One pass's layers, indexable in order: resident ones as kept, streamed ones read from
    flash into the store's staging window (two of its buffers, taken for the pass: the window
    the memory plan counts, which no Prefetch uses while passes are shared), the next layer's
    read under way while this one computes (with a window of one, after it). Made for one pass
    and used once; `close` gives the buffers back."""

    store: FlashStore
    file: GGUFFile
    spec: ModelSpec
    resident: Mapping[int, LayerWeights]  # read layer by layer as the pass goes: a live budget may change it
    read_bytes: int = 0
    read_s: float = 0.0  # the reads' wall time, one after another (PassTiming.read_s)
    buffers: list[StagingBuffer] = attrs.field(factory=list)
    _pool: ThreadPoolExecutor = attrs.field(factory=lambda: ThreadPoolExecutor(1, "lever-batch-layer"))
    _reads: ThreadPoolExecutor | None = None  # a layer's chunks in flight, up to the flash queue depth (as Prefetch)
    _ahead: dict[int, Future] = attrs.field(factory=dict)

    def _read(self, layer: int) -> LayerWeights:
        buf = self.buffers[layer % len(self.buffers)]
        if self._reads is None:
            self._reads = ThreadPoolExecutor(max(self.store.config.queue_depth, 1), "lever-batch-read")
        t0 = time.perf_counter()
        for f in [self._reads.submit(self.store.read, r, buf) for r in self.store.plan_reads(layer)]:
            f.result()
        self.read_s += time.perf_counter() - t0
        return load_layer(self.file, self.spec, layer, raws=self.store.tensors(layer, buf))

    def _start(self, layer: int) -> None:
        if layer < self.spec.n_layer and layer not in self._ahead and self.resident.get(layer) is None:
            if not self.buffers:  # the first streamed layer of the pass: take the window
                pool = self.store.pool
                self.buffers = [pool.acquire() for _ in range(min(pool.n_buffers, 2))]
            self._ahead[layer] = self._pool.submit(self._read, layer)

    def __getitem__(self, layer: int) -> LayerWeights:
        if (stop := getattr(self.resident, "stopped", None)) is not None:
            raise LeverError(str(stop))  # a memory cap below the run's floor (a fresh error: see PrunedVerify)
        if layer not in self._ahead:  # a read begun stays the layer's, whatever the residency did since
            weights = self.resident.get(layer)
            if weights is not None:
                self._start(layer + 1)
                return weights
            self._start(layer)
        weights = self._ahead.pop(layer).result()
        self.read_bytes += self.store.layer_bytes[layer]
        if len(self.buffers) > 1:
            self._start(layer + 1)  # into the other buffer: this layer's stays until it is computed
        return weights

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._reads is not None:
            self._reads.shutdown(wait=True)
        for buf in self.buffers:
            self.store.pool.release(buf)
        self.buffers = []


@attrs.define(eq=False)
class _Ticket:
    verifier: PrunedVerify
    tree: TokenTree
    result: Verified | None = None
    error: BaseException | None = None


@attrs.define(eq=False)
class Batcher:
    """Gathers the trees of the requests that joined and verifies them in shared passes.
    `layers()`: the layers of one pass (a dict, or a fresh StreamedLayers)."""

    layers: object  # () -> a pass's layers, indexable by layer
    wait_s: float = WAIT_S
    passes: int = 0  # passes run
    trees: int = 0  # trees verified (trees / passes: how many shared a pass, on average)
    read_bytes: int = 0  # streamed from flash by the passes, once per pass for all their trees
    nodes: int = 0  # nodes the passes verified, every tree's
    seconds: float = 0.0  # the passes' wall time
    price: Callable[[int], float] | None = None  # the cost model's pass of n nodes (CostModel.verify_s), if any
    predicted_s: float = 0.0  # what it priced the passes at: against `seconds`, how well shared passes are priced
    _members: int = 0
    # each running request's last speculative tree, by its verifier's id: (its pass, nodes, expected tokens)
    _latest: dict[int, tuple[int, int, float]] = attrs.field(factory=dict)
    # each running request's share of its passes' reads, pass by pass (a pass's bytes over its trees)
    _shares: dict[int, list[int]] = attrs.field(factory=dict)
    _queue: list[_Ticket] = attrs.field(factory=list)
    _leading: bool = False
    _cond: threading.Condition = attrs.field(factory=threading.Condition)

    def join(self) -> None:
        """A request starts: passes wait for its trees too."""
        with self._cond:
            self._members += 1

    def leave(self) -> None:
        """A request ends (done, stopped, cancelled): no pass waits for it any more."""
        with self._cond:
            self._members -= 1
            self._cond.notify_all()

    def others(self, verifier: PrunedVerify) -> Others:
        """What the next pass holds beside `verifier`'s tree, as its tree's growth prices it: the
        other requests' last trees, of those in one of the last two passes (one that drafted
        through a pass is still running; one that left is soon forgotten). A prefill is not
        counted: the tree after it is a speculative one, of the size its own policy picks."""
        with self._cond:
            seen = [v for k, v in self._latest.items() if k != id(verifier) and v[0] >= self.passes - 2]
        return Others(sum(n for _, n, _ in seen), sum(t for _, _, t in seen))

    def take_shares(self, verifier: PrunedVerify) -> list[int]:
        """`verifier`'s request's share of each of its passes' reads, forgotten here: its run's
        own flash figure, where the process's counter is every request's."""
        with self._cond:
            return self._shares.pop(id(verifier), [])

    def verify(self, verifier: PrunedVerify, tree: TokenTree) -> Verified:
        """The tree verified, in a pass shared with the trees of the other joined requests that
        are ready; from the request's own thread, which may run the pass for all of them."""
        ticket = _Ticket(verifier, tree)
        with self._cond:
            self._queue.append(ticket)
            self._cond.notify_all()
            while ticket.result is None and ticket.error is None and (self._leading or ticket not in self._queue):
                self._cond.wait()
            if ticket.result is None and ticket.error is None:
                batch = self._gather()
        if ticket.result is None and ticket.error is None:
            self._run(batch)
        if ticket.error is not None:
            raise ticket.error
        return ticket.result

    def _gather(self) -> list[_Ticket]:
        """As the leader (under the lock): the other members' trees, for at most wait_s."""
        self._leading = True
        deadline = time.monotonic() + self.wait_s
        while len(self._queue) < self._members and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)
        batch, self._queue = self._queue, []
        return batch

    def _run(self, batch: list[_Ticket]) -> None:
        layers, t0 = self.layers(), time.perf_counter()
        try:
            results = PrunedVerify.verify_batch([t.verifier for t in batch], [t.tree for t in batch], layers)
        except BaseException as e:  # every tree of the pass hears it, not only the leader's
            results = None
            for t in batch:
                t.error = e
        finally:
            if hasattr(layers, "close"):
                layers.close()
        with self._cond:
            if results is not None:
                for t, r in zip(batch, results):
                    t.result = r
                    if t.tree.pass_id > 0 and t.tree.n_given == 1:  # a speculative tree, not a prefill
                        tokens = float(t.tree.gains.sum()) if t.tree.gains is not None else 1.0
                        self._latest[id(t.verifier)] = (self.passes, t.tree.n_nodes, tokens)
                self.passes += 1
                self._latest = {k: v for k, v in self._latest.items() if v[0] >= self.passes - 2}
                self.trees += len(batch)
                read = getattr(layers, "read_bytes", 0)
                self.read_bytes += read
                for t in batch:
                    self._shares.setdefault(id(t.verifier), []).append(read // len(batch))
                n = sum(t.tree.n_nodes for t in batch)
                self.nodes += n
                self.seconds += time.perf_counter() - t0
                self.predicted_s += self.price(n) if self.price is not None else 0.0
            self._leading = False
            self._cond.notify_all()
