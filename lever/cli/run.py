"""`lever run [-c CONFIG]`: generate through a configured pipeline (the target streamed from flash).

Without -c it runs the shipped pair (examples/default.toml, lever.shipped); the summary after
the text is the run's figures, and --json prints them all as one object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lever.cli.common import (
    CONSTRAINT_FLAGS,
    add_common,
    add_constraint,
    add_knobs,
    add_set,
    check_sets,
    constraint_file,
    input_text_file,
    knob_values,
    output_file,
)
from lever.cli.models import add_models, check_models, config_and_sets
from lever.config import load_config
from lever.errors import LeverError, read_text
from lever.model.grammar import GrammarError
from lever.pipelines.engine import run_pipeline


def add_parser(sub) -> argparse.ArgumentParser:
    r = sub.add_parser("run", help="generate through a configured pipeline (target streamed from flash)")
    add_models(r, default="examples/default.toml, the shipped model pair")
    r.add_argument("-p", "--prompt", default=None, help="default: the config's [generate] prompt; '-': read stdin")
    r.add_argument("-f", "--file", type=Path, default=None, help="read the prompt from this file")
    add_knobs(r, "n_predict", "temperature", "seed")  # each overrides its [generate] key
    add_set(r)
    add_constraint(r)
    r.add_argument("--json", action="store_true", help="print one JSON object with the run's figures")
    r.add_argument("--trace", type=Path, default=None, help="write a Chrome/Perfetto trace here")
    add_common(r)
    r.set_defaults(func=main, check=check_args)
    return r


def check_args(args) -> None:
    """Everything about the arguments that needs no model: before any work (lever.cli.common)."""
    if args.file is not None and args.prompt is not None:
        raise LeverError("-f and -p: give the prompt one way")
    if args.file is not None:
        input_text_file(args.file, "-f", "file")
    check_models(args)
    check_sets(args)
    constraint_file(args)
    output_file(args.trace, "--trace")  # a missing folder fails now, not after the whole run


def constraint_args(args) -> dict | None:
    """--json-schema FILE or --grammar FILE as lever.model.grammar.compile_args's arguments."""
    given = constraint_file(args)
    if given is None:
        return None
    flag, path = given
    return {dict(CONSTRAINT_FLAGS)[flag]: read_text(path, flag)}


def main(args) -> int:
    check_args(args)
    config, model_sets = config_and_sets(args)
    overrides = [*model_sets, *args.set, *(f"generate.{key}={v!r}" for key, v in knob_values(args).items())]
    cfg = load_config(config, overrides)
    prompt = read_text(args.file, "file") if args.file is not None else args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    if prompt is None:
        prompt = cfg.generate.prompt
    if not prompt:
        raise LeverError(f"{cfg.path}: no prompt: give -p PROMPT or [generate] prompt")

    started = []

    def on_text(text: str) -> None:
        if not started:  # the prompt once the generation runs: a run refused before it prints nothing
            started.append(sys.stdout.write(prompt))
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        res = run_pipeline(cfg, prompt, None if args.json else on_text, args.trace, constrain=constraint_args(args))
    except GrammarError as e:  # named by the flag and file it came in
        flag, path = constraint_file(args)
        raise LeverError(f"{flag} {path}: {e.why}") from None
    if args.json:
        print(json.dumps(res.as_json()))
    else:
        print()
        print_summary(res, file=sys.stderr)
    return 1 if lossless_broken(res) else 0


def lossless_broken(res) -> bool:
    """A greedy run whose tokens differ from its baseline's: the output is not the target's own,
    and the exit code says so (a script must not take it for a result)."""
    return res.baseline is not None and res.temperature == 0.0 and not res.baseline_tokens_equal


