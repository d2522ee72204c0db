"""`lever bench flash -c CONFIG`: Flash-AR at DRAM budgets 0-100%, side by side in one run.

Each budget runs in its own process (`lever run --json`); then the pure read time of a pass
(lever.pipelines.compose.read_pass_s) against the compute of a resident run says how close
Flash-AR comes to max(read, compute), and with --cap the same under a bandwidth cap.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import attrs

from lever.backends.flash import FlashConfig
from lever.cli.bench import rows
from lever.cli.bench.child import run_json
from lever.cli.common import add_common, bench_tokens, check_sets, float_in
from lever.cli.models import add_models, bench_config, check_models
from lever.cli.table import show
from lever.config import load_config
from lever.errors import LeverError
from lever.pipelines.compose import read_pass_s

FLASH_AR = (*rows.FLASH_AR, *rows.NO_BASELINE)


def bench_flash(config: str, prompt: str, n: int, budgets=(0.0, 0.25, 0.5, 0.75, 1.0), cap_bytes_per_s: float = 0.0,
                out=print, sets: Sequence[str] = ()) -> list[dict]:
    """Flash-AR at several DRAM budgets, side by side in one run; then the overlap figures."""

    cfg = load_config(config, sets)
    model_path = cfg.model.target
    rows, lines = [], []
    for b in budgets:
        r = run_json(config, [*sets, *FLASH_AR, f"flash.dram_budget={b!r}"], prompt, n)
        bound = r["memory"]["rss_bound_bytes"]  # lever.policy.memory's plan before loading, plus its stated margin
        streamed = r["flash"]["streamed_bytes_per_pass"]
        dev_ratio = r["flash_mb_per_token"] * 1e6 / streamed if streamed else 0
        lines.append((f"{b:.0%}", f"{r['ms_per_token']:.1f}", f"{r['flash_mb_per_token']:.1f}",
                      f"{streamed / 1e6:.1f}", f"{dev_ratio:.3f}", f"{r['timing']['overlap_share']:.0%}",
                      f"{r['timing']['pass_wall_ratio']:.2f}", f"{r['memory']['peak_rss_bytes'] / 2**20:.0f}",
                      f"{bound / 2**20:.0f}"))
        rows.append(r | {"budget": b})
    # device/str: bytes the device read per token over bytes streamed per pass; wall/max: a pass's
    # wall time over the larger of its read and compute; bound: the memory plan with its margin
    show(("budget", "ms/tok", "MB/tok", "MB/pass", "dev/str", "overlap", "wall/max", "RSS MiB", "bound"), lines, out,
         title="Flash-AR by DRAM budget (MB/tok from the device, MB/pass streamed)")
    compute_ms = rows[-1]["ms_per_token"] if budgets[-1] == 1.0 else None
    zero = rows[0]
    read_ms = read_pass_s(model_path, attrs.evolve(cfg.flash, dram_budget=budgets[0])) * 1e3
    if compute_ms:
        out(f"\nbudget {budgets[0]:.0%}: pure read {read_ms:.1f} ms/pass, compute {compute_ms:.1f} ms/pass "
            f"(resident run), "
            f"Flash-AR {zero['ms_per_token']:.1f} ms/token = {zero['ms_per_token'] / max(read_ms, compute_ms):.2f}x "
            f"max(read, compute)")
    if cap_bytes_per_s:
        capped = attrs.evolve(cfg.flash, dram_budget=budgets[0], bandwidth_cap_bytes_per_s=cap_bytes_per_s)
        r = run_json(config, [*sets, *FLASH_AR, f"flash.dram_budget={budgets[0]!r}",
                              f"flash.bandwidth_cap_bytes_per_s={cap_bytes_per_s}"],
                     prompt, n)
        cap_read_ms = read_pass_s(model_path, capped) * 1e3
        out(f"capped at {cap_bytes_per_s / 1e9:.2f} GB/s: pure read {cap_read_ms:.1f} ms/pass, Flash-AR "
            f"{r['ms_per_token']:.1f} ms/token = {r['ms_per_token'] / cap_read_ms:.2f}x the pure read time")
    return rows


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("flash", help="Flash-AR at DRAM budgets 0-100%%, with overlap figures")
    add_models(b, default="none: give -c or -m")
    b.add_argument("-p", "--prompt", default="def quicksort(arr):")
    b.add_argument("--n-gen", type=bench_tokens, default=32, help="tokens generated per run")
    b.add_argument("--cap", type=float_in(0.0, 1e15), default=0.0,
                   help="also run with this bandwidth cap (bytes/s; 0: none)")
    add_common(b)
    b.set_defaults(func=main, check=check_args)
    return b


def check_args(args) -> None:
    """The cap as [flash] bandwidth_cap_bytes_per_s would take it, before the first run."""
    check_models(args)
    bench_config(args)  # -c or -m
    try:
        FlashConfig(bandwidth_cap_bytes_per_s=args.cap)
    except LeverError as e:
        raise LeverError(f"--cap: {str(e).split(': ', 1)[-1]}") from None
    check_sets(args)


def main(args) -> int:
    check_args(args)
    config, sets = bench_config(args, say=print)
    bench_flash(config, args.prompt, args.n_gen, cap_bytes_per_s=args.cap, sets=sets)
    return 0
