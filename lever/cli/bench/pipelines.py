"""`lever bench pipelines`: the paper's comparison, measured side by side in one run.

For each DRAM budget, every pipeline (Flash-AR, Chain-SD at several chain lengths, EdgeLLM-like,
Lever) generates from the same prompts with the same model pair, each run in its own process
(`lever run --json`) so that memory and page cache are its own. It prints a table per budget
(ms/token, tokens/s, tokens per pass, tree size, flash MB per token, speedup over Flash-AR of
that budget), checks that every greedy pipeline produced Flash-AR's tokens exactly, and ends
with Lever's speed over each baseline at each budget. `--json` keeps every figure; `--plot` draws
speedup against budget (matplotlib).

`--rounds R` runs every pipeline R times per prompt, the pipelines alternating (one order, then
the reverse: a run after another is not always as fast as the first). Each ratio of Lever's
speed to a baseline's is then the geometric mean over prompts x rounds of the run-by-run ratios,
with a band of about 95% (lever.cli.bench.paired): a gain is a band above 1, not a mean that
happens to be. Every pipeline's trees are also scored by the run's acceptance table: predicted
against measured tokens per pass says whether the gain the tree policy sees is the real one.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import platform
from collections.abc import Sequence
from pathlib import Path

import attrs
from rich.progress import Progress

from lever.cli.bench.child import run_json
from lever.cli.bench.llama_cpp import find_pair, llama_completion, llama_speculative
from lever.cli.bench.paired import paired_speedup
from lever.cli.bench.report import figure, read_prompts
from lever.cli.bench.rows import pipelines
from lever.cli.common import (
    MAX_PROMPT_BYTES,
    add_common,
    add_constraint,
    add_set,
    bench_tokens,
    check_sets,
    constraint_file,
    input_text_file,
    output_file,
    parse_list,
    rounds,
)
from lever.cli.models import add_models, bench_config, check_models
from lever.cli.table import show
from lever.config import load_config
from lever.errors import LeverError
from lever.model.sampling import Range
from lever.outputs import write_json
from lever.shipped import shipped

DEFAULT_BUDGETS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_CHAIN_KS = (2, 4, 6, 8)
PAPER = {"flash-ar": 2.93, "chain-sd": 1.50, "edgellm-like": 1.27}  # Lever's speedups in the paper


@attrs.frozen
class Row:
    """One pipeline at one budget, over all prompts."""

    ms_per_token: float
    accepted_per_pass: float
    tree_nodes: float
    flash_mb_per_token: float
    draft_hidden_share: float
    lookahead_hit_share: float
    layer_tokens_per_pass: tuple[float, ...] = ()  # nodes computed at each target layer per decoding pass
    prune_layer: int = -1  # the predictor's layer, for pipelines that prune
    cpu_ms_per_token: float = 0.0  # process CPU time per generated token, every thread (an energy proxy)
    flash_busy_share: float = 0.0  # share of the run with a flash read under way
    predicted_cycle_ms: float = 0.0  # the cost model's cycle (drafting in turns, pass, Accept), mean over cycles
    measured_cycle_ms: float = 0.0
    predicted_tokens_per_cycle: float = 0.0  # the tree's expected tokens by the run's acceptance table, mean
    measured_tokens_per_cycle: float = 0.0  # tokens the same cycles emitted, mean
    runs_ms_per_token: tuple[float, ...] = ()  # each run's, in (round, prompt) order: the pairs of the bands

    def late_token_layers(self, m: int) -> float:
        """Verification compute after layer m: token-layers per pass."""
        return float(sum(self.layer_tokens_per_pass[m + 1 :]))

    @property
    def tps(self) -> float:
        return 1000.0 / self.ms_per_token if self.ms_per_token else 0.0


def aggregate(runs: list[dict]) -> Row:
    """One pipeline's runs (`lever run --json`, one per prompt) as one row."""
    n_tok = sum(len(r["tokens"]) - 1 for r in runs)
    mean = lambda part, key: sum(r[part][key] for r in runs) / len(runs)  # noqa: E731
    n_pass = sum(max(r["timing"]["n_passes"] - 1, 1) for r in runs)
    layers = [sum(col) / n_pass for col in zip(*(r["tree"]["layer_tokens"] for r in runs))]
    cycles = [c for r in runs for c in r["tree"]["cycles"]]
    cycle_ms = lambda key: 1000 * sum(c[key] for c in cycles) / len(cycles) if cycles else 0.0  # noqa: E731
    per_cycle = lambda key: sum(c[key] for c in cycles) / len(cycles) if cycles else 0.0  # noqa: E731
    return Row(ms_per_token=1000 * sum(r["timing"]["decode_s"] for r in runs) / max(n_tok, 1),
               accepted_per_pass=mean("tree", "accepted_per_pass"), tree_nodes=mean("tree", "mean_nodes"),
               flash_mb_per_token=sum(r["flash"]["read_bytes"] for r in runs) / max(n_tok, 1) / 1e6,
               draft_hidden_share=mean("timing", "draft_hidden_share"),
               lookahead_hit_share=mean("tree", "lookahead_hit_share"), layer_tokens_per_pass=tuple(layers),
               prune_layer=runs[0]["tree"]["prune_layer"],
               cpu_ms_per_token=1000 * sum(r["timing"]["decode_cpu_s"] for r in runs) / max(n_tok, 1),
               flash_busy_share=mean("timing", "flash_busy_share"), predicted_cycle_ms=cycle_ms("predicted_s"),
               measured_cycle_ms=cycle_ms("measured_s"), predicted_tokens_per_cycle=per_cycle("predicted_tokens"),
               measured_tokens_per_cycle=per_cycle("tokens"), runs_ms_per_token=tuple(ms_per_token(r) for r in runs))


