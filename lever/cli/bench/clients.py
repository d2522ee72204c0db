"""`lever bench clients`: N clients of one model at once, `lever serve --parallel N` beside
llama-server `--parallel N`, in DRAM or each server under the same memory cap (issue 49).

Each row is a server started for N slots of `--ctx-size` tokens each (the context N times
that), its model files evicted from the page cache first. N clients then ask at the same moment,
each `--requests` greedy completions one after another; the prompts are code cut from the
Python standard library (the lines before a cursor, as `lever bench fim` cuts them, with the
same `--seed`): text Lever's calibration, predictor and shipped prompts never saw. Per row and
N: aggregate tokens/s (every client's tokens over the phase's wall time, from the first request
sent to the last answer), each request's time per token at the client (p50 and p99 over all
requests), and MB read from storage per token (the server's own count, /proc/PID/io's
read_bytes: O_DIRECT reads and page-cache misses alike). Printed: a table per row, and Lever's
aggregate over the other rows' at each N and over its own at one client. Lever's one client
asks every prompt that any phase asks (llama-server's, only its own share), and each answer
at N clients is checked against it: what the request gives alone, token for token.

Where it sits: a command over server processes and HTTP, as `lever bench fim`, whose rows,
servers and cgroups it reuses.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import sys
import sysconfig
import threading
import time
from pathlib import Path

from lever.backends.flash.config import parse_bytes
from lever.cli.bench.cgroup import memory_group
from lever.cli.bench.fim import DRAFT, LEVER, LEVER_MARGIN, TARGET, Row, Served, own_copies, pair_of, sample_requests
from lever.cli.bench.llama_cpp import find_server, server_cmd
from lever.cli.common import add_common, bench_tokens, cpu_model, int_in, memory_size, output_file, parse_list
from lever.cli.table import show
from lever.config import check_overrides
from lever.errors import LeverError
from lever.model.sampling import Range
from lever.outputs import write_json

LLAMA = "llama-server"
CLIENTS = "1,2,4,8"
SLOT_CTX = 512
N_BATCH = 512
PROMPT_LINES = 8  # lines before the cursor: a prompt of ~60-120 tokens
REQUEST_S = 3600.0


def rows_for(names, *, n: int, target: str, draft: str, server: str | None, slot_ctx: int, threads: int,
             spec_k: int, lever_mem: int | None, capped: bool, lever_sets=(), place=None) -> list[Row]:
    """The rows `names` for n slots: `lever serve -np n` and llama-server `-np n` with the same
    draft (its speculative decoding, drafts of at most `spec_k`), neither keeping prompts."""
    place = place or (lambda _name, path: path)
    rows = []
    for name in names:
        if name == LEVER:
            mem = ["--mem", f"{lever_mem >> 20}MiB"] if lever_mem else []
            argv = [sys.executable, "-m", "lever", "serve", "-m", target, "-md", draft, "-np", str(n),
                    "--ctx-size", str(slot_ctx * n), "--threads", str(threads), "--cache-ram", "0", "--no-grammars",
                    "--metrics", *mem, *(x for s in lever_sets for x in ("--set", s))]
            rows.append(Row(name, tuple(argv), (target, draft)))
        else:
            t, d = place(name, target), place(name, draft)
            argv = server_cmd(server, target=t, draft=d, k=spec_k, n_ctx=slot_ctx * n, n_batch=N_BATCH,
                              threads=threads, no_repack=capped)
            rows.append(Row(name, (*argv, "-np", str(n), "--cache-ram", "0"), (t, d)))
    return rows


def read_bytes(pid: int) -> int:
    """What the process has read from storage, by the kernel's count (every thread's)."""
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def ask(client, url: str, prompt: str, n_predict: int) -> dict:
    t0 = time.perf_counter()
    try:
        r = client.post(url + "/completion", timeout=REQUEST_S, json={
            "prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "cache_prompt": False,
            "return_tokens": True})
        wall = time.perf_counter() - t0
        if r.status_code != 200:
            return {"ok": False, "wall_s": wall, "error": f"HTTP {r.status_code}: {r.text[:200]}"}
        d = r.json()
    except Exception as e:  # noqa: BLE001 - a failed request is a row's failure, not the bench's
        return {"ok": False, "wall_s": time.perf_counter() - t0, "error": f"{type(e).__name__}: {e}"[:300]}
    return {"ok": True, "wall_s": wall, "tokens": list(d.get("tokens") or ()), "content": d.get("content", ""),
            "n_predicted": int(d.get("tokens_predicted", 0))}


def phase(served: Served, prompts: list[list[str]], n_predict: int) -> dict:
    """Every client's requests at once (client i asks prompts[i] in order); the phase's figures."""
    import httpx

    results: list[list[dict]] = [[] for _ in prompts]
    go = threading.Barrier(len(prompts) + 1)

    def client(i: int) -> None:
        with httpx.Client() as c:
            go.wait()
            for p in prompts[i]:
                results[i].append(ask(c, served.url, p, n_predict))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    read0 = read_bytes(served.proc.pid)
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    read = read_bytes(served.proc.pid) - read0
    flat = [r for rs in results for r in rs]
    ok = [r for r in flat if r["ok"]]
    tokens = sum(r["n_predicted"] for r in ok)
    per_token = sorted(r["wall_s"] / r["n_predicted"] for r in ok if r["n_predicted"])
    return {"clients": len(prompts), "wall_s": wall, "tokens": tokens, "failed": len(flat) - len(ok),
            "errors": sorted({r["error"] for r in flat if not r["ok"]})[:3],
            "tok_s": tokens / wall if wall > 0 else 0.0, "read_bytes": read,
            "mb_per_token": read / 1e6 / tokens if tokens else None,
            "p50_s_per_token": _quantile(per_token, 0.5), "p99_s_per_token": _quantile(per_token, 0.99),
            "results": results, "load_1m": os.getloadavg()[0]}


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return xs[min(int(q * len(xs)), len(xs) - 1)] if q < 1 else xs[-1]


def run_row(row: Row, prompts: list[list[str]], n_predict: int, *, cap_bytes: int | None, warmup: str, out) -> dict:
    """One server for one N: started (capped), one untimed request, the phase, stopped."""
    import contextlib

    import httpx

    with contextlib.ExitStack() as stack:
        group = stack.enter_context(memory_group(cap_bytes)) if cap_bytes else None
        served = Served(row, group)
        try:
            served.wait_ready()
            with httpx.Client() as c:
                ask(c, served.url, warmup, 4)
                before = counters(c, served.url) if row.name == LEVER else {}
                got = phase(served, prompts, n_predict)
                if row.name == LEVER:  # the phase's own: what its passes held and gave
                    got["passes"] = {k: v - before.get(k, 0) for k, v in counters(c, served.url).items()}
        except LeverError as e:
            got = {"clients": len(prompts), "failed": sum(map(len, prompts)), "errors": [str(e)], "tok_s": 0.0,
                   "results": []}
        finally:
            served.stop()
        got |= {"peak_bytes": served.peak_bytes, "exit": served.exit, "died": served.died}
    out(f"{row.name}, {len(prompts)} client{'s' * (len(prompts) != 1)}: {got['tok_s']:.2f} tok/s"
        + (f", {got['failed']} failed: {got['errors'][0]}" if got["failed"] else "")
        + (f", {got['mb_per_token']:.0f} MB read/token" if got.get("mb_per_token") else ""))
    return got


# Lever's /metrics counters a phase reports: shared passes, their trees, the tokens they gave, the nodes drafted
PASS_COUNTERS = ("lever:shared_passes_total", "lever:shared_pass_trees_total", "llamacpp:tokens_predicted_total",
                 "llamacpp:spec_decode_num_draft_tokens_total", "llamacpp:spec_decode_num_drafts_total",
                 "lever:flash_read_bytes_total", "lever:shared_pass_nodes_total", "lever:shared_pass_seconds_total",
                 "lever:shared_pass_predicted_seconds_total")


def counters(client, url: str) -> dict[str, float]:
    text = client.get(url + "/metrics", timeout=30).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {k: float(values[k]) for k in PASS_COUNTERS if k in values}


def same_tokens(runs: dict, prompts_of, most: int) -> dict[int, str]:
    """Lever's answers at each N against its answers at one client (which asked every prompt,
    `most` clients' worth), prompt by prompt."""
    alone = {p: r["tokens"] for p, r in zip(prompts_of(most), [x for rs in runs[1]["results"] for x in rs])
             if r["ok"]}
    out = {}
    for n, run in runs.items():
        answers = [x for rs in run.get("results", []) for x in rs]
        pairs = [(p, r) for p, r in zip(prompts_of(most if n == 1 else n), answers)
                 if r["ok"] and p in alone]
        out[n] = f"{sum(r['tokens'] == alone[p] for p, r in pairs)}/{len(pairs)}"
    return out


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("clients", help="N clients at once: lever serve --parallel N beside llama-server --parallel N")
    b.add_argument("-m", "--model", default=None, metavar="TARGET.gguf", help=f"the target (default: {TARGET})")
    b.add_argument("-md", "--model-draft", default=None, metavar="DRAFT.gguf", help=f"the draft (default: {DRAFT})")
    b.add_argument("--clients", default=CLIENTS, help=f"numbers of clients at once, a phase each (default {CLIENTS})")
    b.add_argument("--requests", type=int_in(1, 100), default=2, help="requests per client, one after another")
    b.add_argument("--n-predict", type=bench_tokens, default=32, help="tokens asked per request")
    b.add_argument("--slot-ctx", type=int_in(64, 1 << 20), default=SLOT_CTX,
                   help=f"each slot's context (both servers: --ctx-size N times it; default {SLOT_CTX})")
    b.add_argument("--prompt-lines", type=int_in(1, 1000), default=PROMPT_LINES,
                   help=f"lines of code before each cursor (default {PROMPT_LINES})")
    b.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0, help="which files and cursors")
    b.add_argument("--cap", type=memory_size, default=None, metavar="SIZE",
                   help="each server in a memory cgroup of this size, page cache counted (root)")
    b.add_argument("--spec-k", type=int_in(1, 64), default=3, help="llama-server's draft length (default 3, its own)")
    b.add_argument("--rows", default=f"{LEVER},{LLAMA}", help="which servers (default both)")
    b.add_argument("--lever-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a --set for lever serve (repeat for several)")
    b.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama-server (default: $LLAMA_SERVER, beside llama-bench, on PATH)")
    b.add_argument("--json", type=Path, default=None, help="write every request's figures to this file")
    add_common(b)
    b.set_defaults(func=main, check=check_args)
    return b


