"""`lever profile -c CONFIG`: measure this machine's flash and compute for the cost model.

Writes a lever.policy.profile file (msgpack) beside the target unless --out says otherwise,
prints the table and what the cost model then predicts for a verification pass.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np

from lever.backends.cpu import native
from lever.backends.cpu.kv_cache import KVCache, causal_mask
from lever.backends.cpu.layer import layer_forward, layer_tensor_names, load_layer
from lever.backends.flash import FlashConfig, FlashStore
from lever.backends.flash.config import PAGE_BYTES
from lever.backends.flash.layout import Read
from lever.cli.common import (
    add_common,
    add_set,
    check_sets,
    cpu_model,
    input_text_file,
    lever_version,
    output_file,
    rounds,
)
from lever.cli.table import show
from lever.config import load_config
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.identity import ModelIdentity
from lever.model.transformer import Model
from lever.outputs import atomic_path, writable_destination
from lever.pipelines.compose import read_pass_s
from lever.policy.cost_model import CostModel, layer_read_bytes
from lever.policy.profile import (
    HEAD_ROWS,
    KV_ROWS,
    PROFILE_SUFFIX,
    SMALL_READ_BYTES,
    TOKEN_BUCKETS,
    DraftProfile,
    FlashProfile,
    Profile,
    TargetProfile,
    default_path,
    write,
)


def _median_rounds(jobs: dict, rounds: int) -> dict:
    """Median seconds of each job over `rounds` rounds, the jobs interleaved within a round so
    a burst of load from another process hits one sample of many jobs, not many of one."""
    samples: dict = {k: [] for k in jobs}
    for _ in range(rounds):
        for k, fn in jobs.items():
            t0 = time.perf_counter()
            fn()
            samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def _warm(jobs: dict) -> None:
    # First calls fault in the weights and start the kernels' threads; never timed.
    for fn in jobs.values():
        fn()


def _single_reads(store, n_bytes: int, n_reads: int, seed: int = 0) -> float:
    """Median seconds of one n_bytes read at a random page of a streamed layer, one at a
    time through the store (so mode and emulation apply); random places defeat any cache."""


    runs = [(layer, run) for layer in store.streamed for run in store.extents[layer].runs]
    n_bytes = max(PAGE_BYTES, min(n_bytes, store.pool.buffer_bytes) // PAGE_BYTES * PAGE_BYTES)
    rng = np.random.default_rng(seed)
    buf = store.pool.acquire()
    times = []
    try:
        for _ in range(n_reads):
            layer, run = runs[rng.integers(len(runs))]
            pages = max((run.file_end - run.file_start - n_bytes) // PAGE_BYTES, 0)
            offset = run.file_start + int(rng.integers(pages + 1)) * PAGE_BYTES
            need = max(min(n_bytes, store.file.data.size - offset), 0)
            r = Read(layer, 0, offset, n_bytes, need, 0, need)
            t0 = time.perf_counter()
            store.read(r, buf)
            times.append(time.perf_counter() - t0)
    finally:
        store.pool.release(buf)
    return statistics.median(times)


def measure_flash(path: str | os.PathLike, flash: FlashConfig, passes: int = 3, n_reads: int = 32,
                  out: Callable[[str], None] = lambda s: None) -> FlashProfile:
    """The flash as configured, every layer streamed (the most bytes per pass to time)."""

    def rates(cfg: FlashConfig) -> tuple[float, float, float, int]:
        with FlashStore(path, cfg) as store:
            pass_bytes = store.streamed_bytes
            small = _single_reads(store, SMALL_READ_BYTES, n_reads)
            chunk = _single_reads(store, cfg.chunk_bytes, max(n_reads // 4, 3), seed=1)
        pass_s = read_pass_s(str(path), cfg, n_passes=passes + 1)  # median of `passes` steady-state passes
        return pass_bytes / pass_s, small, chunk, pass_bytes

    streamed = attrs.evolve(flash, dram_budget=0)
    out(f"flash: {passes} streamed passes of {path} ({flash.mode}, queue depth {flash.queue_depth})")
    bw, small, chunk, pass_bytes = rates(streamed)
    dev_bw, dev_small = bw, small
    if flash.bandwidth_cap_bytes_per_s or flash.read_latency_ms:
        out("flash: again with the emulation off, for the device's own speed")
        dev_bw, dev_small, _, _ = rates(attrs.evolve(streamed, bandwidth_cap_bytes_per_s=0, read_latency_ms=0))
    return FlashProfile(mode=flash.mode, queue_depth=flash.queue_depth, chunk_bytes=flash.chunk_bytes,
                        bandwidth_cap_bytes_per_s=float(flash.bandwidth_cap_bytes_per_s),
                        read_latency_ms=float(flash.read_latency_ms), pass_bytes=pass_bytes, read_bytes_per_s=bw,
                        small_read_s=small, chunk_read_s=chunk, device_read_bytes_per_s=dev_bw,
                        device_small_read_s=dev_small)


def _pass_inputs(spec, n: int, kv_rows: int, rng):
    """Hidden rows, positions, mask and cache rows of an n-token pass after kv_rows committed
    ones; the new tokens form a chain (a tree costs the same: the mask is dense either way)."""


    x = rng.standard_normal((n, spec.n_embd)).astype(np.float32)
    pos = np.arange(kv_rows, kv_rows + n, dtype=np.int32)
    return x, pos, causal_mask(kv_rows, n), slice(kv_rows, kv_rows + n)


def _filled_cache(spec, kv_rows: int, max_tokens: int, rng):
    cache = KVCache(spec, kv_rows + max_tokens)
    for a in cache.k + cache.v:  # committed rows with values like real keys, not zeros
        a[:kv_rows] = rng.standard_normal(a[:kv_rows].shape).astype(a.dtype)
    cache.n_rows = kv_rows
    return cache


def _type_mixes(f, spec) -> dict[tuple[str, ...], list[int]]:
    """Layers grouped by their tensors' types (Q4_K_M gives some layers Q6_K matrices)."""

    mixes: dict[tuple[str, ...], list[int]] = {}
    for i in range(spec.n_layer):
        key = tuple(f"{field}:{f.tensor(name).type.name}" for field, name in layer_tensor_names(f, i).items())
        mixes.setdefault(key, []).append(i)
    return mixes