def ms_per_token(run: dict) -> float:
    return 1000 * run["timing"]["decode_s"] / max(len(run["tokens"]) - 1, 1)


def llama_cpp_rows(directory: str, config: str, sets, prompts: list[str], n: int,
                   extra: list[str] | tuple = ()) -> dict[str, float]:
    """llama.cpp's ms/token on the same pair and prompts, everything in DRAM (its mmap, page
    cache warm): llama-completion (the target alone) and llama-speculative (draft chains of
    LLAMA_SPEC_DRAFT tokens), under the same grammar when `extra` gives one (llama_cpp_flags).
    Per prompt, decode time only, summed as the rows above."""
    cfg = load_config(config, list(sets))
    tools = dict(zip(("llama-completion", "llama-speculative"), find_pair(directory)))
    ms = lambda tps: 1000 * sum(1 / t for t in tps) / len(tps)  # noqa: E731  equal tokens per prompt
    rows = {"llama.cpp completion": ms([llama_completion(tools["llama-completion"], cfg.model.target, p, n, 0, extra)
                                        for p in prompts])}
    if cfg.model.draft:
        rows[f"llama.cpp speculative k={LLAMA_SPEC_DRAFT}"] = ms(
            [llama_speculative(tools["llama-speculative"], cfg.model.target, cfg.model.draft, p, n, LLAMA_SPEC_DRAFT,
                               extra) for p in prompts])
    return rows


LLAMA_SPEC_DRAFT = 8  # llama-speculative's draft length: Chain-SD's best k on this pair at high budgets


def best_chain(rows: dict[str, Row]) -> str:
    return min((k for k in rows if k.startswith("chain")), key=lambda k: rows[k].ms_per_token)


