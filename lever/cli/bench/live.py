"""`lever bench live`: Lever under a memory cap that moves while it runs, beside llama.cpp (issue 50).

A phone's OS grants an app less memory when another opens and more when it closes, and kills
what does not give memory back in time. This bench runs, on one prompt cut from the standard
library at `--seed`, each in a memory cgroup counting the page cache whose cap follows the
schedule (`--then SECONDS=BYTES`, as ../shared/tools/memcap: a cap not met within `--grace` kills):

- `lever`: `lever run --mem START` under the schedule (its MemoryWatch follows the cgroup);
- `lever@CAP`: a run started at each cap of the schedule and left there, the speed each phase
  should settle at, and (at the first cap) the tokens of a run no change touched;
- `llama-completion` and `llama-spec`: llama.cpp's under the same schedule, stopped `--tail`
  seconds after its last change (alive, and how fast, is what is asked of them).

It reports per row whether it lived, its tokens against the untouched run, each phase's settled
tok/s (the last 60% of the phase) against the run started at that cap, how long each lowered cap
took to be met, and the most the group held under it; `--plot` draws tok/s (a sliding window)
and the memory held over time against the cap. Where it sits: a command over `lever run --json`
children and llama.cpp's tools, in cgroups (lever.cli.bench.cgroup); it imports the tokenizer to
count llama.cpp's tokens, nothing of the pipeline.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import sysconfig
from pathlib import Path

from lever.backends.flash.config import parse_bytes
from lever.cli.bench.cgroup import Scheduled, run_scheduled
from lever.cli.bench.fim import sample_requests
from lever.cli.bench.live_serve import Served, request_figures, serve_moved
from lever.cli.bench.llama_cpp import completion_cmd, find_pair, speculative_cmd
from lever.cli.common import add_common, add_set, bench_tokens, check_sets, cpu_model, int_in, output_file
from lever.cli.models import add_models, bench_config, check_models
from lever.errors import LeverError
from lever.outputs import write_json

LEVER, COMPLETION, SPEC, SERVE = "lever", "llama-completion", "llama-spec", "lever-serve"
WINDOW_S = 10.0  # tok/s over time: tokens in the last WINDOW_S seconds
SETTLED = 0.6  # a phase's settled rate: its last 60%
SERVE_PROMPTS = 3  # the server's client asks these in turn, each several times across the phases
N_CTX = 1024  # every process's context (llama.cpp's default and repacking do not fit a phone's cap)


def parse_schedule(items: list[str]) -> list[tuple[float, int]]:
    out = []
    for item in items:
        at, _, size = item.partition("=")
        try:
            s, n = float(at), parse_bytes(size)
        except ValueError:
            s, n = -1.0, None
        if not size or n is None or n < 64 << 20 or not 0 < s < 1e5:
            raise LeverError(f"--then: {item!r}: give SECONDS=SIZE, seconds after the start and a cap of 64M or more")
        out.append((s, n))
    return sorted(out)


def lever_cmd(*, config: str | None, sets, prompt: str, n: int, mem: int) -> list[str]:
    cmd = [sys.executable, "-m", "lever", "run", "-p", prompt, "-n", str(n), "--json", "--mem", str(mem),
           "--set", f"model.n_ctx={N_CTX}", "--set", "generate.temperature=0.0"]
    cmd += ["-c", config] if config else []
    for s in sets:
        cmd += ["--set", s]
    return cmd


def emitted(row: str, run: Scheduled, tok, prompt: str = "") -> list[tuple[float, int]]:
    """(seconds since the row's start, tokens generated so far) as they came (llama-speculative
    prints the prompt first: not counted)."""
    if row.startswith(LEVER):
        if run.returncode != 0:
            return []
        d = json.loads(run.stdout)
        t0, n, out = d["timing"]["started_s"] - run.started_s, 0, []
        for e, k in d["timing"]["emits_s"]:
            n += k
            out.append((t0 + e, n))
        return out
    out, text, last = [], "", -1.0

    def count() -> int:
        gen = generated(text, prompt)
        return len(tok.encode(gen, add_bos=False)) if gen else 0

    for t, c in run.chunks:  # llama.cpp streams its text: count its tokens every half second
        text += c
        if t - last >= 0.5:
            out.append((t - run.started_s, count()))
            last = t
    if text:
        out.append((run.chunks[-1][0] - run.started_s, count()))
    return out


LEAD = 64  # characters a tool may print before its echo of the prompt


def generated(text: str, prompt: str) -> str:
    """What a llama.cpp tool printed after its echo of the prompt (llama-speculative echoes it,
    after a space or its BOS's text: counted as generated, it was a burst of 44 tokens at once)."""
    p = prompt.lstrip()
    if not p:
        return text
    at = text.find(p[:64], 0, LEAD + min(len(p), 64))
    if at >= 0:
        return text[at + len(p):]  # "" while the echo is still coming
    echoing = any(p.startswith(text[k:]) for k in range(min(LEAD, len(text)) + 1))
    return "" if echoing else text


def rate(series: list[tuple[float, int]], a: float, b: float) -> float | None:
    """Tokens/s between a and b (seconds since the start), None when no token came in it."""
    before = max((n for t, n in series if t <= a), default=0)
    inside = [n for t, n in series if a < t <= b]
    if not inside or b <= a:
        return None
    return (inside[-1] - before) / (b - a)


def phases(schedule: list[tuple[float, int]], start: int, end_s: float) -> list[tuple[float, float, int]]:
    """(from s, to s, cap) of each stretch the cap held still."""
    marks = [(0.0, start), *schedule]
    return [(a, marks[i + 1][0] if i + 1 < len(marks) else end_s, cap) for i, (a, cap) in enumerate(marks)]


def row_figures(row: str, run: Scheduled | Served, tok, *, schedule, start: int, prompt: str = "") -> dict:
    series = list(run.series) if isinstance(run, Served) else emitted(row, run, tok, prompt)
    end = series[-1][0] if series else run.wall_s
    ph = []
    for a, b, cap in phases(schedule, start, end):
        settled = rate(series, a + (1 - SETTLED) * (b - a), b)
        taken = next((c for c in run.changes if abs(c[0] - run.started_s - a) < 1.0), None)
        held = [h for t, h, c in run.samples if a + (taken[2] or 0 if taken else 0) <= t - run.started_s < b]
        ph.append({"from_s": a, "to_s": b, "cap_bytes": cap, "settled_tps": settled,
                   "met_after_s": taken[2] if taken else 0.0, "held_max_bytes": max(held, default=0)})
    d = json.loads(run.stdout) if isinstance(run, Scheduled) and row.startswith(LEVER) and run.returncode == 0 else {}
    return {"row": row, "alive": not run.killed_by_cap and run.returncode in (0, None),
            "killed_by_cap": run.killed_by_cap, "returncode": run.returncode, "stopped": run.returncode is None,
            "tokens": d.get("tokens"), "decode_tps": d.get("decode_tps"), "n_tokens": series[-1][1] if series else 0,
            "series": series, "phases": ph, "memory_events": d.get("memory_events", []),
            # each pass's nodes, predicted and measured seconds, learned scales; the plan and reads
            "cycles": d.get("tree", {}).get("cycles", []), "memory": d.get("memory"), "flash": d.get("flash"),
            "samples": [(t - run.started_s, h, c) for t, h, c in run.samples], "peak_bytes": run.peak_bytes,
            "why": "" if run.returncode in (0, None) else (run.stderr.strip().splitlines() or [""])[-1][:300],
            **(request_figures(run) if isinstance(run, Served) else {})}


def _print(rows: dict, ref_tokens, out) -> None:
    for name, r in rows.items():
        state = "killed by the cap" if r["killed_by_cap"] else "alive" if r["alive"] else f"failed: {r['why']}"
        same = ""
        if r["tokens"] is not None and ref_tokens is not None:
            same = ", tokens equal the untouched run" if r["tokens"] == ref_tokens else ", TOKENS DIFFER"
        out(f"{name}: {state}, {r['n_tokens']} tokens{same}, peak {r['peak_bytes'] >> 20} MiB")
        for p in r["phases"]:
            s = f"{p['settled_tps']:.2f} tok/s" if p["settled_tps"] is not None else "no tokens"
            vs = (f" ({p['vs_started_there']:.2f}x the run started at this cap, over tokens "
                  f"{p['tokens'][0]}-{p['tokens'][1]})") if p.get("vs_started_there") else ""
            met = f"met after {p['met_after_s']:.2f} s" if p["met_after_s"] is not None else "never met"
            out(f"  {p['from_s']:6.1f}-{p['to_s']:6.1f} s at {p['cap_bytes'] >> 20} MiB: settled {s}{vs}; "
                f"cap {met}, "
                f"held at most {p['held_max_bytes'] >> 20} MiB")
        if "requests" in r:
            same = "each equal to its prompt's answer with the cap still" if not r["differ"] else \
                f"{len(r['differ'])} DIFFER from their prompt's answer with the cap still"
            out(f"  {r['requests']} streamed requests: status {r['status']}, {r['lost']} lost, "
                f"{r['server_errors']} 5xx, {r['stream_errors']} ended by an error event; {same}")


def plot(rows: dict, path: Path, schedule, start: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, am) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, r in rows.items():
        s = r["series"]
        if not s:
            continue
        ts = [t for t in range(int(s[-1][0]) + 1)]
        ax.plot(ts, [rate(s, max(t - WINDOW_S, 0.0), t) or 0.0 for t in ts], label=name,
                linestyle="-" if name in (LEVER, COMPLETION, SPEC) else ":")
        if r["samples"] and "@" not in name:
            am.plot([x[0] for x in r["samples"]], [x[1] / 2**30 for x in r["samples"]], label=f"{name} held")
    marks = [(0.0, start), *schedule]
    end = max((r["series"][-1][0] for r in rows.values() if r["series"]), default=marks[-1][0] + 10)
    am.step([m[0] for m in marks] + [end], [m[1] / 2**30 for m in marks] + [marks[-1][1] / 2**30], where="post",
            color="black", linestyle="--", label="cap")
    ax.set_ylabel(f"tok/s (last {WINDOW_S:.0f} s)")
    am.set_ylabel("GiB")
    am.set_xlabel("seconds since the start")
    ax.legend(fontsize=8)
    am.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("live", help="Lever under a memory cap that moves while it runs, beside llama.cpp")
    add_models(b, default="none: give -c or -m")
    b.add_argument("--start", default="3G", help="the cap at the start (and Lever's --mem; default 3G)")
    b.add_argument("--then", action="append", default=[], metavar="SECONDS=SIZE",
                   help="the cap from then on (repeat: --then 20=1536M --then 60=3G, the default)")
    b.add_argument("--grace", type=float, default=2.0, help="seconds a lowered cap waits before it kills (default 2)")
    b.add_argument("-n", "--n-gen", type=bench_tokens, default=256, help="tokens Lever generates")
    b.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0, help="which standard-library file and cursor")
    b.add_argument("--prompt-lines", type=int_in(1, 200), default=20, help="lines of code before the cursor")
    b.add_argument("--tail", type=float, default=60.0, help="llama.cpp's rows stop this long after the last change")
    b.add_argument("--spec-k", type=int_in(1, 64), default=8, help="llama-speculative's draft length")
    b.add_argument("--rows", default=None,
                   help="only these rows (lever, lever@CAP..., lever-serve, llama-completion, llama-spec)")
    b.add_argument("--llama-cpp", default=None, metavar="DIR", help="llama.cpp's bin directory")
    b.add_argument("--json", type=Path, default=None, help="write every figure and series to this file")
    b.add_argument("--plot", type=Path, default=None, help="draw tok/s and memory over time (matplotlib)")
    add_set(b)
    add_common(b)
    b.set_defaults(func=main, check=check_args)
    return b


