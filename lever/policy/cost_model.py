"""The cost model: what a token tree of n nodes costs in latency, from a measured profile.

It sits between the profile (lever.policy.profile, measured once per machine by `lever profile`) and
TreeExpand, which grows a draft tree node by node while a node's expected gain exceeds its
cost: the node's share of drafting (`expand_s`) plus the growth of the verification pass at
the new tree size (`marginal_verify_s`). A streamed pass pays for reading the target once
whatever the tree size, so while reads dominate a node adds almost nothing to verification;
that is why trees should grow on slow flash and shrink on fast flash. Without a profile,
`CostModel.default` builds the same tables from nominal rates (a documented fallback).
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Sequence
from pathlib import Path

import attrs

from lever.backends.flash import FlashConfig
from lever.backends.flash.config import plan_residency
from lever.backends.flash.layout import layer_extents, plan_chunks
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.identity import ModelIdentity
from lever.gguf.spec import read_spec
from lever.policy.profile import HEAD_ROWS, KV_ROWS, PROFILE_SUFFIX, TOKEN_BUCKETS, Profile, ProfileConfig, read

# The fallback's nominal machine: a phone's UFS 3.1 flash and a few big cores. Only used when
# no profile is configured; any measured profile replaces all of them.
NOMINAL_READ_BYTES_PER_S = 2.1e9  # UFS 3.1 sequential reads
NOMINAL_READ_LATENCY_S = 100e-6  # one small read on UFS
# Quantized matmuls on two CPU cores: this project's kernels run a 1.5B model's 32-token
# forward at more than this rate on the 2-core dev machine (`lever bench model`, pp32:
# docs/measurements.md, 'Kernels against llama.cpp'); a phone's big cores are of that order.
# Conservative, since overrating compute only makes trees smaller.
NOMINAL_FLOPS_PER_S = 300e9
NOMINAL_DRAM_BYTES_PER_S = 10e9  # weights streamed from DRAM: batch-1 matmuls are bound by this


def _monotone(ys: Sequence[float]) -> tuple[float, ...]:
    # Timing noise must never make a bigger tree look cheaper than a smaller one: a TreeExpand
    # reading a dip as a negative cost would grow the tree for nothing.
    return tuple(itertools.accumulate((float(y) for y in ys), max))


def _ints(xs: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(x) for x in xs)


def interpolate(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through the buckets (xs ascending); beyond either end the end segment
    continues, since compute grows about linearly in tokens once the matmuls are compute
    bound. Never below 0."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    j = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def emulated_read(device_bytes_per_s: float, device_latency_s: float, flash: FlashConfig) -> tuple[float, float]:
    """(bytes/s, latency s) of the device seen through the flash config's emulation.

    The Throttle is a floor over the device: a read takes at least its latency plus n / cap,
    and reads share the cap. So the bandwidth is the smaller of the device's and the cap, and
    an emulated latency limits it further to what `queue_depth` reads in flight can move
    (Little's law: each reader finishes one chunk per latency + transfer)."""
    bw = device_bytes_per_s
    if flash.bandwidth_cap_bytes_per_s:
        bw = min(bw, flash.bandwidth_cap_bytes_per_s)
    lat = flash.read_latency_ms / 1e3
    if lat:
        bw = min(bw, flash.queue_depth * flash.chunk_bytes / (lat + flash.chunk_bytes / bw))
    return bw, device_latency_s + lat


def layer_read_bytes(target, flash: FlashConfig, resident: frozenset[int] | None = None) -> tuple[int, ...]:
    """Bytes each target layer reads per pass under `flash` (0 for a resident layer), in
    execution order: the residency plan (`resident`, a RunPlan's; else planned from `flash`)
    and chunked reads FlashStore makes, without opening it."""

    f = target if isinstance(target, GGUFFile) else GGUFFile(target)
    extents = layer_extents(f)
    if resident is None:
        resident = plan_residency([e.buffer_bytes for e in extents], flash.dram_budget)
    return tuple(0 if i in resident else sum(r.n_bytes for r in plan_chunks(e, flash.chunk_bytes))
                 for i, e in enumerate(extents))


@attrs.frozen(kw_only=True)  # many numbers of one type: by name, never by place
class CostModel:
    """Latencies of one configuration (a target with its residency plan, its flash, a draft).

    Build it with `from_profile` (measured) or `default` (nominal fallback). Time tables are
    made non-decreasing on construction, so every cost is monotonic in its size.
    """

    layer_read_bytes: tuple[int, ...] = attrs.field(converter=_ints)  # per layer, 0 = resident
    read_bytes_per_s: float
    read_latency_s: float  # before the first byte of a pass arrives
    window_layers: int  # staging buffers: how far reads may run ahead of compute
    tokens: tuple[int, ...] = attrs.field(converter=_ints)
    layer_s: tuple[float, ...] = attrs.field(converter=_monotone)  # one streamed target layer over tokens[i] tokens
    head_rows: tuple[int, ...] = attrs.field(converter=_ints)
    head_s: tuple[float, ...] = attrs.field(converter=_monotone)  # target lm_head over head_rows[i] rows
    draft_batch: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    draft_forward_s: tuple[float, ...] = attrs.field(default=(), converter=_monotone)
    draft_head_rows: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    draft_head_s: tuple[float, ...] = attrs.field(default=(), converter=_monotone)
    source: str = ""  # "profile PATH" or "fallback": what the numbers stand on
    # one resident target layer (tile layout) over tokens[i] tokens; () = as a streamed one
    resident_layer_s: tuple[float, ...] = attrs.field(default=(), converter=_monotone)
    pass_delay_s: float = 0.0  # a pass's waits for cores held by drafting ahead (measured online; the profile has none)
    overhead_s: float = 0.0  # what a running cycle spends beyond its parts (measured online: hand-offs, tree building)
    read_what_if: bool = False  # the read speed is a what-if ([runtime] what_if_read_bytes_per_s): not measured

    def __attrs_post_init__(self):
        if not self.read_bytes_per_s > 0:
            raise LeverError(f"cost model: read bandwidth must be > 0 bytes/s, got {self.read_bytes_per_s}")
        if self.window_layers < 1:
            raise LeverError(f"cost model: window_layers must be >= 1, got {self.window_layers}")
        if self.resident_layer_s and len(self.resident_layer_s) != len(self.tokens):
            raise LeverError(f"cost model: {len(self.resident_layer_s)} resident layer times for {len(self.tokens)} "
                             f"token buckets")

    # -- constructors

    @classmethod
    def from_profile(cls, profile: Profile, layer_read_bytes: Sequence[int], flash: FlashConfig | None = None,
                     source: str = "profile") -> CostModel:
        """A measured profile applied to one configuration: `layer_read_bytes` from
        `layer_read_bytes(target, flash)` (or a FlashStore's plan), `flash` the run's flash
        settings. When their cap and latency are those profiled, the measured rates stand;
        otherwise the device's own rates are seen through the run's emulation. The mode,
        queue depth and chunk size are taken to be the profiled ones (profile again if they
        change much: they move the device's rate, which no formula here predicts)."""
        t, d, fl = profile.target, profile.draft, profile.flash
        if len(layer_read_bytes) != t.n_layer:
            raise LeverError(f"cost model: {len(layer_read_bytes)} layers given, the profiled target has {t.n_layer}")
        flash = flash or FlashConfig(mode=fl.mode, queue_depth=fl.queue_depth, chunk_bytes=fl.chunk_bytes,
                                     bandwidth_cap_bytes_per_s=fl.bandwidth_cap_bytes_per_s,
                                     read_latency_ms=fl.read_latency_ms)
        profiled = (fl.bandwidth_cap_bytes_per_s, fl.read_latency_ms)
        if (flash.bandwidth_cap_bytes_per_s, flash.read_latency_ms) == profiled:
            bw, lat = fl.read_bytes_per_s, fl.small_read_s
        else:
            bw, lat = emulated_read(fl.device_read_bytes_per_s, fl.device_small_read_s, flash)
        draft = {} if d is None else {"draft_batch": d.batch, "draft_forward_s": d.forward_s,
                                      "draft_head_rows": d.head_rows, "draft_head_s": d.head_s}
        return cls(layer_read_bytes=tuple(layer_read_bytes), read_bytes_per_s=bw, read_latency_s=lat,
                   window_layers=flash.window_layers, tokens=t.tokens, layer_s=t.layer_s, head_rows=t.head_rows,
                   head_s=t.head_s, source=source, resident_layer_s=t.resident_layer_s, **draft)

    @classmethod
    def default(cls, target, flash: FlashConfig | None = None, draft=None, kv_rows: int = KV_ROWS, *,
                resident: frozenset[int] | None = None) -> CostModel:
        """The fallback when no profile is configured: analytic numbers, not measurements.

        Reads take bytes / bandwidth, the bandwidth being the config's cap if set, else a
        nominal UFS 3.1 (NOMINAL_READ_BYTES_PER_S), behind a nominal latency. A layer (or
        head) over n tokens takes the larger of its weight bytes / NOMINAL_DRAM_BYTES_PER_S
        (a small batch is bound by streaming the weights from DRAM) and its matmul FLOPs /
        NOMINAL_FLOPS_PER_S, plus attention FLOPs over kv_rows + n rows. `target` and
        `draft` are GGUF paths or GGUFFiles. Good enough to rank trees; run `lever profile`
        for numbers of this machine."""

        flash = flash or FlashConfig()
        tf = target if isinstance(target, GGUFFile) else GGUFFile(target)
        device_bw = flash.bandwidth_cap_bytes_per_s or NOMINAL_READ_BYTES_PER_S
        bw, lat = emulated_read(device_bw, NOMINAL_READ_LATENCY_S, flash)
        layer, head = _analytic_model(tf, kv_rows)
        tables = {}
        if draft is not None:
            df = draft if isinstance(draft, GGUFFile) else GGUFFile(draft)
            d_layer, d_head = _analytic_model(df, kv_rows)
            n_draft = len(_layer_weight_bytes(df))
            tables = {"draft_batch": TOKEN_BUCKETS, "draft_forward_s": [n_draft * d_layer(n) for n in TOKEN_BUCKETS],
                      "draft_head_rows": HEAD_ROWS, "draft_head_s": [d_head(n) for n in HEAD_ROWS]}
        return cls(layer_read_bytes=layer_read_bytes(tf, flash, resident), read_bytes_per_s=bw, read_latency_s=lat,
                   window_layers=flash.window_layers, tokens=TOKEN_BUCKETS, layer_s=[layer(n) for n in TOKEN_BUCKETS],
                   head_rows=HEAD_ROWS, head_s=[head(n) for n in HEAD_ROWS], source="fallback", **tables)

    def with_read_bytes_per_s(self, bytes_per_s: float, what_if: bool = False) -> CostModel:
        """The same machine behind another flash bandwidth (e.g. a phone's UFS); `what_if`:
        a run prices its trees by it whatever its own reads measure (OnlineCost)."""
        return attrs.evolve(self, read_bytes_per_s=bytes_per_s, read_what_if=what_if,
                            source=f"{self.source}, reads at {bytes_per_s / 1e9:g} GB/s (what-if)" if what_if
                            else self.source)

    # -- the parts

    @property
    def n_layer(self) -> int:
        return len(self.layer_read_bytes)

    @property
    def streamed_layers(self) -> tuple[int, ...]:
        return tuple(i for i, b in enumerate(self.layer_read_bytes) if b)

    @property
    def read_s(self) -> float:
        """Pure read time of one pass (every streamed layer, back to back)."""
        return sum(self.layer_read_bytes) / self.read_bytes_per_s

    def layer_compute_s(self, n_tokens: float, resident: bool = False) -> float:
        """One target layer over n tokens, linear between the profiled buckets: a streamed
        one (the row layout its staging buffer holds), or a resident one (the tile layout)."""
        return interpolate(self.tokens, self.resident_layer_s if resident and self.resident_layer_s else self.layer_s,
                           n_tokens)

    def compute_s(self, n_tokens: float) -> float:
        """Compute of one pass: every layer over n tokens, nothing waiting on reads."""
        n_streamed = len(self.streamed_layers)
        return (n_streamed * self.layer_compute_s(n_tokens)
                + (self.n_layer - n_streamed) * self.layer_compute_s(n_tokens, resident=True))

    # -- what TreeExpand asks

    def verify_s(self, n_tokens: int, n_after: int | None = None, after_layer: int = -1,
                 head_start_s: float = 0.0) -> float:
        """Latency of one target pass verifying n tokens (a tree of n nodes), its reads started
        `head_start_s` before its compute (0: cold).

        The pass is a two-stage pipeline: Prefetch reads the streamed layers back to back
        (the first one after `read_latency_s`), and a layer is computed once its read has
        landed and the previous layer is done; resident layers are computed without waiting.
        A read needs a free staging buffer, so it cannot run more than `window_layers`
        streamed layers ahead of compute. The recurrence below computes exactly that, and for
        even layers it comes to

            max(total read, total compute) + the edge that cannot overlap,

        the edge being the last layer's compute when reads dominate (it starts only after
        the last read) or the first streamed layer's read when compute dominates (nothing
        can be computed before it lands) - one edge, not both: the first read is already
        part of the total read and the last compute part of the total compute.

        So while reads dominate, a node more adds only its share of the last layer's
        compute: the read of the pass is paid once, whatever the tree size. Not included:
        the target's lm_head, which Accept runs only on the accepted path (`lm_head_s`),
        and read-ahead across passes, which in a running pipeline may hide part of the
        first edge (this is the cold-start latency, an upper bound).
        """
        if n_tokens < 1:
            raise LeverError(f"verify_s: a pass verifies at least 1 token, got {n_tokens}")
        # with pruning, layers past `after_layer` run on the n_after survivors only
        n_late = n_tokens if n_after is None else max(n_after, 1)
        # (streamed, resident) layer compute, before and after the pruning layer
        # a pass's waits for cores held by drafting ahead lengthen its compute, spread over the
        # streamed layers (where they happen): hidden under the reads while those dominate
        wait = self.pass_delay_s / max(len(self.streamed_layers), 1)
        c_all = (self.layer_compute_s(n_tokens) + wait, self.layer_compute_s(n_tokens, resident=True))
        c_late = (self.layer_compute_s(n_late) + wait, self.layer_compute_s(n_late, resident=True))
        read_free = self.read_latency_s - head_start_s  # when the reader may start the next streamed layer
        done = 0.0  # when compute finished the previous layer
        computed: list[float] = []  # compute end of each streamed layer, in read order
        for i, b in enumerate(self.layer_read_bytes):
            c = (c_late if n_after is not None and i > after_layer else c_all)[0 if b else 1]
            if not b:
                done += c
                continue
            k = len(computed)
            start = read_free if k < self.window_layers else max(read_free, computed[k - self.window_layers])
            read_free = start + b / self.read_bytes_per_s
            done = max(done, read_free) + c
            computed.append(done)
        return done

    def marginal_verify_s(self, n_tokens: int) -> float:
        """What one more node adds to a pass of n: ~0 while reads dominate, the whole
        model's per-token compute once compute does."""
        return self.verify_s(n_tokens + 1) - self.verify_s(n_tokens)

    def idle_s(self, n_tokens: int) -> float:
        """Time the compute units wait on flash during a pass of n tokens: what drafting ahead
        can use without delaying verification."""
        return max(0.0, self.verify_s(n_tokens) - self.compute_s(n_tokens))

    def draft_s(self, batch: int) -> float:
        """One batched draft forward (all its layers) over `batch` tokens; 0 for none."""
        if not self.draft_batch:
            raise LeverError(f"cost model ({self.source}): no draft model was profiled")
        return self._sized("draft_s", self.draft_batch, self.draft_forward_s, batch)

    def draft_lm_head_s(self, rows: int) -> float:
        if not self.draft_head_rows:
            raise LeverError(f"cost model ({self.source}): no draft model was profiled")
        return self._sized("draft_lm_head_s", self.draft_head_rows, self.draft_head_s, rows)

    def expand_s(self, batch: int) -> float:
        """One Draft expansion of `batch` nodes: the forward and the draft's lm_head on each."""
        return self.draft_s(batch) + self.draft_lm_head_s(batch)

    def lm_head_s(self, rows: int) -> float:
        """The target's output projection over `rows` rows (Accept: one per accepted token)."""
        return self._sized("lm_head_s", self.head_rows, self.head_s, rows)

    def accept_s(self, rows: float) -> float:
        """Accept after a pass: the output head along an accepted path of `rows` rows."""
        return interpolate(self.head_rows, self.head_s, max(rows, 1.0))

    def cycle_s(self, n_tokens: int, draft_s: float, accept_rows: float, head_start_s: float | None = None) -> float:
        """One cycle: the tree drafted in turns (`draft_s`), its pass, Accept on `accept_rows`.

        The cores do the drafting and Accept; meanwhile the reader runs into the pass, as far
        as the window lets it (`head_start_s`: the time it had, by default this cycle's
        drafting and an Accept of the same length before it)."""
        accept = self.accept_s(accept_rows)
        head = draft_s + accept if head_start_s is None else head_start_s
        return draft_s + self.verify_s(n_tokens, head_start_s=head) + accept + self.overhead_s

    def scaled(self, *, read: float = 1.0, compute: float = 1.0, draft: float = 1.0, head: float = 1.0,
               pass_delay_s: float = 0.0, overhead_s: float = 0.0) -> CostModel:
        """The same tables with measured corrections: reads `read` times as long, target
        layers `compute` times, draft forwards `draft` times, the output head `head` times,
        a pass delayed `pass_delay_s` by drafting ahead, and `overhead_s` more per cycle
        (lever.policy.online keeps them)."""
        times = lambda ys, k: tuple(y * k for y in ys)  # noqa: E731
        return attrs.evolve(self, read_bytes_per_s=self.read_bytes_per_s / read,
                            layer_s=times(self.layer_s, compute),
                            resident_layer_s=times(self.resident_layer_s, compute),
                            draft_forward_s=times(self.draft_forward_s, draft),
                            draft_head_s=times(self.draft_head_s, draft),
                            head_s=times(self.head_s, head), pass_delay_s=pass_delay_s,
                            overhead_s=overhead_s)

    @staticmethod
    def _sized(what: str, xs, ys, n: int) -> float:
        if n < 0:
            raise LeverError(f"{what}: size must be >= 0, got {n}")
        return interpolate(xs, ys, n) if n else 0.0


def _layer_weight_bytes(f) -> list[int]:
    return [e.tensor_bytes for e in layer_extents(f)]


def _analytic_model(f, kv_rows: int):
    """(seconds of one layer over n tokens, seconds of the head over n rows), from the file's
    sizes and nominal rates: the fallback's roofline."""

    spec = read_spec(f)
    q = spec.n_head * spec.head_dim
    layer_macs = spec.n_embd * (q + 2 * spec.kv_dim) + q * spec.n_embd + 3 * spec.n_embd * spec.n_ff
    sizes = _layer_weight_bytes(f)
    layer_bytes = sum(sizes) / max(len(sizes), 1)  # the mean layer: what a pass averages over
    out = f.tensors.get("output.weight") or f.tensor("token_embd.weight")

    def layer(n: float) -> float:
        matmul = max(layer_bytes / NOMINAL_DRAM_BYTES_PER_S, 2 * layer_macs * n / NOMINAL_FLOPS_PER_S)
        return matmul + 4 * n * (kv_rows + n) * q / NOMINAL_FLOPS_PER_S

    def head(n: float) -> float:
        return max(out.n_bytes / NOMINAL_DRAM_BYTES_PER_S, 2 * spec.n_vocab * spec.n_embd * n / NOMINAL_FLOPS_PER_S)

    return layer, head


def cost_model_for(*, target: str | os.PathLike, draft: str | os.PathLike | None, flash: FlashConfig,
                   profile: ProfileConfig, emulate_layer_ms_per_token: float = 0.0,
                   what_if_read_bytes_per_s: float = 0.0,
                   target_file: GGUFFile | None = None, resident: frozenset[int] | None = None) -> CostModel:
    """The cost model a run uses: the [profile] path when set (checked to be a profile of the
    configured target and draft), else the one `lever profile` wrote beside the target if it
    fits, else the analytic fallback; with the verification unit emulated slower ([runtime]
    emulate_layer_ms_per_token), as slow; with a what-if read speed ([runtime]
    what_if_read_bytes_per_s), that fast. `resident`: the target layers kept in DRAM (a RunPlan's),
    else planned from `flash`."""
    target, draft = Path(target), Path(draft) if draft else None
    model = _cost_model_for(target, draft, flash, profile, target_file=target_file, resident=resident)
    ms = emulate_layer_ms_per_token
    if ms > 0:
        floor = lambda table: [max(s, n * ms / 1e3) for n, s in zip(model.tokens, table)] if table else table
        model = attrs.evolve(model, layer_s=floor(model.layer_s), resident_layer_s=floor(model.resident_layer_s),
                             source=f"{model.source}, layers at least {ms} ms/token")
    if what_if_read_bytes_per_s:
        model = model.with_read_bytes_per_s(what_if_read_bytes_per_s, what_if=True)
    return model


def _cost_model_for(target: Path, draft: Path | None, flash: FlashConfig, profile: ProfileConfig, *,
                    target_file: GGUFFile | None = None, resident: frozenset[int] | None = None) -> CostModel:
    # the tensor table, parsed once by the caller when it has the file open already
    opened = target_file if target_file is not None and Path(target_file.path) == target else target
    if not profile.path:
        # `lever profile` writes beside the target by default: use that when it fits the models
        path = target.with_name(target.name + PROFILE_SUFFIX)
        if path.exists():
            try:
                return _from_profile_file(path, target, draft, flash, opened=opened, resident=resident)
            except LeverError:
                pass  # a profile of other models: the fallback, as with none
        return CostModel.default(opened, flash, draft, resident=resident)
    try:
        return _from_profile_file(Path(profile.path), target, draft, flash, opened=opened, resident=resident)
    except LeverError as e:  # a profile the config names: say which key named it
        raise LeverError(f"[profile] path: {e}") from None


def _from_profile_file(path: Path, target: Path, draft: Path | None, flash: FlashConfig, *, opened=None,
                       resident: frozenset[int] | None = None) -> CostModel:
    profile = read(path)
    _check_identity(path, "target", profile.target.model, target)
    if draft is not None:
        if profile.draft is None:
            raise LeverError(f"{path}: profile has no draft model but the config names {draft}: re-run `lever profile`")
        _check_identity(path, "draft", profile.draft.model, draft)
    read_bytes = layer_read_bytes(opened if opened is not None else target, flash, resident)
    return CostModel.from_profile(profile, read_bytes, flash, source=f"profile {path}")


def _check_identity(path: Path, role: str, profiled: ModelIdentity, model: str | os.PathLike) -> None:
    if not profiled.same_file(ModelIdentity.of(model)):
        raise LeverError(f"{path}: profiled {role} {profiled.path} is not the configured {model} "
                         f"(size or first-MiB sha256 differ): re-run `lever profile`")