def bench_pipelines(config: str, prompts: list[str], *, n: int, budgets=DEFAULT_BUDGETS, chain_ks=DEFAULT_CHAIN_KS,
                    sets: list[str] = (), json_path=None, plot_path=None, out=print, progress: bool = True,
                    pruning: bool = False, llama_cpp: str | None = None, n_rounds: int = 1,
                    run_args: Sequence[str] = (), llama_cpp_args: Sequence[str] = ()) -> dict:
    """`run_args`: more flags of every `lever run` (a grammar's); `llama_cpp_args`: the same
    constraint in llama.cpp's flags (llama_cpp_flags)."""
    runs = pipelines(chain_ks, pruning)
    table: dict[float, dict[str, Row]] = {}
    raw: list[dict] = []
    mismatches: list[str] = []
    sampled = False  # any run at temperature > 0: its tokens may differ from Flash-AR's, as sampling allows
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task("bench pipelines", total=len(budgets) * len(runs) * len(prompts) * n_rounds)
        for b in budgets:
            by: dict[str, list[dict]] = {name: [] for name in runs}  # in (round, prompt) order
            for k in range(n_rounds):
                for i, prompt in enumerate(prompts):
                    for name in (list(runs) if k % 2 == 0 else list(runs)[::-1]):
                        bar.update(task, description=f"budget {b:.0%}, round {k + 1}/{n_rounds}: {name}, "
                                                     f"prompt {i + 1}/{len(prompts)}")
                        r = run_json(config, [*sets, f"flash.dram_budget={b!r}", *runs[name]], prompt, n, run_args)
                        by[name].append(r)
                        raw.append(r | {"budget": b, "pipeline": name, "prompt": i, "round": k})
                        bar.advance(task)
            reference = [r["tokens"] for r in by["flash-ar"]]
            for name, rs in by.items():
                if name != "flash-ar" and _greedy(rs) and [r["tokens"] for r in rs] != reference:
                    mismatches.append(f"{name} at budget {b:.0%}")
                sampled |= not _greedy(rs)
            table[b] = {name: aggregate(rs) for name, rs in by.items()}
            _print_budget(b, table[b], out)
    llama = {}
    if llama_cpp and 1.0 in table:  # llama.cpp holds the whole model in DRAM: beside the 100% budget
        llama = llama_cpp_rows(llama_cpp, config, sets, prompts, n, list(llama_cpp_args))
        lever = table[1.0]["lever"].ms_per_token
        out("")
        show(("pipeline", "ms/token", "tok/s", "Lever, x its speed"),
             [(k, f"{v:.1f}", f"{1000 / v:.2f}", f"{v / lever:.2f}x") for k, v in
              {**{k: r.ms_per_token for k, r in table[1.0].items()}, **llama}.items()],
             out, title="DRAM budget 100%, beside llama.cpp (same pair, prompts and token count)")
    summary = _summary(table)
    _print_summary(summary, mismatches, out, sampled, n_pairs=len(prompts) * n_rounds)
    result = {"config": config, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": platform.platform(), "n_gen": n, "rounds": n_rounds, "prompts": prompts, "sets": list(sets),
              "budgets": {str(b): {k: attrs.asdict(v) | {"tps": v.tps,
                                                          "speedup": rows["flash-ar"].ms_per_token / v.ms_per_token}
                                   for k, v in rows.items()} for b, rows in table.items()},
              "summary": summary, "lossless_mismatches": mismatches, "sampled": sampled, "constraint": list(run_args),
              "llama_cpp_ms_per_token": llama, "runs": raw}
    if json_path:
        write_json(json_path, result)
        out(f"wrote {json_path}")
    if plot_path:
        plot(table, plot_path)
        out(f"wrote {plot_path}")
    return result


def _greedy(rs: list[dict]) -> bool:
    return all(r.get("temperature", 0.0) == 0.0 for r in rs)


def _print_budget(b: float, rows: dict[str, Row], out) -> None:
    ar = rows["flash-ar"].ms_per_token
    out("")
    show(("pipeline", "ms/token", "tok/s", "tok/pass", "nodes", "MB/tok", "CPU ms/tok", "x Flash-AR"),
         [(name, f"{r.ms_per_token:.1f}", f"{r.tps:.2f}", f"{r.accepted_per_pass:.2f}", f"{r.tree_nodes:.1f}",
           f"{r.flash_mb_per_token:.1f}", f"{r.cpu_ms_per_token:.1f}", f"{ar / r.ms_per_token:.2f}x")
          for name, r in rows.items()],
         out, title=f"DRAM budget {b:.0%} (MB/tok: read from flash; CPU ms/tok: every thread, an energy proxy)")
    ratio = lambda a, b: f"{a / b:.2f}" if b else ""  # noqa: E731
    show(("pipeline", "flash busy", "cycle ms predicted", "measured", "ratio", "tokens/cycle predicted", "measured",
          "ratio"),
         [(name, f"{100 * r.flash_busy_share:.0f}%", f"{r.predicted_cycle_ms:.0f}" if r.measured_cycle_ms else "",
           f"{r.measured_cycle_ms:.0f}" if r.measured_cycle_ms else "",

           ratio(r.predicted_cycle_ms, r.measured_cycle_ms),
           f"{r.predicted_tokens_per_cycle:.2f}" if r.measured_tokens_per_cycle else "",
           f"{r.measured_tokens_per_cycle:.2f}" if r.measured_tokens_per_cycle else "",
           ratio(r.predicted_tokens_per_cycle, r.measured_tokens_per_cycle))
          for name, r in rows.items()], out,
         title="where the time went (flash busy: share of the run reading; tokens/cycle predicted: the tree scored "
               "by the run's acceptance table)")
    if "lever+pruning" in rows:
        p, lv = rows["lever+pruning"], rows["lever"]
        m = p.prune_layer
        cut = 1 - p.late_token_layers(m) / max(lv.late_token_layers(m), 1e-9)
        out(f"pruning after layer {m}: token-layers per pass after it {lv.late_token_layers(m):.0f} -> "
            f"{p.late_token_layers(m):.0f} ({100 * cut:.0f}% cut), tokens/pass {lv.accepted_per_pass:.2f} -> "
            f"{p.accepted_per_pass:.2f} ({100 * (p.accepted_per_pass / lv.accepted_per_pass - 1):+.1f}%), "
            f"tokens/s {lv.tps:.2f} -> {p.tps:.2f} ({lv.ms_per_token / p.ms_per_token:.2f}x)")


