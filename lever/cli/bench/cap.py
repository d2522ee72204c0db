"""`lever bench cap`: Lever beside llama.cpp under the same memory cap, the page cache counted.

What a user with a model larger than DRAM runs today is llama.cpp: its mmap lets the page cache
evict and re-read the model every token, or its speculative decoding on top of that. This bench
runs, on the same prompts and at each cap, Lever (`--mem CAP`: its plan places everything inside
the cap before loading), Lever's Flash-AR (the target alone, streamed, same plan), Lever with
no layer pinned and the page cache as an LRU block cache over the layers (`lever-lru`),
llama-completion and llama-speculative (draft lengths swept), each in its own process in a
memory cgroup of that size, the model files evicted from the page cache before each
(lever.cli.bench.cgroup). Per run: decode tokens/s, tokens per target pass, MB read from
storage per generated token (the kernel's count, the same for every process), the cgroup's peak
against the cap, Lever's plan. Tokens are checked against Flash-AR's, the target's own greedy
decoding: Lever's must be equal; llama.cpp's text may part from them where two logits nearly tie
(other kernels, other sums), so its common prefix is reported, in the reference's tokens.

Where it sits: a command over `lever run --json` children and llama.cpp's tools; it imports the
tokenizer to compare text, nothing of the pipeline.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import re
import sys
from pathlib import Path

import attrs

from lever.backends.flash.config import parse_bytes
from lever.cli.bench import rows
from lever.cli.bench.cgroup import Capped, run_capped
from lever.cli.bench.llama_cpp import DECODED_LINE, EVAL_LINE, completion_cmd, find_pair, speculative_cmd
from lever.cli.bench.paired import paired_speedup
from lever.cli.bench.report import figure, geomean, read_prompts
from lever.cli.common import (
    MAX_PROMPT_BYTES,
    add_common,
    add_set,
    bench_tokens,
    check_sets,
    cpu_model,
    input_text_file,
    output_file,
    parse_list,
)
from lever.cli.models import add_models, bench_config, check_models
from lever.cli.table import show
from lever.config import load_config
from lever.errors import LeverError
from lever.model.sampling import Range
from lever.outputs import write_json
from lever.shipped import shipped

DEFAULT_CAPS = "1536M,2G,3G,4G"
DEFAULT_SPEC_KS = "8,16,24"
# every process gets the same context: llama.cpp's default (the GGUF's 32k) and its weight
# repacking do not fit a phone-sized cap, and Lever's KV cache is planned for n_ctx
N_CTX = 1024
TIMEOUT_S = 3600.0  # one run; llama-completion under a tight cap reads the whole model per token
# the rows' names; "llama-spec k=K" is llama-speculative with draft length K
LEVER, FLASH_AR, LLAMA_COMPLETION, LLAMA_SPEC = "lever", "flash-ar", "llama-completion", "llama-spec"
LEVER_LRU = "lever-lru"  # Lever over the page cache instead of its planned residency (lever.cli.bench.rows)
LEVER_SETS = {LEVER: rows.LEVER, FLASH_AR: rows.FLASH_AR, LEVER_LRU: rows.LEVER_LRU}
_ACCEPT = re.compile(r"n_predict\s*=\s*(\d+).*?n_accept\s*=\s*(\d+)", re.S)


@attrs.frozen
class CapRun:
    """One process under one cap on one prompt."""

    name: str
    cap_bytes: int
    prompt: int
    status: str  # "ok", "killed" (by the cap), "error" (its last line in `why`), "timeout"
    why: str = ""
    tps: float = 0.0  # decode tokens/s
    tokens_per_pass: float = 0.0
    read_mb_per_token: float = 0.0  # from storage over the whole run (prefill included), per generated token
    peak_bytes: int = 0  # the cgroup's: the process and the page cache it filled
    plan_bytes: int = 0  # Lever's memory plan (0: not Lever's)
    rss_bytes: int = 0  # Lever's own peak RSS: what its plan bounds (the cgroup's peak adds reclaimable cache)
    tokens: tuple[int, ...] = ()  # Lever's token ids
    text: str = ""  # llama.cpp's generated text
    same_tokens: int | None = None  # the common prefix with the reference, in its tokens (None: no reference)
    n_reference: int = 0  # the reference's tokens
    # where a Lever row's cycles went (SPLIT): the tree's nodes, a decoding cycle, per pass the
    # read and the target's compute (the prefill's pass among them), a cycle's drafting, flash busy
    split: dict[str, float] = attrs.field(factory=dict)


def _last_line(c: Capped) -> str:
    lines = [x for x in (c.stderr or "").strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else f"exit {c.returncode}"


def _status(c: Capped) -> tuple[str, str]:
    if c.timed_out:
        return "timeout", f"over {TIMEOUT_S:.0f} s"
    if c.killed:
        return "killed", "killed at the cap"
    return ("ok", "") if c.returncode == 0 else ("error", _last_line(c))


def lever_cmd(*, config: str, sets, prompt: str, n: int, cap: str, name: str) -> list[str]:
    """`lever run --json --mem CAP` as the row `name` runs it (the user's sets, then the row's)."""
    cmd = [sys.executable, "-m", "lever", "run", "-c", config, "-p", prompt, "-n", str(n), "--json", "--mem", cap,
           "--set", f"model.n_ctx={N_CTX}", "--set", "generate.temperature=0.0"]
    for s in [*sets, *LEVER_SETS[name]]:
        cmd += ["--set", s]
    return cmd


def lever_run(c: Capped, *, name: str, cap_bytes: int, prompt: int) -> CapRun:
    status, why = _status(c)
    base = dict(name=name, cap_bytes=cap_bytes, prompt=prompt, peak_bytes=c.peak_bytes)
    if status != "ok":
        return CapRun(status=status, why=why, **base)
    d = json.loads(c.stdout)
    n = max(len(d["tokens"]), 1)
    t, tree = d["timing"], d.get("tree") or {}
    passes, cycles = max(t["n_passes"], 1), max(len(tree.get("cycles", ())), 1)
    split = {}
    if tree:
        split = dict(nodes=tree["mean_nodes"], cycle_ms=1e3 * tree["measured_cycle_s"],
                     read_ms=1e3 * t["io_s"] / passes, verify_ms=1e3 * t["stage_s"].get("verify", 0.0) / passes,
                     draft_ms=1e3 * t["draft_s"] / cycles, flash_busy_share=t["flash_busy_share"])
    return CapRun(status="ok", tps=d["decode_tps"], tokens_per_pass=len(d["tokens"]) / passes,
                  read_mb_per_token=c.read_bytes / n / 1e6, plan_bytes=sum(d["memory"]["plan"].values()),
                  rss_bytes=d["memory"]["peak_rss_bytes"], tokens=tuple(d["tokens"]), split=split, **base)


def llama_run(c: Capped, *, name: str, cap_bytes: int, prompt: int, prompt_text: str) -> CapRun:
    """llama-completion's 'eval time' or llama-speculative's 'decoded' line, its text after the prompt."""
    status, why = _status(c)
    base = dict(name=name, cap_bytes=cap_bytes, prompt=prompt, peak_bytes=c.peak_bytes)
    log = c.stderr + c.stdout
    m = DECODED_LINE.search(log) if name != LLAMA_COMPLETION else EVAL_LINE.search(c.stderr)
    if status == "ok" and not m:
        status, why = "error", "no timing line in its output"
    if status != "ok":
        return CapRun(status=status, why=why, **base)
    if name == LLAMA_COMPLETION:
        n_gen, tps, per_pass = int(m[1]) + 1, float(m[2]), 1.0
        text = c.stdout
    else:
        n_gen, tps = int(m[1]), float(m[3])
        a = _ACCEPT.search(log)
        per_pass = int(a[1]) / max(int(a[1]) - int(a[2]), 1) if a else 0.0
        text = c.stdout
        at = text.find(prompt_text)  # llama-speculative prints the prompt before what it generated
        text = text[at + len(prompt_text):] if at >= 0 else text
    return CapRun(status="ok", tps=tps, tokens_per_pass=per_pass, read_mb_per_token=c.read_bytes / max(n_gen, 1) / 1e6,
                  text=text, **base)


def common_tokens(reference: tuple[int, ...], text: str, decode) -> int:
    """How many of the reference's tokens `text` begins with: the longest prefix whose decoded
    text is a prefix of `text`."""
    n = 0
    for i in range(1, len(reference) + 1):
        if not text.startswith(decode(list(reference[:i]))):
            break
        n = i
    return n


def check_tokens(runs: list[CapRun], decode) -> list[CapRun]:
    """Each run's common prefix with Flash-AR's tokens at the same cap and prompt (the target's
    own greedy decoding); Lever's runs compare ids, llama.cpp's text."""
    ref = {(r.cap_bytes, r.prompt): r.tokens for r in runs if r.name == FLASH_AR and r.status == "ok"}
    out = []
    for r in runs:
        want = ref.get((r.cap_bytes, r.prompt))
        if r.status != "ok" or want is None or r.name == FLASH_AR:
            out.append(r)
            continue
        if r.tokens:
            same = next((i for i, (a, b) in enumerate(zip(r.tokens, want)) if a != b), min(len(r.tokens), len(want)))
        else:
            same = common_tokens(want, r.text, decode)
        out.append(attrs.evolve(r, same_tokens=same, n_reference=len(want)))
    return out


def names(spec_ks, llama: bool, rows=None) -> list[str]:
    """The rows run, in order: Lever's, then llama.cpp's when its tools are found; `rows`: only these."""
    every = [FLASH_AR, LEVER, LEVER_LRU]
    if llama:
        every += [LLAMA_COMPLETION, *(f"{LLAMA_SPEC} k={k}" for k in spec_ks)]
    return [n for n in every if rows is None or n in rows]


def bench_cap(*, config: str, prompts: list[str], caps: list[str], n: int, spec_ks, sets=(),
              llama_dir: str | None = None, rows=None, json_path=None, plot_path=None, out=print) -> dict:
    """Every row at every cap on every prompt, each in its own capped process; the summary."""
    cfg = load_config(config, [*sets, f"generate.n_predict={n}"])
    target, draft = str(cfg.model.target), str(cfg.model.draft)
    tools = find_pair(llama_dir)
    evict = [target, draft]
    runs: list[CapRun] = []
    for cap in caps:
        cap_bytes = parse_bytes(cap)
        for i, p in enumerate(prompts):
            for name in names(spec_ks, bool(tools), rows):
                if name in LEVER_SETS:
                    c = run_capped(lever_cmd(config=config, sets=sets, prompt=p, n=n, cap=cap, name=name), cap_bytes,
                                   evict_paths=evict, timeout_s=TIMEOUT_S)
                    r = lever_run(c, name=name, cap_bytes=cap_bytes, prompt=i)
                elif name == LLAMA_COMPLETION:
                    c = run_capped(completion_cmd(tools[0], target=target, prompt=p, n=n, n_ctx=N_CTX), cap_bytes,
                                   evict_paths=evict, timeout_s=TIMEOUT_S)
                    r = llama_run(c, name=name, cap_bytes=cap_bytes, prompt=i, prompt_text=p)
                else:
                    k = int(name.rsplit("=", 1)[1])
                    cmd = speculative_cmd(tools[1], target=target, draft=draft, prompt=p, n=n, k=k, n_ctx=N_CTX)
                    c = run_capped(cmd, cap_bytes, evict_paths=evict, timeout_s=TIMEOUT_S)
                    r = llama_run(c, name=name, cap_bytes=cap_bytes, prompt=i, prompt_text=p)
                out(f"cap {cap} prompt {i + 1}/{len(prompts)} {name}: " +
                    (f"{r.tps:.2f} tok/s, {r.tokens_per_pass:.2f} tok/pass, {r.read_mb_per_token:.0f} MB read/token, "
                     f"peak {r.peak_bytes / 2**20:.0f} MiB" if r.status == "ok" else f"{r.status}: {r.why}"))
                runs.append(r)
    from lever.gguf.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(target)
    runs = check_tokens(runs, tok.decode)
    summary = summarize(runs, caps, names(spec_ks, bool(tools), rows), len(prompts))
    print_summary(summary, out, target=target)
    now = datetime.datetime.now().isoformat(timespec="seconds")
    doc = {"config": config, "target": target, "draft": draft, "date": now,
           "machine": platform.platform(), "cpu": cpu_model(), "n_gen": n, "n_ctx": N_CTX, "caps": caps,
           "prompts": prompts, "sets": list(sets), "summary": summary,
           "runs": [attrs.asdict(r) for r in runs]}
    if json_path is not None:
        write_json(json_path, doc)
        out(f"wrote {json_path}")
    if plot_path is not None:
        plot(summary, plot_path)
    return doc


SPLIT = ("nodes", "cycle_ms", "read_ms", "verify_ms", "draft_ms", "flash_busy_share")


def summarize(runs: list[CapRun], caps: list[str], row_names: list[str], n_prompts: int) -> dict:
    """Per cap and pipeline: figures over the prompts it ran (means; tok/s geometric), and
    Lever's speed over each, paired by prompt, with its band."""
    per_cap = {}
    for cap in caps:
        cap_bytes = parse_bytes(cap)
        at = [r for r in runs if r.cap_bytes == cap_bytes]
        rows = {}
        for name in row_names:
            mine = [r for r in at if r.name == name]
            ok = [r for r in mine if r.status == "ok"]
            same = [r.same_tokens for r in ok if r.same_tokens is not None]
            rows[name] = {
                "ok": len(ok), "runs": len(mine), "status": sorted({r.status for r in mine}),
                "why": next((r.why for r in mine if r.status != "ok"), ""),
                "tps": geomean([r.tps for r in ok if r.tps > 0]),
                "tokens_per_pass": sum(r.tokens_per_pass for r in ok) / len(ok) if ok else 0.0,
                "read_mb_per_token": sum(r.read_mb_per_token for r in ok) / len(ok) if ok else 0.0,
                "peak_bytes": max((r.peak_bytes for r in mine), default=0),
                "plan_bytes": max((r.plan_bytes for r in ok), default=0),
                "rss_bytes": max((r.rss_bytes for r in ok), default=0),
                "same_tokens": min(same) if same else None,
                "all_same": bool(same) and all(r.same_tokens == r.n_reference for r in ok if r.same_tokens is not None),
                **{k: sum(r.split.get(k, 0.0) for r in ok) / len(ok) if ok else 0.0 for k in SPLIT},
            }
        lever = {r.prompt: r for r in at if r.name == LEVER and r.status == "ok"}
        ratios = {}
        for name in row_names:
            if name == LEVER:
                continue
            pairs = [(r, lever[r.prompt]) for r in at if r.name == name and r.status == "ok" and r.prompt in lever]
            if pairs:
                x, lo, hi = paired_speedup([1 / b.tps for b, _ in pairs], [1 / a.tps for _, a in pairs])
                ratios[name] = {"ratio": x, "band": [lo, hi], "pairs": len(pairs)}
        spec = {k: v for k, v in ratios.items() if k.startswith(LLAMA_SPEC)}
        best = max(spec, key=lambda k: rows[k]["tps"]) if spec else None
        per_cap[cap] = {"cap_bytes": cap_bytes, "rows": rows, "lever_over": ratios, "best_llama_spec": best}
    return {"per_cap": per_cap, "n_prompts": n_prompts}


