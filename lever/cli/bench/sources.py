"""`lever bench sources -c CONFIG --prompts FILE`: who proposes the tree's tokens, side by side.

For each DRAM budget and prompt: Flash-AR, then Lever with children from the draft model only,
from the free sources only (prompt lookup and the n-gram cache, lever.policy.lookup: no draft
model loaded at all), and from both in the same tree. Per variant: tokens per pass, ms/token
and the ratio to Flash-AR's speed on the same prompt. Greedy, so every variant's tokens must be
Flash-AR's (the bench checks, and fails if not). Run it on prompts whose text repeats (code the
prompt contains and the answer edits, a document to summarize) and on plain completion.
`--variants` picks others: prompt lookup or the n-gram cache alone (no draft model either).

`--rounds R` runs the model and model+lookup variants R times per prompt, alternating their
order (llama-bench's `-r`): on a shared machine one run's ms/token moves by more than the
difference being compared (docs/measurements.md, 'Run-to-run spread of one run's ms/token'),
and those two are what the comparison is about; Flash-AR and lookup
alone run once. A prompt's figure is the median of its rounds. The two are also compared run by
run: each round's pair ran back to back, so their ratio sees the same machine, and the spread of
those ratios over prompts and rounds gives the comparison its noise band (`paired_speedup`): "no
slower" means a band that reaches 1, not a mean that happens to. How far runs moved, and the
bands: docs/measurements.md,
'Fresh held-out sets, compared run by run (session 14, 2026-12-03; Intel Xeon, 2 vCPUs, AVX-512)'.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from lever.cli.bench import rows as pipeline_rows
from lever.cli.bench.paired import paired_speedup
from lever.cli.bench.pipelines import BUDGET
from lever.cli.bench.report import read_prompts
from lever.cli.common import (
    MAX_PROMPT_BYTES,
    add_common,
    add_set,
    bench_tokens,
    check_sets,
    input_text_file,
    output_file,
    parse_list,
    rounds,
)
from lever.cli.models import add_models, bench_config, check_models
from lever.cli.table import show
from lever.errors import LeverError
from lever.outputs import write_json
from lever.pipelines.pairing import free_sets
from lever.shipped import shipped

VARIANTS = {  # name -> overrides of a speculative gain-cost config
    "model": ['tree_expand.sources=["model"]'],
    "lookup": list(free_sets()),  # the free sources, no draft model: what -m without -md runs
    "model+lookup": ['tree_expand.sources=["model", "prompt-lookup", "ngram"]'],
    "prompt-lookup": ['tree_expand.sources=["prompt-lookup"]', 'model.draft=""'],  # each free source alone
    "ngram": ['tree_expand.sources=["ngram"]', 'model.draft=""'],
}
DEFAULT_VARIANTS = ("model", "lookup", "model+lookup")
SPECULATIVE = [*pipeline_rows.LEVER, "generate.temperature=0.0"]


REPEATED = ("model", "model+lookup")  # the variants --rounds repeats


def _order(k: int, variants: tuple[str, ...]) -> list[str]:
    """The variants of round k: all of them first, then the repeated two, every other round
    the other way round (a run after another is not always as fast as the first)."""
    if k == 0:
        return list(variants)
    again = [v for v in REPEATED if v in variants]
    return again if k % 2 == 0 else again[::-1]


def _mixed(per: dict, variants: tuple[str, ...], b: float, n_prompts: int, result: dict, out) -> None:
    """The mixed tree against the model alone, run by run, and against each prompt's faster
    single source: into `result` and printed."""
    singles = [v for v in variants if v != "model+lookup"]
    if "model+lookup" not in variants or not singles:
        return
    if "model" in variants:
        model_ms = [x for m in per["model"] for x in m["rounds_ms_per_token"]]
        mixed_ms = [x for m in per["model+lookup"] for x in m["rounds_ms_per_token"]]
        sp, lo, hi = paired_speedup(model_ms, mixed_ms)
        result.setdefault("mixed_vs_model", {})[str(b)] = {"speedup": sp, "band": [lo, hi], "pairs": len(model_ms)}
        out(f"model+lookup against model, run by run: {sp:.3f}x its speed, band {lo:.3f}-{hi:.3f} "
            f"over {len(model_ms)} pairs ({'no slower within noise' if hi >= 1 else 'slower'})")
    best = [min(per[v][i]["ms_per_token"] for v in singles) for i in range(n_prompts)]
    mixed = [x["ms_per_token"] for x in per["model+lookup"]]
    ratio = statistics.fmean(b_ / m_ for b_, m_ in zip(best, mixed))
    result.setdefault("mixed_vs_best", {})[str(b)] = ratio
    out(f"model+lookup against the faster single source of each prompt: {ratio:.3f}x its speed "
        f"(no slower on {sum(m_ <= b_ for b_, m_ in zip(best, mixed))} of {len(mixed)} prompts)")


def bench_sources(config: str, prompts: list[str], n: int, budgets: tuple[float, ...], sets: list[str] = (),
                  out=print, json_path: str | None = None, rounds: int = 1,
                  variants: tuple[str, ...] = DEFAULT_VARIANTS) -> dict:
    from lever.config import load_config
    from lever.pipelines.engine import run_pipeline

    def run(extra: list[str], budget: float, prompt: str):
        cfg = load_config(config, [*sets, *extra, f"flash.dram_budget={budget}", f"generate.n_predict={n}",
                                   *pipeline_rows.NO_BASELINE])
        return run_pipeline(cfg, prompt)

    result: dict = {"config": config, "n_gen": n, "rounds": rounds, "budgets": {}}
    for b in budgets:
        per: dict[str, list[dict]] = {"flash-ar": []} | {k: [] for k in variants}
        for i, prompt in enumerate(prompts):
            base = run([*pipeline_rows.FLASH_AR, "generate.temperature=0.0"], b, prompt)
            per["flash-ar"].append({"ms_per_token": base.ms_per_token, "tokens_per_pass": 1.0})
            runs: dict[str, list] = {k: [] for k in variants}
            for k in range(rounds):
                for name in _order(k, variants):
                    r = run([*SPECULATIVE, *VARIANTS[name]], b, prompt)
                    if r.tokens != base.tokens:
                        raise LeverError(f"bench sources: prompt {i}, {name} at {b:g}: tokens differ from Flash-AR's "
                                         "(greedy output must not)")
                    runs[name].append(r)
            for name, rs in runs.items():
                ms = statistics.median(r.ms_per_token for r in rs)
                per[name].append({"ms_per_token": ms, "speedup": base.ms_per_token / ms,
                                  "tokens_per_pass": statistics.median(r.output.tokens_per_pass for r in rs),
                                  "nodes": statistics.median(r.trees.mean_nodes for r in rs),
                                  "rounds_ms_per_token": [r.ms_per_token for r in rs]})
        result["budgets"][str(b)] = per
        rows = []
        for name, figs in per.items():
            ms = statistics.fmean(x["ms_per_token"] for x in figs)
            tpp = statistics.fmean(x["tokens_per_pass"] for x in figs)
            sp = statistics.fmean(x.get("speedup", 1.0) for x in figs)
            rows.append([name, f"{tpp:.2f}", f"{ms:.1f}", f"{1e3 / ms:.2f}", f"{sp:.2f}x"])
        rounds_note = f", model and model+lookup medians of {rounds} rounds" if rounds > 1 else ""
        show(["source", "tokens/pass", "ms/token", "tok/s", "x Flash-AR"], rows, out,
             title=f"{len(prompts)} prompts x {n} tokens, DRAM budget {100 * b:.0f}% ({config}){rounds_note}; "
                   "tokens equal Flash-AR's")
        _mixed(per, variants, b, len(prompts), result, out)
    if json_path:
        write_json(json_path, result)
    return result


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("sources", help="children from the draft model, prompt lookup and n-grams, side by side")
    add_models(b, default="none: give -c or -m")
    b.add_argument("--prompts", type=Path, default=None,
                   help="prompts separated by lines holding only --- (default: examples/prompts/repeat.txt)")
    b.add_argument("--n-gen", type=bench_tokens, default=48, help="tokens generated per prompt")
    b.add_argument("--budgets", default="0,0.25", help="DRAM budgets, fractions of the layer bytes")
    b.add_argument("--rounds", type=rounds, default=1,
                   help="runs of model and model+lookup per prompt, alternating (the median is kept)")
    b.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"who proposes, comma-separated, of {', '.join(VARIANTS)} (default: the first three)")
    b.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    add_set(b)
    add_common(b)
    b.set_defaults(func=main, check=check_args)
    return b


def parse_variants(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in names if x not in VARIANTS]
    if not names or unknown or len(set(names)) != len(names):
        raise LeverError(f"--variants: {text[:80]!r} must be distinct names of {', '.join(VARIANTS)}")
    return names


def check_args(args) -> tuple[tuple[float, ...], tuple[str, ...]]:
    budgets = parse_list(args.budgets, "--budgets", BUDGET, max_items=21)
    variants = parse_variants(args.variants)
    check_models(args)
    bench_config(args)  # -c or -m
    if args.prompts is not None:
        input_text_file(args.prompts, "--prompts", "prompts file", MAX_PROMPT_BYTES)
    output_file(args.json, "--json")
    check_sets(args)
    return budgets, variants


def main(args) -> int:
    budgets, variants = check_args(args)
    prompts = read_prompts(args.prompts or shipped("prompts", "repeat.txt"))
    config, sets = bench_config(args, say=print)
    bench_sources(config, prompts, args.n_gen, budgets, sets, json_path=args.json, rounds=args.rounds,
                  variants=variants)
    return 0