BASELINES = ("flash-ar", "chain-sd", "edgellm-like")


def _summary(table: dict[float, dict[str, Row]]) -> dict:
    """Lever's speed over each baseline at each budget (Chain-SD: its best k there), the
    geometric mean of the run-by-run ratios with its band, and over the best of them; the mean
    over the budgets that stream."""
    per = {}
    for b, rows in table.items():
        lever = rows["lever"].runs_ms_per_token
        chain = best_chain(rows)
        names = {"flash-ar": "flash-ar", "chain-sd": chain, "edgellm-like": "edgellm-like"}
        entry: dict = {"best_chain": chain}
        for key, name in names.items():
            sp, lo, hi = paired_speedup(list(rows[name].runs_ms_per_token), list(lever))
            entry[key], entry[f"{key}_band"] = sp, [lo, hi]
        fastest = [min(xs) for xs in zip(*(rows[name].runs_ms_per_token for name in names.values()))]
        sp, lo, hi = paired_speedup(fastest, list(lever))
        entry["best"], entry["best_band"] = sp, [lo, hi]  # against the fastest baseline of each run
        per[str(b)] = entry
    # the mean over the budgets that stream (the paper's setting); 100% is reported on its own
    flash = [v for b, v in per.items() if float(b) < 1.0] or list(per.values())
    mean = {k: sum(v[k] for v in flash) / len(flash) for k in PAPER}
    return {"per_budget": per, "mean": mean}


def _print_summary(summary: dict, mismatches: list[str], out, sampled: bool = False, n_pairs: int = 1) -> None:
    def x(v: dict, key: str) -> str:
        lo, hi = v[f"{key}_band"]
        return f"{v[key]:.2f}x" + (f" ({lo:.2f}-{hi:.2f})" if n_pairs > 1 else "")

    rows = [(f"{float(b):.0%}", x(v, "flash-ar"), x(v, "chain-sd"), x(v, "edgellm-like"), x(v, "best"),
             v["best_chain"]) for b, v in summary["per_budget"].items()]
    m = summary["mean"]
    rows += [("mean <100%", f"{m['flash-ar']:.2f}x", f"{m['chain-sd']:.2f}x", f"{m['edgellm-like']:.2f}x", "", ""),
             ("paper", *(f"{PAPER[k]:.2f}x" for k in BASELINES), "", "")]
    out("")
    band = f"; in brackets the band of about 95% over {n_pairs} prompt x round pairs" if n_pairs > 1 else ""
    show(("budget", "vs Flash-AR", "vs Chain-SD", "vs EdgeLLM-like", "vs the fastest of each run", "best chain"),
         rows, out, title="Lever's speed, x each baseline's: above 1x faster, below slower (Chain-SD: its best k at "
                          f"each budget; geometric means of run-by-run ratios{band})")
    if mismatches:
        out("LOSSLESS CHECK FAILED: greedy tokens differ from Flash-AR's for " + ", ".join(mismatches))
    elif sampled:  # lossless in distribution: each pipeline draws its own tokens, none is compared
        out("sampled (temperature > 0): tokens may differ from Flash-AR's, as sampling allows; "
            "greedy runs, if any, equal Flash-AR's")
    else:
        out("lossless: every pipeline's tokens equal Flash-AR's, for every prompt, round and budget")