def print_summary(summary: dict, out, *, target: str) -> None:
    for cap, s in summary["per_cap"].items():
        lines, notes = [], []
        for name, r in s["rows"].items():
            over = s["lever_over"].get(name)
            ok = r["ok"] > 0
            lines.append((
                name,
                f"{r['tps']:.2f}" if ok else "-",
                f"{r['tokens_per_pass']:.2f}" if ok else "-",
                f"{r['read_mb_per_token']:.0f}" if ok else "-",
                f"{r['peak_bytes'] / 2**20:.0f}",
                f"{r['rss_bytes'] / 2**20:.0f}/{r['plan_bytes'] / 2**20:.0f}" if r["plan_bytes"] else "",
                "" if r["same_tokens"] is None else ("all" if r["all_same"] else f"{r['same_tokens']}+"),
                "" if not over else f"{over['ratio']:.2f}x" + (
                    f" ({over['band'][0]:.2f}-{over['band'][1]:.2f})" if over["pairs"] > 1 else ""),
            ))
            if r["ok"] < r["runs"]:
                bad = f"{r['runs'] - r['ok']} of {r['runs']} runs {', '.join(r['status'])}"
                notes.append(f"  {name}: {bad}: {r['why']}")
        show(("pipeline", "tok/s", "tok/pass", "MB/tok", "peak MiB", "RSS/plan", "same", "Lever over it"), lines, out,
             title=f"cap {cap} ({s['cap_bytes'] / 2**20:.0f} MiB, page cache counted), {summary['n_prompts']} prompts")
        for n in notes:
            out(n)
        split = [(name, f"{r['nodes']:.1f}", f"{r['cycle_ms']:.0f}", f"{r['read_ms']:.0f}", f"{r['verify_ms']:.0f}",
                  f"{r['draft_ms']:.0f}", f"{100 * r['flash_busy_share']:.0f}%")
                 for name, r in s["rows"].items() if r["cycle_ms"] > 0]
        if split:
            out("")
            show(("pipeline", "nodes", "cycle ms", "read ms", "verify ms", "draft ms", "flash busy"), split, out,
                 title="where the cycles went (read, verify: per pass; draft: per cycle)")
        out("")
    out(f"target {target}. same: the common prefix with Flash-AR's tokens (the target's greedy decoding), least "
        "over the prompts ('all': every token). MB/tok: read from storage over the whole run (prefill too) per "
        "token generated. peak: the cgroup's, page cache included; RSS/plan: Lever's own peak against its plan.")


