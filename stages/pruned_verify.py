"""PrunedVerify: the target model's pass over a token tree, layer by layer.

Resident layers come from DRAM; every other layer arrives from Prefetch's channel as a
`StreamedLayer` (after the pass's `PassLayers`, which says which) and its window buffer goes
back as soon as the layer is computed, so reading the next layers overlaps this one's compute.
Each node attends to the committed prefix and to its own ancestors (positions by depth), so a
whole tree costs one streamed pass. The KV cache
belongs to this stage: it changes only by the `keep` each tree carries from Accept.
With a predictor (`lever/policy/predictor.py`), after its layer m the nodes it prunes leave the pass:
layers m+1.. run on the survivors only, and the pruned rows of those layers are zeroed, never
committed, and masked from every survivor (a pruned node's subtree goes with it, so no survivor
has a pruned ancestor).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import anyio
import attrs
import numpy as np

from lever.backends.cpu import native
from lever.backends.cpu.batch import Segment, layer_batch_in_chunks
from lever.backends.cpu.kv_cache import KVCache
from lever.backends.cpu.layer import LayerWeights, layer_forward, layer_in_chunks
from lever.dataflow.compute import VERIFY, ComputeSlot
from lever.dataflow.graph import Stage
from lever.dataflow.messages import FreeBuffer, LayerMessage, PassLayers, PassTiming, TokenTree, Verified
from lever.dataflow.trace import Tracer
from lever.errors import LeverError
from lever.gguf.spec import ModelSpec
from lever.policy.predictor import Predictor


@attrs.define
class PassState:
    """One tree's pass in progress."""

    tree: TokenTree
    x: np.ndarray  # (n_nodes, n_embd) hidden states entering the next layer
    pos: np.ndarray  # (n_nodes,) int32
    mask: np.ndarray  # (n_nodes, n_past + n_nodes) bool
    rows: slice | np.ndarray  # the cache rows of this pass's live nodes
    alive: np.ndarray | None = None  # (n_nodes,) bool once pruned; None: every node goes on
    dead_rows: np.ndarray | None = None  # cache rows of the pruned nodes
    hidden: np.ndarray | None = None  # (n_nodes, n_embd) pruned nodes keep their state at the pruning layer


@attrs.frozen
class VerifyStats:
    """Verification's figures over a run."""

    token_layers: int  # nodes x layers the target computed
    layer_tokens: tuple[int, ...]  # nodes computed at each layer, decoding passes only
    kv_cache_bytes: int
    prune_layer: int  # the predictor's layer (-1: no pruning)
    pruned_share: float  # tree nodes past the root the predictor pruned