def check_args(args) -> dict:
    target, draft = pair_of(args)
    clients = [int(x) for x in parse_list(args.clients, "--clients", Range(1, 64, integer=True), max_items=8)]
    names = [r.strip() for r in args.rows.split(",") if r.strip()]
    if not names or set(names) - {LEVER, LLAMA} or len(set(names)) != len(names):
        raise LeverError(f"--rows: {args.rows!r}: give {LEVER} and/or {LLAMA}, each once")
    server = find_server(args.llama_server) if LLAMA in names else None
    if LLAMA in names and not server:
        raise LeverError("llama-server not found: give --llama-server PATH or $LLAMA_SERVER (or --rows lever)")
    cap = parse_bytes(args.cap) if args.cap else None
    if cap is not None and cap <= LEVER_MARGIN + (64 << 20):
        raise LeverError(f"--cap: {args.cap} leaves no room for a server")
    output_file(args.json, "--json")
    check_overrides(args.lever_set)
    return {"target": target, "draft": draft, "clients": clients, "names": names, "server": server, "cap": cap}


def main(args) -> int:
    c = check_args(args)
    from lever.gguf.tokenizer import Tokenizer

    threads = args.threads or os.cpu_count() or 1
    tok = Tokenizer.from_gguf(c["target"])
    root = Path(sysconfig.get_paths()["stdlib"])
    most = max(c["clients"]) * args.requests
    picked = sample_requests(most + 1, seed=args.seed, root=root, prefix_lines=args.prompt_lines, suffix_lines=1,
                             hole_lines=1, count=lambda text: len(tok.encode(text, add_bos=False)))
    warmup, prompts = picked[0].prefix, [r.prefix for r in picked[1:]]

    def prompts_of(n: int) -> list[str]:  # client i's requests: prompts i*R .. i*R+R-1
        return prompts[: n * args.requests]

    say = functools.partial(print, flush=True)
    meta = {"cpu": cpu_model(), "cores": os.cpu_count(), "machine": platform.platform(), "threads": threads,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "target": c["target"], "draft": c["draft"],
            "seed": args.seed, "requests_per_client": args.requests, "n_predict": args.n_predict,
            "slot_ctx": args.slot_ctx, "cap_bytes": c["cap"], "spec_k": args.spec_k, "lever_sets": args.lever_set}
    say(f"cpu: {meta['cpu']}, {meta['cores']} cores; {len(prompts)} prompts from {root} (seed {args.seed}); "
        + (f"cap {c['cap'] >> 20} MiB each" if c["cap"] else "in DRAM"))
    lever_mem = c["cap"] - LEVER_MARGIN if c["cap"] else None
    runs: dict[str, dict[int, dict]] = {n: {} for n in c["names"]}
    llama = [n for n in c["names"] if n != LEVER]
    with own_copies(llama, {n: (c["target"], c["draft"]) for n in llama}, c["cap"] is not None) as place:
        for n in c["clients"]:
            for row in rows_for(c["names"], n=n, target=c["target"], draft=c["draft"], server=c["server"],
                                slot_ctx=args.slot_ctx, threads=threads, spec_k=args.spec_k, lever_mem=lever_mem,
                                capped=c["cap"] is not None, lever_sets=args.lever_set, place=place):
                # Lever's one client asks every prompt any phase asks: each alone, the others' reference
                ps = prompts_of(max(c["clients"]) if row.name == LEVER and n == 1 else n)
                per = len(ps) // n
                runs[row.name][n] = run_row(row, [ps[i * per:(i + 1) * per] for i in range(n)],
                                            args.n_predict, cap_bytes=c["cap"], warmup=warmup, out=say) \
                    | {"argv": list(row.argv)}
    summary = summarize(runs, c["clients"], prompts_of if 1 in c["clients"] and LEVER in runs else None)
    say("")
    print_summary(summary, say, title=(f"{args.requests} requests per client, n_predict {args.n_predict}, "
                                       f"{args.slot_ctx} tokens a slot, "
                                       + (f"cap {c['cap'] >> 20} MiB each" if c["cap"] else "in DRAM")))
    if args.json is not None:
        write_json(args.json, {**meta, "prompts": prompts, "runs": runs, "summary": summary})
        say(f"wrote {args.json}")
    return 0