def plot(summary: dict, path) -> None:
    caps = sorted(summary["per_cap"].values(), key=lambda s: s["cap_bytes"])
    with figure(path) as (fig, ax):
        import matplotlib.ticker  # figure() imported matplotlib, or said it is missing

        for name in caps[0]["rows"]:
            pts = [(s["cap_bytes"] / 2**30, s["rows"][name]["tps"]) for s in caps if s["rows"][name]["ok"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xlabel("memory cap (GiB, page cache counted)")
        ax.set_ylabel("decode tokens/s")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())  # 0.5, 2, 5: not 5x10^0
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend(fontsize=8)


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("cap", help="Lever beside llama.cpp under the same memory cap (page cache counted)")
    add_models(b, default="none: give -c or -m")
    b.add_argument("--prompts", type=Path, default=None,
                   help="a file of prompts separated by lines holding only --- (default: the shipped code prompts)")
    b.add_argument("--caps", default=DEFAULT_CAPS, help=f"memory caps, bytes with K/M/G (default {DEFAULT_CAPS})")
    b.add_argument("--n-gen", type=bench_tokens, default=32, help="tokens generated per prompt")
    b.add_argument("--spec-ks", default=DEFAULT_SPEC_KS, help="llama-speculative draft lengths swept")
    b.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help="llama.cpp's bin directory (default: beside llama-bench, as `lever bench model` finds it)")
    b.add_argument("--rows", default=None,
                   help="only these rows, by name (e.g. lever,lever-lru); without flash-ar no tokens are checked")
    b.add_argument("--json", type=Path, default=None, help="write every run's figures to this file")
    b.add_argument("--plot", type=Path, default=None, help="draw tok/s against the cap (matplotlib)")
    add_set(b)
    add_common(b)
    b.set_defaults(func=main, check=check_args)
    return b