def _layer_in_dram(f, spec, layer: int):
    """A layer copied out of the file mapping, as a streamed layer sits in a staging buffer."""


    raws = {name: np.array(f.raw(name)) for name in layer_tensor_names(f, layer).values()}
    return load_layer(f, spec, layer, raws=raws)


def _head_jobs(model, rows: tuple[int, ...], rng) -> dict:
    hidden = {n: rng.standard_normal((n, model.spec.n_embd)).astype(np.float32) for n in rows}
    return {n: (lambda h=hidden[n]: model.logits(h)) for n in rows}


def measure_target(path: str | os.PathLike, rounds: int = 5, kv_rows: int = KV_ROWS,
                   tokens: tuple[int, ...] = TOKEN_BUCKETS, head_rows: tuple[int, ...] = HEAD_ROWS,
                   layers_per_mix: int = 2, out: Callable[[str], None] = lambda s: None) -> TargetProfile:
    """A few layers of each tensor-type mix, copied to DRAM as a streamed layer sits in its
    staging buffer and packed as a resident layer is, run one after another by layer_forward
    over each bucket of tokens, each layer timed on its own.

    Running several distinct layers in sequence, as a pass does, makes each one's weights
    come from DRAM; timing one layer over and over would find it partly in the CPU's cache
    and understate a pass (docs/measurements.md, 'Profiling: timing layers out of cache')."""


    f = GGUFFile(path)
    model = Model(file=f, load_layers=False)
    spec = model.spec
    rng = np.random.default_rng(0)
    mixes = list(_type_mixes(f, spec).values())
    timed = [i for layers in mixes for i in layers[:layers_per_mix]]
    held = {("streamed", i): _layer_in_dram(f, spec, i) for i in timed}
    held |= {("resident", i): load_layer(f, spec, i, tiles=True) for i in timed}
    out(f"target: layers {sorted(timed)} of {spec.n_layer} ({len(mixes)} tensor-type mixes), streamed and resident, "
        f"tokens {tokens}, {kv_rows} KV rows, {rounds} rounds")
    cache = _filled_cache(spec, kv_rows, max(tokens), rng)
    inputs = {n: _pass_inputs(spec, n, kv_rows, rng) for n in tokens}
    samples: dict[tuple[str, int, int], list[float]] = {(*k, n): [] for k in held for n in tokens}

    def run_pass(n: int, record: bool) -> None:
        x, pos, mask, rows = inputs[n]
        for (kind, i), lw in held.items():
            t0 = time.perf_counter()
            layer_forward(spec, lw, x, pos=pos, mask=mask, cache=cache, layer=i, rows=rows, inv_freq=model.inv_freq)
            if record:
                samples[(kind, i, n)].append(time.perf_counter() - t0)

    for n in tokens:  # warm-up: faults in the copies, starts the kernels' threads
        run_pass(n, record=False)
    for _ in range(rounds):  # buckets interleaved, so a burst of load elsewhere hits all alike
        for n in tokens:
            run_pass(n, record=True)
    med = {k: statistics.median(v) for k, v in samples.items()}

    def per_layer(kind: str) -> tuple[float, ...]:
        return tuple(sum(len(layers) / spec.n_layer
                             * statistics.fmean(med[(kind, i, n)] for i in layers[:layers_per_mix])
                         for layers in mixes) for n in tokens)
    out(f"target: lm_head over rows {head_rows}")
    heads = _head_jobs(model, head_rows, rng)
    _warm(heads)
    head = _median_rounds(heads, rounds)
    return TargetProfile(model=ModelIdentity.of(path), n_layer=spec.n_layer, kv_rows=kv_rows, tokens=tuple(tokens),
                         layer_s=per_layer("streamed"), resident_layer_s=per_layer("resident"),
                         layers_timed=tuple(sorted(timed)), head_rows=tuple(head_rows),
                         head_s=tuple(head[n] for n in head_rows))