def check_args(args) -> dict:
    check_models(args)
    start = parse_bytes(args.start)
    if start is None or start < 64 << 20:
        raise LeverError(f"--start: {args.start!r} is not a cap of 64M or more")
    schedule = parse_schedule(args.then or ["20=1536M", "60=3G"])
    if not 0 < args.grace < 600:
        raise LeverError(f"--grace: {args.grace} is not between 0 and 600 seconds")
    if getattr(args, "mem", None) is not None:
        raise LeverError("--mem: bench live runs Lever with --mem --start (and each lever@CAP at its cap)")
    output_file(args.json, "--json")
    output_file(args.plot, "--plot")
    check_sets(args)
    caps = sorted({start, *(c for _, c in schedule)}, key=lambda c: (c != start, c))
    names = [LEVER, *(f"{LEVER}@{c >> 20}M" for c in caps), SERVE, COMPLETION, SPEC]
    wanted = [r.strip() for r in args.rows.split(",")] if args.rows else names
    if unknown := [r for r in wanted if r not in names]:
        raise LeverError(f"--rows: {unknown[0]!r} is no row; the rows: {', '.join(names)}")
    return {"start": start, "schedule": schedule, "caps": caps, "rows": wanted}


def main(args) -> int:
    c = check_args(args)
    from lever.gguf.tokenizer import Tokenizer

    config, sets = bench_config(args, say=print)
    target = args.model
    if target is None:
        raise LeverError("bench live: give -m TARGET.gguf (llama.cpp's rows run the same file)")
    tok = Tokenizer.from_gguf(target)
    # the first is every run's prompt; the server's client asks all of them in turn
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = [r.prefix for r in sample_requests(SERVE_PROMPTS, seed=args.seed, root=stdlib,
                                                 prefix_lines=args.prompt_lines, suffix_lines=1, hole_lines=1,
                                                 count=lambda t: len(tok.encode(t, add_bos=False)))]
    prompt = prompts[0]
    pair = find_pair(args.llama_cpp) if {COMPLETION, SPEC} & set(c["rows"]) else None
    last = c["schedule"][-1][0]
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    meta = {"cpu": cpu_model(), "cores": os.cpu_count(), "machine": platform.platform(), "target": target,
            "draft": args.model_draft, "start_bytes": c["start"], "schedule": c["schedule"], "grace_s": args.grace,
            "seed": args.seed, "n_gen": args.n_gen, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "prompt": prompt}
    say(f"cpu: {meta['cpu']}, {meta['cores']} cores; prompt from the standard library (seed {args.seed}), "
        f"{len(tok.encode(prompt, add_bos=False))} tokens; cap {c['start'] >> 20} MiB, then "
        + ", ".join(f"{n >> 20} MiB at {s:g} s" for s, n in c["schedule"]))
    rows = {}
    for name in c["rows"]:
        fixed = None if "@" not in name else next(x for x in c["caps"] if f"{x >> 20}M" == name.split("@")[1])
        if name == SERVE:
            say(f"{name}: running, a client streaming {len(prompts)} prompts in turn")
            served = serve_moved(config=config, sets=sets, prompts=prompts, start=c["start"], schedule=c["schedule"],
                                 grace_s=args.grace, tail_s=args.tail, n_ctx=N_CTX,
                                 evict_paths=[p for p in (target, args.model_draft) if p])
            rows[name] = row_figures(name, served, tok, schedule=c["schedule"], start=c["start"])
            continue
        if name.startswith(LEVER):
            cmd = lever_cmd(config=config, sets=sets, prompt=prompt, n=args.n_gen, mem=fixed or c["start"])
            stop = 4 * 3600.0
        elif pair is None:
            say(f"{name}: skipped, llama.cpp's tools not found (--llama-cpp DIR)")
            continue
        else:
            cmd = completion_cmd(pair[0], target=target, prompt=prompt, n=args.n_gen, n_ctx=N_CTX) \
                if name == COMPLETION else speculative_cmd(pair[1], target=target, draft=args.model_draft,
                                                           prompt=prompt, n=args.n_gen, k=args.spec_k, n_ctx=N_CTX)
            stop = last + args.tail
        say(f"{name}: running")
        run = run_scheduled(cmd, fixed or c["start"], schedule=[] if fixed else c["schedule"], grace_s=args.grace,
                            evict_paths=[p for p in (target, args.model_draft) if p], stop_after_s=stop)
        rows[name] = row_figures(name, run, tok, schedule=[] if fixed else c["schedule"], start=fixed or c["start"],
                                 prompt=prompt)
    return _report(rows, c, meta, args, say)