def plot(table: dict[float, dict[str, Row]], path) -> None:
    budgets = sorted(table)
    with figure(path) as (fig, ax):
        for name in ["flash-ar", "chain-sd (best k)", "edgellm-like", "lever"]:
            ys = []
            for b in budgets:
                rows = table[b]
                key = best_chain(rows) if name.startswith("chain") else name
                ys.append(rows["flash-ar"].ms_per_token / rows[key].ms_per_token)
            ax.plot([100 * b for b in budgets], ys, marker="o", label=name)
        ax.set_xlabel("DRAM budget (% of the target's layer bytes resident)")
        ax.set_ylabel("speed, x Flash-AR's")
        ax.legend()


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("pipelines", help="Flash-AR, Chain-SD, EdgeLLM-like and Lever side by side")
    add_models(b, default="none: give -c or -m")
    b.add_argument("--prompts", type=Path, default=None,
                   help="a file of prompts separated by lines holding only --- (default: the shipped code prompts)")
    b.add_argument("--n-gen", type=bench_tokens, default=32, help="tokens generated per prompt")
    b.add_argument("--rounds", type=rounds, default=1,
                   help="runs of every pipeline per prompt, alternating: ratios get a noise band")
    b.add_argument("--budgets", default="0,0.25,0.5,0.75,1",
                   help="DRAM budgets, fractions of the layer bytes (1: all resident)")
    b.add_argument("--chain-ks", default="2,4,6,8", help="Chain-SD lengths swept (the best is reported)")
    b.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    b.add_argument("--plot", type=Path, default=None, help="draw speedup against budget (matplotlib)")
    b.add_argument("--pruning", action="store_true",
                   help="also Lever with its pruning predictor (run `lever calibrate` first)")
    add_constraint(b, "every pipeline's text")
    b.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help="llama.cpp's bin directory: adds llama-completion and llama-speculative rows at budget 1.0")
    add_set(b)
    add_common(b)
    b.set_defaults(func=main, check=check_args)
    return b


BUDGET = Range(0.0, 1.0)  # a fraction of the layer bytes (1: all resident)


def check_args(args) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """The lists, files and destinations, before the first run; returns (budgets, chain lengths)."""
    from lever.tree.config import MAX_TREE_SIZE

    budgets = parse_list(args.budgets, "--budgets", BUDGET, max_items=21)
    chain_ks = parse_list(args.chain_ks, "--chain-ks", Range(1, MAX_TREE_SIZE, integer=True), max_items=16)
    check_models(args)
    bench_config(args)  # -c or -m
    if args.prompts is not None:
        input_text_file(args.prompts, "--prompts", "prompts file", MAX_PROMPT_BYTES)
    output_file(args.json, "--json")
    output_file(args.plot, "--plot")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise LeverError("--plot needs matplotlib (pip install matplotlib)")
    check_sets(args)
    if args.llama_cpp:
        llama_cpp_flags(args)
    return budgets, chain_ks


def constraint_flags(args) -> list[str]:
    """--json-schema FILE / --grammar FILE, passed on to every `lever run`."""
    given = constraint_file(args)
    return [given[0], str(given[1].resolve())] if given else []


def llama_cpp_flags(args) -> list[str]:
    """The same constraint in llama.cpp's flags: a JSON schema as `-jf` (llama.cpp turns it into
    its own grammar), a GBNF grammar as `--grammar-file`; a Lark grammar it cannot read."""
    given = constraint_file(args)
    if given is None:
        return []
    flag, path = given
    if flag == "--json-schema":
        return ["-jf", str(path.resolve())]
    if "::=" not in path.read_text(encoding="utf-8", errors="replace"):
        raise LeverError(f"--llama-cpp: llama.cpp reads GBNF grammars; {path} is Lark (give its GBNF, or leave out "
                         f"--llama-cpp)")
    return ["--grammar-file", str(path.resolve())]


def main(args) -> int:
    budgets, chain_ks = check_args(args)
    prompts = read_prompts(args.prompts or shipped("prompts", "code.txt"))
    config, sets = bench_config(args, say=print)
    bench_pipelines(config, prompts, n=args.n_gen, budgets=budgets, chain_ks=chain_ks, sets=sets,
                    json_path=args.json, plot_path=args.plot, pruning=args.pruning, llama_cpp=args.llama_cpp,
                    n_rounds=args.rounds, run_args=constraint_flags(args),
                    llama_cpp_args=llama_cpp_flags(args) if args.llama_cpp else [])
    return 0