def measure_draft(path: str | os.PathLike, rounds: int = 5, kv_rows: int = KV_ROWS,
                  batch: tuple[int, ...] = TOKEN_BUCKETS, head_rows: tuple[int, ...] = HEAD_ROWS,
                  out: Callable[[str], None] = lambda s: None) -> DraftProfile:
    """The whole resident draft (Model.forward: embedding and all layers) at each batch."""


    model = Model(path)
    spec = model.spec
    rng = np.random.default_rng(1)
    out(f"draft: {spec.n_layer} layers, batch {batch}, {kv_rows} KV rows, {rounds} rounds")
    cache = _filled_cache(spec, kv_rows, max(batch), rng)

    def forward(ids, pos, mask) -> None:
        model.forward(ids, pos, mask, cache)
        cache.truncate(kv_rows)  # the next call finds the same committed prefix

    jobs = {}
    for n in batch:
        _, pos, mask, _ = _pass_inputs(spec, n, kv_rows, rng)
        ids = rng.integers(0, spec.n_vocab, n)
        jobs[n] = lambda ids=ids, pos=pos, mask=mask: forward(ids, pos, mask)
    _warm(jobs)
    med = _median_rounds(jobs, rounds)
    heads = _head_jobs(model, head_rows, rng)
    _warm(heads)
    head = _median_rounds(heads, rounds)
    return DraftProfile(ModelIdentity.of(path), spec.n_layer, kv_rows, tuple(batch), tuple(med[n] for n in batch),
                        tuple(head_rows), tuple(head[n] for n in head_rows))


def compute_threads() -> int:
    return native.n_threads_default or os.cpu_count() or 1


def measure(cfg, rounds: int = 5, passes: int = 3, n_reads: int = 32,
            out: Callable[[str], None] = lambda s: None) -> Profile:
    """Profile this machine for the config's target (cfg.model.target, cfg.flash) and draft
    (cfg.model.draft; none when empty). Takes a config from lever.config.load_config."""
    if not cfg.model.target:
        raise LeverError(f"{cfg.where}: [model] target is not set: nothing to profile")
    target = Path(cfg.model.target)
    draft = Path(cfg.model.draft) if cfg.model.draft else None
    load_before = _load_avg()
    for p in (target, draft):
        if p is not None and not p.is_file():
            raise LeverError(f"{p}: no such model file")
    flash = measure_flash(target, cfg.flash, passes, n_reads, out)
    tgt = measure_target(target, rounds, out=out)
    dft = measure_draft(draft, rounds, out=out) if draft else None
    method = (
        f"flash: median of {passes} whole passes at dram_budget 0 read through Prefetch with no compute "
        f"(lever.pipelines.compose.read_pass_s: end of one pass to the end of the next, after a first), "
        f"and of {n_reads} single {SMALL_READ_BYTES}-byte reads (and chunk reads) at "
        f"random streamed offsets, one in flight; compute: median of {rounds} interleaved rounds after a warm-up, "
        f"every pass after {KV_ROWS} committed KV rows of random values; target per layer by layer_forward on "
        f"layers {list(tgt.layers_timed)} (a few of each tensor-type mix) copied to DRAM, run in sequence and "
        f"timed one by one, weighted by each mix's share of layers; draft by Model.forward over all its layers; "
        f"heads by Model.logits; times from time.perf_counter"
    )
    return Profile(device=cpu_model(), platform=platform.platform(), threads=compute_threads(),
                   date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), method=method,
                   lever_version=lever_version(), flash=flash, target=tgt, draft=dft,
                   load_avg_1min=(load_before, _load_avg()))