@attrs.define
class PrunedVerify(Stage):
    """TokenTree + streamed layers -> Verified."""

    name: str
    spec: ModelSpec
    embed: Callable[[np.ndarray], np.ndarray]  # token ids -> (n, n_embd)
    cache: KVCache
    # layers kept in DRAM now (a mapping with `get`); the others stream. A live memory budget
    # (lever.pipelines.residency.Residency) may drop one after Prefetch planned a pass to find it
    # resident: then the pass reads it itself (`read_late`)
    resident: Mapping[int, LayerWeights]
    slot: ComputeSlot | None = None  # the compute slot, shared with other compute stages
    predictor: Predictor | None = None  # prunes branches after its layer; None: every node runs every layer
    tracer: Tracer = attrs.field(factory=lambda: Tracer(enabled=False))
    # called after every layer as observer(layer, tree, x) while no node is pruned (`lever calibrate`
    # records through it)
    observer: Callable[[int, TokenTree, np.ndarray], None] | None = None
    emulate_layer_s_per_token: float = 0.0  # [runtime] emulate_layer_ms_per_token, in seconds
    layer_fn: Callable = layer_forward  # the backend of the target's layers ([placement] verify): CPU kernels or QNN
    # several requests' passes in one (lever.pipelines.batcher.Batcher.verify): this verifier's
    # tree goes there, from a thread, instead of through its own layers; None: a pass of its own
    shared_pass: Callable | None = None
    INPUTS = {"tree": TokenTree, "layers": LayerMessage}
    OUTPUTS = {"verified": Verified, "free": FreeBuffer}
    OPTIONAL = frozenset({"layers", "free"})  # all-resident (memory AR) needs no streaming

    token_layers: int = 0  # sum over passes of nodes x layers computed (verification compute)
    layer_tokens: np.ndarray = attrs.field(init=False)  # (n_layer,) nodes computed at each layer in decoding passes
    _last_n_nodes: int = 0  # nodes of the previous pass, whose rows the next keep selects from
    inv_freq: np.ndarray = attrs.field(init=False)
    _mask_buf: np.ndarray | None = attrs.field(init=False, default=None)  # (max n_tok seen, n_ctx) bool

    def __attrs_post_init__(self):
        self.inv_freq = self.spec.inv_freq()
        self.layer_tokens = np.zeros(self.spec.n_layer, np.int64)

    @property
    def n_committed(self) -> int:
        """Cache rows of the text before the last pass (its tree's rows are not decided yet)."""
        return self.cache.n_rows - self._last_n_nodes

    def stats(self) -> VerifyStats:
        p = self.predictor
        return VerifyStats(self.token_layers, tuple(int(n) for n in self.layer_tokens), self.cache.nbytes,
                           p.layer if p is not None else -1, p.n_pruned / max(p.n_scored, 1) if p is not None else 0.0)

    def begin(self, tree: TokenTree) -> PassState:
        """Commits the previous pass's kept rows, then lays out this tree's rows and mask."""
        if tree.keep is not None:
            base = self.cache.n_rows - self._last_n_nodes
            self.cache.keep_after(base, np.asarray(tree.keep, np.int64))
        n_past = self.cache.n_rows
        rows = self.cache.reserve(tree.n_nodes)
        mask = self._mask(tree.n_nodes, n_past + tree.n_nodes)
        mask[:, :n_past] = True
        mask[:, n_past:] = tree.ancestor_mask()
        self._last_n_nodes = tree.n_nodes
        pos = (n_past + tree.depths()).astype(np.int32)
        return PassState(tree, self.embed(tree.tokens), pos, mask, rows)

    def _mask(self, n_tok: int, n_rows: int) -> np.ndarray:
        """A (n_tok, n_rows) mask in one buffer kept across passes, rather than a new array
        the size of the context on every pass (the widest pass, the prompt's, sizes it)."""
        if self._mask_buf is None or self._mask_buf.shape[0] < n_tok:
            self._mask_buf = np.empty((n_tok, self.cache.n_ctx), bool)
        return self._mask_buf.reshape(-1)[: n_tok * n_rows].reshape(n_tok, n_rows)

    def layer(self, st: PassState, i: int, weights: LayerWeights) -> None:
        if st.alive is not None:  # the pruned rows of this layer: finite, masked, never committed
            self.cache.k[i][st.dead_rows] = 0
            self.cache.v[i][st.dead_rows] = 0
        st.x = layer_in_chunks(self.layer_fn, self.spec, weights, st.x, pos=st.pos, mask=st.mask, cache=self.cache,
                               layer=i, rows=st.rows, inv_freq=self.inv_freq)
        n = st.x.shape[0]
        self.token_layers += n
        if st.tree.n_given == 1:  # decoding passes only: the prompt's pass is the same for every pipeline
            self.layer_tokens[i] += n
        if self.observer is not None and st.alive is None:
            self.observer(i, st.tree, st.x)
        if self.predictor is not None and i == self.predictor.layer:
            self.prune(st, self.predictor.prune(st.tree, st.x))

    @staticmethod
    def prune(st: PassState, alive: np.ndarray) -> None:
        """The nodes not alive leave the pass from the next layer on."""
        if alive.all():
            return
        live = np.flatnonzero(alive)
        st.hidden, st.alive = st.x.copy(), alive
        base = st.rows.start
        st.dead_rows = base + np.flatnonzero(~alive)
        st.rows = base + live
        st.x, st.pos, st.mask = st.x[live], st.pos[live], st.mask[live]

    def _traced_layer(self, st: PassState, i: int, weights: LayerWeights, n_threads: int = 0) -> None:
        with self.tracer.span(self.name, f"layer {i}", batch=st.tree.n_nodes):  # the compute, not the wait for a slot
            t0, n = time.perf_counter(), st.x.shape[0]
            with native.threads(n_threads):
                self.layer(st, i, weights)
            if self.emulate_layer_s_per_token:  # a slower unit: the layer ends when it would have there
                time.sleep(max(0.0, t0 + n * self.emulate_layer_s_per_token - time.perf_counter()))

    def finish(self, st: PassState, timing: PassTiming | None = None) -> Verified:
        if st.alive is None:
            return Verified(st.tree, st.x, timing=timing)
        st.hidden[st.alive] = st.x
        return Verified(st.tree, st.hidden, st.alive, timing)

    def verify(self, tree: TokenTree, layers: dict[int, LayerWeights]) -> Verified:
        """The whole pass at once, with every layer given (tests, and memory-resident use)."""
        st = self.begin(tree)
        for i in range(self.spec.n_layer):
            self.layer(st, i, layers[i])
        return self.finish(st)

    @staticmethod
    def verify_batch(verifiers: list[PrunedVerify], trees: list[TokenTree],
                     layers: dict[int, LayerWeights]) -> list[Verified]:
        """Several requests' trees in one pass over `layers` (issue 49): each request's
        verifier keeps its own cache and keep protocol; each layer runs once over every
        request's rows (backends/cpu/batch.py), so each Verified is its own `verify`'s, bit for
        bit. No pruning here (the predictor scores one tree at a time). Each request hears the
        whole pass's timing (its nodes all the trees'), which its cost model learns from as from
        a pass of its own: what a pass of that many nodes took here."""
        states = [v.begin(t) for v, t in zip(verifiers, trees, strict=True)]
        spec = verifiers[0].spec
        segments = [Segment(v.cache, st.rows, st.pos, st.mask) for v, st in zip(verifiers, states)]
        x = np.concatenate([st.x for st in states])  # (sum of n_nodes, n_embd)
        compute_s = wait_s = 0.0
        for i in range(spec.n_layer):
            t0 = time.perf_counter()
            weights = layers[i]  # a streamed layer may still be landing
            t1 = time.perf_counter()
            x = layer_batch_in_chunks(spec, weights, x, segments=segments, layer=i, inv_freq=verifiers[0].inv_freq)
            wait_s, compute_s = wait_s + t1 - t0, compute_s + time.perf_counter() - t1
        timing = PassTiming(int(x.shape[0]), compute_s, wait_s, getattr(layers, "read_s", 0.0),
                            getattr(layers, "read_bytes", 0))
        out, a = [], 0
        for v, st in zip(verifiers, states):
            st.x, a = x[a : a + st.tree.n_nodes], a + st.tree.n_nodes
            v.token_layers += st.tree.n_nodes * spec.n_layer
            out.append(v.finish(st, timing))
        return out

    async def run(self, inputs, outputs):
        layers_in, free_out = inputs.get("layers"), outputs.get("free")
        async for tree in inputs["tree"]:
            with self.tracer.span(self.name, f"pass {tree.pass_id}", kind="pass", batch=tree.n_nodes):
                if self.shared_pass is not None:
                    verified = await anyio.to_thread.run_sync(self.shared_pass, self, tree)
                else:
                    verified = await self._pass(tree, layers_in, free_out)
            await outputs["verified"].send(verified)

    async def _pass(self, tree: TokenTree, layers_in, free_out) -> Verified:
        """One pass. The compute slot is held from layer to layer while weights are ready and
        let go only to wait for a read, which is when drafting ahead may use the cores."""
        st, slot, held = self.begin(tree), self.slot, False
        compute_s = wait_s = read_s = slot_wait_s = 0.0
        read_bytes = 0
        streamed: tuple[int, ...] = ()
        if layers_in is not None:  # the pass's plan first: which layers come from Prefetch
            t0 = time.perf_counter()
            plan = await layers_in.receive()
            wait_s += time.perf_counter() - t0
            assert isinstance(plan, PassLayers), f"expected a pass's plan, Prefetch sent {type(plan).__name__}"
            streamed = plan.streamed
        try:
            for i in range(self.spec.n_layer):
                if (stop := getattr(self.resident, "stopped", None)) is not None:
                    # a memory cap below the run's floor: stop before being killed for it (a fresh error: the
                    # stored one raised again would gather every failed run's frames in its traceback)
                    raise LeverError(str(stop))
                msg = None
                if i not in streamed:
                    weights = self.resident.get(i)
                    if weights is None:  # dropped since the pass was planned: read it here, now
                        if held:
                            slot.release(VERIFY)
                            held = False
                        weights, n, s = await anyio.to_thread.run_sync(self.resident.read_late, i)
                        read_s, read_bytes, wait_s = read_s + s, read_bytes + n, wait_s + s
                else:
                    try:
                        msg = layers_in.receive_nowait()
                    except anyio.WouldBlock:
                        if held:
                            slot.release(VERIFY)
                            held = False
                        t0 = time.perf_counter()
                        msg = await layers_in.receive()
                        wait_s += time.perf_counter() - t0
                    assert msg.layer == i, f"expected layer {i}, Prefetch sent {msg.layer}"
                    weights = msg.weights
                    read_s += msg.read_s
                    read_bytes += msg.n_bytes
                if slot is not None and not held:
                    t0 = time.perf_counter()
                    await slot.acquire(VERIFY)
                    slot_wait_s += time.perf_counter() - t0
                    held = True
                n_threads = slot.threads(VERIFY) if slot is not None else 0  # fewer while drafting ahead runs beside
                t0 = time.perf_counter()
                await anyio.to_thread.run_sync(self._traced_layer, st, i, weights, n_threads)
                compute_s += time.perf_counter() - t0
                if msg is not None:
                    await free_out.send(FreeBuffer(msg.buffer_id))
        finally:
            if held:
                slot.release(VERIFY)
        return self.finish(st, PassTiming(tree.n_nodes, compute_s, wait_s, read_s, read_bytes,
                                          slot_wait_s=slot_wait_s))