CAP_BYTES = Range(16 << 20, 1 << 50)


def check_args(args) -> tuple[list[str], tuple[int, ...], list[str] | None]:
    """The lists, files and destinations, before the first run; returns (caps, draft lengths, rows)."""
    caps = [c.strip() for c in args.caps.split(",") if c.strip()]
    if not caps or len(caps) > 16:
        raise LeverError(f"--caps: expected 1-16 sizes separated by commas, got {args.caps!r}")
    for c in caps:
        n = parse_bytes(c)
        if n is None or not CAP_BYTES.lo <= n <= CAP_BYTES.hi:
            raise LeverError(f"--caps: {c!r} is not a whole size from 16M to 1P (e.g. 2G, 1536M)")
    ks = parse_list(args.spec_ks, "--spec-ks", Range(1, 256, integer=True), max_items=16)
    rows = None
    if args.rows is not None:
        rows = [r.strip() for r in args.rows.split(",") if r.strip()]
        known = names(ks, True)
        unknown = [r for r in rows if r not in known]
        if not rows or unknown:
            what = f"{unknown[0]!r} is no row" if unknown else "names no row"
            raise LeverError(f"--rows: {what}; the rows: {', '.join(known)}")
    check_models(args)
    bench_config(args)  # -c or -m
    if args.prompts is not None:
        input_text_file(args.prompts, "--prompts", "prompts file", MAX_PROMPT_BYTES)
    if args.llama_cpp is not None and not Path(args.llama_cpp).is_dir():
        raise LeverError(f"--llama-cpp: {args.llama_cpp} is not a directory")
    output_file(args.json, "--json")
    output_file(args.plot, "--plot")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise LeverError("--plot needs matplotlib (pip install matplotlib)")
    if getattr(args, "mem", None) is not None:
        raise LeverError("--mem: bench cap sets each run's --mem from --caps")
    check_sets(args)
    return caps, ks, rows


def main(args) -> int:
    caps, ks, rows = check_args(args)
    prompts = read_prompts(args.prompts or shipped("prompts", "code.txt"))
    config, sets = bench_config(args, say=print)
    bench_cap(config=config, prompts=prompts, caps=caps, n=args.n_gen, spec_ks=ks, sets=sets,
              llama_dir=args.llama_cpp, rows=rows, json_path=args.json, plot_path=args.plot)
    return 0