def _load_avg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return -1.0  # not known here


def print_table(profile: Profile, out: Callable[[str], None] = print) -> None:
    fl, t, d = profile.flash, profile.target, profile.draft
    cap = f"cap {fl.bandwidth_cap_bytes_per_s / 1e9:.2f} GB/s" if fl.bandwidth_cap_bytes_per_s else "no cap"
    load = " -> ".join(f"{x:.2f}" for x in profile.load_avg_1min)
    out(f"device   {profile.device}, {profile.threads} threads ({profile.platform}), load average {load or '?'}")
    out(f"flash    {fl.mode}, queue depth {fl.queue_depth}, {fl.chunk_bytes / 2**20:g} MiB chunks, {cap}: "
        f"{fl.read_bytes_per_s / 1e9:.2f} GB/s ({fl.pass_bytes / 1e6:.0f} MB/pass), "
        f"{SMALL_READ_BYTES // 1024} KiB read {fl.small_read_s * 1e3:.3f} ms, chunk read {fl.chunk_read_s * 1e3:.2f} ms"
        + (f"; device alone {fl.device_read_bytes_per_s / 1e9:.2f} GB/s, {fl.device_small_read_s * 1e3:.3f} ms"
           if (fl.bandwidth_cap_bytes_per_s or fl.read_latency_ms) else ""))
    ms = lambda xs: [f"{x * 1e3:.2f}" for x in xs]  # noqa: E731
    rows = [("target layer ms", *ms(t.layer_s)), ("  resident (tiles)", *ms(t.resident_layer_s))]
    if d is not None:
        rows.append(("draft forward ms", *ms(d.forward_s)))
    show(("tokens", *map(str, t.tokens)), rows, out)
    heads = f"target {', '.join(f'{s / n * 1e3:.2f}' for n, s in zip(t.head_rows, t.head_s))}"
    if d is not None:
        heads += f"; draft {', '.join(f'{s / n * 1e3:.2f}' for n, s in zip(d.head_rows, d.head_s))}"
    out(f"lm_head ms/row at rows {', '.join(map(str, t.head_rows))}: {heads}")


def check_args(args) -> None:
    input_text_file(args.config, "-c", "config file")
    output_file(args.out, "--out")
    check_sets(args)


def main(args) -> int:
    check_args(args)
    cfg = load_config(args.config, args.set)
    dest = writable_destination(args.out or default_path(cfg.model.target), "--out") if cfg.model.target else None

    def progress(line: str) -> None:  # stderr: stdout keeps only the table
        print(line, file=sys.stderr)

    with native.default_threads(cfg.runtime.threads):
        profile = measure(cfg, rounds=args.rounds, passes=args.passes, out=progress)
    with atomic_path(dest, "--out") as tmp:  # the whole profile or none, whatever stops the write
        write(profile, tmp)
    path = dest
    print_table(profile)
    _print_predictions(cfg, profile)
    print(f"wrote {path}")
    return 0


def _print_predictions(cfg, profile: Profile) -> None:
    cm = CostModel.from_profile(profile, layer_read_bytes(cfg.model.target, cfg.flash), cfg.flash)
    ns = (1, 8, 32, 64)
    print(f"verify ms at this config (dram_budget {cfg.flash.dram_budget!r}): "
          + ", ".join(f"n={n} {cm.verify_s(n) * 1e3:.1f}" for n in ns))


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("profile", help="measure this machine's flash and compute for the cost model (msgpack)")
    p.add_argument("-c", "--config", type=Path, required=True, help="TOML config naming the target (and draft)")
    p.add_argument("--out", type=Path, default=None, help=f"profile to write (default: <target>{PROFILE_SUFFIX})")
    add_set(p)
    p.add_argument("--rounds", type=rounds, default=5, help="timed rounds per compute bucket (the median is kept)")
    p.add_argument("--passes", type=rounds, default=3, help="streamed passes timed for the read bandwidth")
    add_common(p)
    p.set_defaults(func=main, check=check_args)
    return p