def print_summary(res, file) -> None:
    mib = 2**20
    p = lambda *a: print(*a, file=file)  # noqa: E731
    t, fl, mem, tr = res.timing, res.flash, res.memory, res.trees
    n = max(t.n_passes, 1)
    p(f"pipeline {res.pipeline}: {len(res.tokens)} tokens in {t.n_passes} passes, stop: {res.stop_reason}")
    p(f"  decode      {res.decode_tps:.2f} tok/s ({res.ms_per_token:.1f} ms/token, "
      f"{res.cpu_ms_per_token:.1f} ms of CPU), "
      f"{res.output.tokens_per_pass:.2f} tokens/pass from trees of {tr.mean_nodes:.1f} nodes")
    p(f"  prefill     {len(res.prompt_tokens)} tokens in 1 pass over flash, {t.prefill_s:.2f} s to the first token "
      f"({res.prefill_tps:.1f} tokens/s)")
    p(f"  flash       {res.flash_mb_per_token:.1f} MB/token from the device "
      f"({fl.streamed_bytes_per_pass / 1e6:.1f} MB streamed per pass), {fl.gbps:.2f} GB/s while reading")
    p(f"  overlap     {100 * t.overlap_share:.0f}% of read time hidden under compute; per pass: "
      f"read {t.io_s / n * 1e3:.1f} ms, compute {t.compute_s / n * 1e3:.1f} ms, "
      f"wall {t.pass_wall_ratio:.2f}x max(read, compute)")
    if t.draft_s:
        p(f"  cycle       verify pass {t.verify_pass_s / n * 1e3:.0f} ms, accept {t.accept_s / n * 1e3:.0f} ms, "
          f"draft {t.draft_s / n * 1e3:.0f} ms of which {100 * t.draft_hidden_share:.0f}% ran during verification; "
          f"{100 * tr.lookahead_hit_share:.0f}% of cycles started from rows drafted ahead"
          + (f" ({tr.ahead_nodes} drafted ahead, {100 * tr.ahead_used_share:.0f}% of them used)"
             if tr.ahead_nodes else ""))
        if tr.cycles:
            p(f"  model       cycle predicted {tr.predicted_cycle_s * 1e3:.0f} ms, "
              f"measured {tr.measured_cycle_s * 1e3:.0f} ms; "
              f"tokens/cycle predicted {tr.predicted_tokens:.2f}, measured {tr.measured_tokens:.2f}; "
              f"flash busy {100 * t.flash_busy_share:.0f}% of the run")
        if tr.fallback_switches:
            p(f"  fallback    {tr.fallback_switches} times a simpler shape would have been faster; cycles by shape: "
              + ", ".join(f"{k} {v}" for k, v in tr.shapes.items()))
        if res.draft is not None:
            p("  drafting    forwards by tokens in them: "
              + ", ".join(f"{k} x{c}" for k, c in sorted(res.draft.forward_tokens.items())))
    if getattr(res, "vocab", None) is not None:  # only for a mapped pair: the same table maps all of both, at no cost
        v = res.vocab
        p(f"  vocabulary  draft -> target: {v.draft_mapped:,} of {v.draft_tokens:,} draft tokens map "
          f"({share(v.draft_mapped, v.draft_tokens)}); {v.target_reachable:,} of {v.target_tokens:,} target tokens "
          f"reachable ({share(v.target_reachable, v.target_tokens)}); mapped in {v.build_ms:.0f} ms at load")
    if mem.plan is not None:
        p(f"  memory      peak RSS {mem.peak_rss_bytes / mib:.0f} MiB, planned before loading {mem.plan.describe()}; "
          f"bound with margin {mem.rss_bound_bytes / mib:.0f} MiB")
        if mem.fill is not None:
            p(f"  fill        --mem / [memory] limit placed {mem.fill.resident_layer_bytes / mib:.0f} MiB of target "
              f"layers in DRAM by a plan of {mem.fill.total_bytes / mib:.0f} MiB (prompts up to the "
              f"context); the rest stream")
        over = over_bound(mem)
        if over:
            p(f"  WARNING     {over}")
    p("  stages      " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(t.stage_s.items())))
    if res.placement:
        p("  placement   " + ", ".join(f"{k}: {v}" for k, v in res.placement.items()))
    if res.baseline is not None:
        b = res.baseline
        same = tokens_verdict(res.baseline_tokens_equal, res.temperature, "the baseline's")
        p(f"  vs {b.pipeline:<8} {res.speedup:.2f}x its speed: {b.ms_per_token:.1f} ms/token on the same prompt, "
          f"{b.flash_mb_per_token:.1f} MB/token from the device, {same}")


def share(part: int, whole: int) -> str:
    """part of whole as a percentage, cut (not rounded) to one decimal: 100% only when all."""
    return "100%" if part == whole else f"{int(1000 * part / whole) / 10 if whole else 0:.1f}%"


def tokens_verdict(equal: bool, temperature: float, other: str) -> str:
    """How a comparison of two runs' tokens reads: greedy, they must be equal (lossless token for
    token), so a difference is a bug; sampled, losslessness holds in distribution and the two runs
    draw differently, so a difference is what sampling allows, and equal tokens are a tie."""
    if temperature == 0.0:
        return "the same tokens" if equal else f"DIFFERENT tokens from {other}: a bug (greedy output must be equal)"
    return (f"sampled: the same tokens as {other}" if equal else
            f"sampled: tokens differ from {other}, as sampling allows (lossless in distribution)")


def over_bound(mem) -> str:
    """A warning when the run's peak RSS passed the memory plan's bound with its margin (the plan
    missed an allocation: a runtime's own arenas, say), else ''."""
    warning = getattr(mem.plan, "over_bound_warning", None)  # lever.policy.memory's own wording
    if warning is not None:
        return warning(mem.peak_rss_bytes) or ""
    if mem.rss_bound_bytes and mem.peak_rss_bytes > mem.rss_bound_bytes:
        mib = 2**20
        return (f"peak RSS {mem.peak_rss_bytes / mib:.0f} MiB passed the plan's bound with margin "
                f"({mem.rss_bound_bytes / mib:.0f} MiB) by {(mem.peak_rss_bytes - mem.rss_bound_bytes) / mib:.0f} MiB: "
                f"the plan does not count everything this run allocated")
    return ""