def same_tokens_s(series: list[tuple[float, int]], a: int, b: int) -> float | None:
    """Seconds a run took from its a-th token to its b-th (from its emissions), None if it never got there."""
    ta = next((t for t, n in series if n >= a), None) if a else 0.0
    tb = next((t for t, n in series if n >= b), None)
    return tb - ta if ta is not None and tb is not None and tb > ta else None


def compare(live: dict, started: dict[int, dict]) -> None:
    """Each settled phase of the live run against the run started at its cap, over the same tokens
    (a text's acceptance changes along it: the same stretch of text is the fair comparison)."""
    for p in live["phases"]:
        ref = started.get(p["cap_bytes"])
        a0 = p["from_s"] + (1 - SETTLED) * (p["to_s"] - p["from_s"])
        # from its first token at the earliest: the prefill before it is not the cap's to speed up
        a = max((n for t, n in live["series"] if t <= a0), default=live["series"][0][1] if live["series"] else 0)
        b = max((n for t, n in live["series"] if t <= p["to_s"]), default=0)
        if ref is None or b <= a:
            continue
        theirs, ours = same_tokens_s(ref["series"], a, b), same_tokens_s(live["series"], a, b)
        if theirs and ours:
            p.update(tokens=[a, b], vs_started_there=theirs / ours)


def _report(rows: dict, c: dict, meta: dict, args, say) -> int:
    ref = rows.get(f"{LEVER}@{c['start'] >> 20}M")
    ref_tokens = ref["tokens"] if ref else None
    started = {r["phases"][0]["cap_bytes"]: r for n, r in rows.items() if "@" in n and r["series"]}
    if LEVER in rows:
        compare(rows[LEVER], started)
    _print(rows, ref_tokens, say)
    if args.json:
        write_json(args.json, {"meta": meta, "rows": rows})
    if args.plot:
        plot(rows, args.plot, c["schedule"], c["start"])
        say(f"plot: {args.plot}")
    return 0