def summarize(runs: dict, clients: list[int], prompts_of) -> dict:
    rows = []
    for name, by_n in runs.items():
        for n in clients:
            r = by_n.get(n, {})
            rows.append({"server": name, "clients": n, "tok_s": r.get("tok_s", 0.0), "failed": r.get("failed", 0),
                         "p50_s_per_token": r.get("p50_s_per_token"), "p99_s_per_token": r.get("p99_s_per_token"),
                         "mb_per_token": r.get("mb_per_token"), "peak_mib": (r.get("peak_bytes") or 0) >> 20})
    lever = runs.get(LEVER, {})
    ratios = {}
    for n in clients:
        if LEVER in runs and lever.get(n, {}).get("tok_s"):
            ratios[n] = {"over_one_client": _per(lever[n]["tok_s"], lever.get(1, {}).get("tok_s")),
                         **{f"over_{k}": _per(lever[n]["tok_s"], v.get(n, {}).get("tok_s"))
                            for k, v in runs.items() if k != LEVER}}
    checked = same_tokens(lever, prompts_of, max(clients)) if prompts_of is not None and lever.get(1) else {}
    return {"rows": rows, "ratios": ratios, "same_as_one_client": checked}


def _per(a, b):
    return a / b if a and b else None


def print_summary(summary: dict, out, *, title: str) -> None:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    head = ["server", "N", "tok/s", "p50 s/tok", "p99 s/tok", "MB/tok", "peak MiB", "failed"]
    body = [[r["server"], r["clients"], f(r["tok_s"], ".2f"), f(r["p50_s_per_token"], ".3f"),
             f(r["p99_s_per_token"], ".3f"), f(r["mb_per_token"], ".0f"), r["peak_mib"], r["failed"]]
            for r in summary["rows"]]
    out(title)
    show(head, body, out=out)
    for n, rs in summary["ratios"].items():
        parts = [f"{k.replace('_', ' ')} {v:.2f}x" for k, v in rs.items() if v]
        same = summary["same_as_one_client"].get(n)
        out(f"Lever at {n} client{'s' * (n != 1)}: " + ", ".join(parts)
            + (f"; tokens as at one client {same}" if same else ""))
