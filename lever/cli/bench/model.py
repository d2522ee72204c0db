"""Benchmarks that print ratios measured side by side in one run (never timed unit tests).

`lever bench model` times the model core the way llama-bench does: `tg` (decode tokens/s at
batch 1, from an almost empty context) and `pp` (tokens/s of one N-token forward with the
output projection on the last row; 1, 8 and 32 tokens: a decode step, a draft or a small
tree, a large tree or a prompt). When a llama-bench binary is given (or on PATH), the same file
is measured with it in alternating rounds, so both see the same machine load; the medians and
the median of the rounds' ratios are printed and, with --json, written with the CPU and the
kernels' ISA.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from lever.backends.cpu import native
from lever.backends.cpu.kv_cache import causal_mask
from lever.cli.bench.llama_cpp import find_llama_bench, find_tool, llama_bench, llama_completion
from lever.cli.common import (
    add_common,
    add_set,
    bench_tokens,
    check_sets,
    cpu_model,
    input_text_file,
    output_file,
    rounds,
)
from lever.cli.table import show
from lever.config import load_config
from lever.errors import LeverError
from lever.gguf.tokenizer import Tokenizer
from lever.model.generate import generate
from lever.model.transformer import Model
from lever.outputs import write_json
from lever.pipelines.engine import run_pipeline

PP_TOKENS = (1, 8, 32)


def lever_tg(model: Model, n_gen: int) -> float:
    """Decode tokens/s: n_gen single-token passes, each with its lm_head row."""
    cache = model.new_cache(n_gen + 1)
    tok = 1
    t0 = time.perf_counter()
    for i in range(n_gen):
        h = model.forward(np.array([tok]), np.array([i], np.int32), causal_mask(i, 1), cache)
        tok = int(np.argmax(model.logits(h)[0]))
    return n_gen / (time.perf_counter() - t0)


def lever_pp(model: Model, n_prompt: int) -> float:
    """Tokens/s of one n_prompt-token forward, lm_head on the last row only."""
    cache = model.new_cache(n_prompt)
    ids = np.arange(1, n_prompt + 1) % model.spec.n_vocab
    t0 = time.perf_counter()
    h = model.forward(ids, np.arange(n_prompt, dtype=np.int32), causal_mask(0, n_prompt), cache)
    model.logits(h[-1:])
    return n_prompt / (time.perf_counter() - t0)


def bench_model(model_path: str, n_gen: int = 32, pp: tuple[int, ...] = PP_TOKENS, rounds: int = 3,
                llama_bench_path: str | None = None, threads: int = 0, out=print) -> dict:
    """One model's tests, each the median of `rounds`, beside llama-bench's when it is found."""
    model = Model(model_path)
    lb = find_llama_bench(llama_bench_path)
    lever_tg(model, 4)  # warm the kernels' threads and the allocator
    tests = [f"tg{n_gen}"] + [f"pp{n}" for n in pp]
    samples: dict[str, list[float]] = {f"{who}_{t}": [] for who in ("lever", "llama") for t in tests}
    for r in range(rounds):
        samples[f"lever_tg{n_gen}"].append(lever_tg(model, n_gen))
        for n in pp:
            samples[f"lever_pp{n}"].append(lever_pp(model, n))
        if lb:
            for t, v in llama_bench(lb, model_path, pp, n_gen, threads).items():
                samples[f"llama_{t}"].append(v)
        out(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items() if v))
    med = {k: statistics.median(v) for k, v in samples.items() if v}
    rows, lines = {}, []
    for t in tests:
        ours, ref = med[f"lever_{t}"], med.get(f"llama_{t}")
        # The ratio is the median of each round's ratio: a round measures both within seconds,
        # while this shared machine's memory bandwidth moves between rounds (docs/measurements.md,
        # 'Kernels against llama.cpp').
        ratio = statistics.median(a / b for a, b in zip(samples[f"lever_{t}"], samples[f"llama_{t}"])) if ref else None
        rows[t] = {"lever_tps": ours, "llama_tps": ref, "ratio": ratio}
        lines.append((t, f"{ours:.1f}", f"{ref:.1f}" if ref else "n/a", f"{ratio:.2f}x" if ref else "-"))
    out("")
    show(("test", "lever tok/s", "llama.cpp tok/s", "ratio"), lines, out, title=f"model: {model_path}")
    if not lb:
        out("(no llama-bench found: pass --llama-bench PATH or set LLAMA_BENCH for the side-by-side ratio)")
    return {"model": model_path, "tests": rows, "samples": samples}


def bench_dram(config: str, sets: list[str], prompt: str, n: int, rounds: int = 3, llama_completion_path=None,
               threads: int = 0, out=print) -> dict:
    """Decoding a prompt with everything in DRAM, in alternating rounds: llama.cpp's
    llama-completion (when found), `lever generate` (the target alone) and the config's pipeline
    with flash.dram_budget=1.0 (Lever's speculative decoding), which must give generate's tokens."""

    # greedy whatever the config says: generate's tokens are greedy, and only greedy tokens must be equal
    cfg = load_config(config, [*sets, f"generate.n_predict={n}", 'pipeline.baseline=""', "flash.dram_budget=1.0",
                               "generate.temperature=0.0"])
    target = cfg.model.target
    model = Model(target)
    tok = Tokenizer.from_gguf(model.file)
    ids = tok.encode(prompt)
    samples: dict[str, list[float]] = {"llama": [], "generate": [], "pipeline": []}
    same = True
    for r in range(rounds):
        if llama_completion_path:
            samples["llama"].append(llama_completion(llama_completion_path, target, prompt, n, threads))
        g = generate(model, ids, n, n_ctx=min(cfg.model.n_ctx, model.spec.n_ctx_train), eos_ids=frozenset(tok.eos_ids))
        samples["generate"].append(g.decode_tps)
        res = run_pipeline(cfg, prompt)
        samples["pipeline"].append(res.decode_tps)
        same &= list(res.tokens) == list(g.tokens)
        out(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items() if v))
    med = {k: statistics.median(v) for k, v in samples.items() if v}
    ratio = {k: statistics.median(a / b for a, b in zip(samples[k], samples["llama"])) if samples["llama"] else None
             for k in ("generate", "pipeline")}
    out(f"\ndecoding {len(g.tokens)} tokens of {prompt!r} with everything in DRAM ({target})")
    lines = []
    if "llama" in med:
        lines.append(("llama.cpp llama-completion", f"{med['llama']:.1f}", "1.00x"))
    for k, label in (("generate", "lever generate (target alone)"), ("pipeline", f"lever run ({res.pipeline})")):
        lines.append((label, f"{med[k]:.1f}", f"{ratio[k]:.2f}x" if ratio[k] else "-"))
    show(("", "tok/s", "vs llama.cpp"), lines, out)
    out(f"lever run's tokens {'equal' if same else 'DIFFER FROM'} lever generate's in every round; "
        f"{res.output.tokens_per_pass:.2f} tokens/pass from trees of {res.trees.mean_nodes:.1f} nodes")
    if not same:
        raise LeverError("lever run's tokens differ from lever generate's: speculative decoding is not lossless here")
    return {"prompt": prompt, "n": n, "tokens_equal": same, "tps": med, "ratio": ratio, "samples": samples,
            "pipeline": res.pipeline, "tokens_per_pass": res.output.tokens_per_pass}


def bench_models(paths: list[str], n_gen: int = 32, pp: tuple[int, ...] = PP_TOKENS, rounds: int = 3,
                 llama_bench_path: str | None = None, threads: int = 0, json_path=None, out=print,
                 dram: dict | None = None) -> dict:
    """bench_model for each file (a config's target and draft), one after the other; then, with
    `dram` (bench_dram's config, sets, prompt, n and llama_completion_path), the config's
    decoding with everything in DRAM; with json_path, every figure and where they were measured."""
    report = {"cpu": cpu_model(), "cores": os.cpu_count(), "isa": native.isa(), "threads": threads or os.cpu_count(),
              "date": time.strftime("%Y-%m-%d"), "models": []}
    out(f"cpu: {report['cpu']}, {report['cores']} cores, kernels {report['isa']}, {report['threads']} threads")
    for i, path in enumerate(paths):
        if i:
            out("")
        report["models"].append(bench_model(path, n_gen, pp, rounds, llama_bench_path, threads, out))
    if dram is not None:
        out("")
        report["dram"] = bench_dram(rounds=rounds, threads=threads, out=out, **dram)
    if json_path:
        write_json(json_path, report)
        out(f"\nwrote {json_path}")
    return report


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("model", help="tg/pp tokens/s of a model (-m) or a config's two (-c) in DRAM, vs llama-bench")
    b.add_argument("-m", "--model", type=Path)
    b.add_argument("-c", "--config", type=Path)
    b.add_argument("-p", "--prompt", default="def quicksort(arr):", help="-c: the prompt decoded in DRAM")
    b.add_argument("--n-gen", type=bench_tokens, default=32, help="tokens of the tg test")
    b.add_argument("--rounds", type=rounds, default=3, help="alternating rounds (the medians are kept)")
    b.add_argument("--llama-bench", default=None, help="llama-bench binary to compare with (or $LLAMA_BENCH)")
    b.add_argument("--llama-completion", default=None,
                   help="-c: llama-completion to compare decoding with (or $LLAMA_COMPLETION; "
                        "default: beside llama-bench)")
    b.add_argument("--n-decode", type=bench_tokens, default=64,
                   help="-c: tokens decoded from --prompt, everything in DRAM")
    b.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    add_set(b)
    add_common(b)
    b.set_defaults(func=main, check=check_args)
    return b



def check_args(args) -> None:
    if bool(args.model) == bool(args.config):
        raise LeverError("lever bench model: give -m MODEL.gguf or -c CONFIG (its target and draft)")
    if args.config is not None:
        input_text_file(args.config, "-c", "config file")
    output_file(args.json, "--json")
    check_sets(args)


def main(args) -> int:
    check_args(args)
    if args.model:
        paths = [str(args.model)]
    else:

        cfg = load_config(args.config, args.set)
        paths = [p for p in (cfg.model.target, cfg.model.draft) if p]

    lb = find_llama_bench(args.llama_bench)
    dram = None
    if args.config:  # then the config's decoding in DRAM, beside llama-completion
        lc = find_tool("llama-completion", args.llama_completion, "LLAMA_COMPLETION", lb)
        dram = dict(config=str(args.config), sets=args.set, prompt=args.prompt, n=args.n_decode,
                    llama_completion_path=lc)
    bench_models(paths, args.n_gen, rounds=args.rounds, llama_bench_path=lb, threads=args.threads,
                 json_path=args.json, dram=dram)
    return 0
