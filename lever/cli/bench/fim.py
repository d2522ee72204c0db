"""`lever bench fim`: `lever serve`'s /infill beside llama-server's, the same fill-in-the-middle
requests to both, in DRAM or each server under the same memory cap (issue 48).

The requests are cut from real code: Python files of this interpreter's standard library (tests
left out), a fixed sample drawn with `--seed`. None of it is anything Lever was tuned on: its
calibration, its predictor and its shipped prompts (examples/prompts) came from other text, so
the trees' gains here are not fitted to these requests. (The models' own training may well have
seen the standard library; that favours neither server.) Each request puts the cursor after the
indentation of a line of code and leaves out that line and the next `--hole-lines - 1`, so the
model has code to write: input_prefix is up to `--prefix-lines` lines before, input_suffix up to
`--suffix-lines` lines after the hole. Both cut the same way as llama-server takes them with
`-b 512` (a prefix of at most 3/4 of a batch, a suffix of a quarter, the repo-level header
whole), whole lines dropped until they fit, so both servers read the same prompt tokens; the
bench reports where they did not.

The servers: `lever serve -m TARGET -md DRAFT`, llama-server with the same draft (its
speculative decoding, `--spec-type draft-simple`: -md alone loads a draft it never uses), a row
for each draft length in `--spec-ks`, and llama-server with the target alone, the same context
and thread count. The same bodies (n_predict, temperature 0: greedy) go to each in turn, request
after request (Lever, llama-server k=3, ..., llama-server with no draft, Lever, ...), so the load
of a shared machine falls on all of them alike (its 1-minute load average is recorded with each
request); one untimed request to each first. Per request: wall time
at the client, tokens generated, the completion. Reported per server: median and p90 seconds,
tokens/s (tokens over wall time), Lever's time over its time per request (geometric mean, a
bootstrap band of 95%, and min-max in --json), the share of completions equal to Lever's; and
whether Lever's tokens equal the target's own greedy decoding of the same FIM prompt (Flash-AR
in this process, after the servers stopped: lever.gguf.fim builds the prompt as the server
does).

With --cap, each server runs in a memory cgroup of its own of that size, the page cache counted
(lever.cli.bench.cgroup), its model files evicted from the page cache before it starts; Lever
with `--mem` a margin below the cap (its plan places itself inside, the render and grammar
children beside it); llama-server with --no-repack, mapping its files as it does by default;
neither keeps prompts between requests (--cache-ram 0). A server that does not start (Lever's
plan over its --mem) is a row of failures saying why; the others run.
The llama-server rows then read their own copies of the files (made beside them, removed after):
a file's cached pages are one per file, and one server must not read what another's cgroup paid
for.

Where it sits: a command over `lever serve` and llama-server processes and HTTP; it imports the
tokenizer to cut the requests and the API for the greedy reference.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import math
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from lever.backends.flash.config import parse_bytes
from lever.cli.bench.cgroup import evict, memory_group
from lever.cli.bench.llama_cpp import find_server, server_cmd
from lever.cli.common import add_common, bench_tokens, cpu_model, int_in, memory_size, n_ctx, output_file, parse_list
from lever.cli.table import show
from lever.config import check_overrides
from lever.errors import LeverError
from lever.hub.store import models_dir
from lever.model.sampling import Range
from lever.outputs import write_json

LEVER, LLAMA, LLAMA_AR = "lever", "llama-server", "llama-server no draft"
SPEC_KS = "3,8"  # llama-server's drafts: its default length (3), and a longer one
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
N_CTX = 2048
# llama-server's /infill takes a prefix of 3/4 of a batch and a suffix of a quarter, and the
# repo-level header only from what n_ctx - n_batch leaves: at its default batch (2048) and -c 2048
# it keeps two tokens of it, a prompt Lever would not read. A batch of 512 (its micro-batch
# anyway: no slower) keeps the header whole; the requests are cut to fit its shares.
N_BATCH = 512
PREFIX_TOKENS, SUFFIX_TOKENS = 3 * (N_BATCH // 4), N_BATCH // 4 - 2
LEVER_MARGIN = 128 << 20  # under --cap: Lever's --mem is this much below (its children sit beside its plan)
START_S = 900.0  # a server loading under a tight cap reads its files through it
REQUEST_S = 3600.0  # one request: llama-server under a tight cap re-reads the model every token
# encodings: charmap tables generated one like the next, a sample of near-copies
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "idle_test", "lib2to3", "encodings"}
BOOTSTRAP = 2000


@attrs.frozen
class FimRequest:
    """One cursor in one file: what the client sends, and the lines left out (`middle`)."""

    file: str  # relative to the standard library
    line: int  # the cursor's, from 1
    prefix: str
    suffix: str
    middle: str

    def body(self, n_predict: int) -> dict:
        return {"input_prefix": self.prefix, "input_suffix": self.suffix, "n_predict": n_predict, "temperature": 0.0,
                "return_tokens": True}


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's Python files, tests and installed packages left out, in a fixed order."""
    return sorted(p for p in root.rglob("*.py")
                  if not any(d in SKIP_DIRS or d.startswith("test") for d in p.relative_to(root).parts[:-1])
                  and not p.name.startswith("test"))


def sample_requests(n: int, *, seed: int, root: Path, prefix_lines: int, suffix_lines: int, hole_lines: int,
                    count: Callable[[str], int] | None = None) -> list[FimRequest]:
    """`n` requests from `n` different files, drawn with `seed`; `count` (a tokenizer's): whole
    lines dropped until the prefix and the suffix fit llama-server's shares (PREFIX_TOKENS...)."""
    files, rng, out = stdlib_files(root), random.Random(seed), []
    rng.shuffle(files)
    for path in files:
        if len(out) == n:
            break
        try:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        except (OSError, UnicodeDecodeError):
            continue
        spots = [i for i in range(min(prefix_lines, 8), len(lines) - hole_lines - 1)
                 if lines[i].strip() and not lines[i].lstrip().startswith(("#", '"', "'"))]
        if not spots:
            continue
        i = rng.choice(spots)
        indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        before = lines[max(0, i - prefix_lines):i]
        after = lines[i + hole_lines:i + hole_lines + suffix_lines]
        while count and before and count("".join(before) + indent) > PREFIX_TOKENS:
            before = before[1:]
        while count and after and count("".join(after)) > SUFFIX_TOKENS:
            after = after[:-1]
        if not before or not after:
            continue  # one line past the shares alone: another file
        out.append(FimRequest(str(path.relative_to(root)), i + 1, "".join(before) + indent, "".join(after),
                              lines[i][len(indent):] + "".join(lines[i + 1:i + hole_lines])))
    if len(out) < n:
        raise LeverError(f"--requests: the standard library at {root} gave {len(out)} cursors, not {n}")
    return out


@attrs.frozen
class Row:
    """A server as the bench starts it (--port added) and the files evicted before it starts."""

    name: str
    argv: tuple[str, ...]
    evict: tuple[str, ...] = ()


def row_names(spec_ks: Sequence[int]) -> list[str]:
    """Every row, in the order they are asked: Lever, llama-server drafting at most k tokens for
    each k, llama-server with no draft."""
    return [LEVER, *(f"{LLAMA} k={k}" for k in spec_ks), LLAMA_AR]


def rows_for(names: Sequence[str], *, target: str, draft: str, server: str | None, ctx: int, threads: int,
             cap_bytes: int | None = None, lever_mem: int | None = None, lever_sets=(), place=None,
             lever_grammars: bool = True) -> list[Row]:
    """The rows `names` (row_names); `lever_sets`: lever serve's --set overrides;
    `lever_grammars` false: lever serve --no-grammars (FIM brings none); `place(name,
    path)`: the file that row reads for `path` (its own copy). Under a cap neither server keeps
    prompts between requests (--cache-ram 0 both): these share ~10 tokens, and what a cache would
    hold is the model's room."""
    place = place or (lambda _name, path: path)
    capped = ["--cache-ram", "0"] if cap_bytes is not None else []
    rows = []
    for name in names:
        if name == LEVER:
            mib = lever_mem and lever_mem % 2**20 == 0  # as a person would write it, in its refusals too
            mem = ["--mem", f"{lever_mem >> 20}MiB" if mib else str(lever_mem)] if lever_mem else []
            argv = [sys.executable, "-m", "lever", "serve", "-m", target, "-md", draft, "--ctx-size", str(ctx),
                    "--threads", str(threads), *mem, *capped, *(x for s in lever_sets for x in ("--set", s)),
                    *([] if lever_grammars else ["--no-grammars"])]
            rows.append(Row(name, tuple(argv), (target, draft)))
            continue
        t, d = place(name, target), place(name, draft) if name != LLAMA_AR else None
        k = int(name.rsplit("=", 1)[1]) if d else 0
        argv = server_cmd(server, target=t, draft=d, k=k, n_ctx=ctx, n_batch=N_BATCH, threads=threads,
                          no_repack=cap_bytes is not None) + capped
        rows.append(Row(name, tuple(argv), tuple(x for x in (t, d) if x)))
    return rows


class Served:
    """A server on a free port, its stderr in a file, in a memory cgroup when capped."""

    def __init__(self, row: Row, group=None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.row, self.group, self.url = row, group, f"http://127.0.0.1:{self.port}"
        self.err = tempfile.TemporaryFile("w+")
        for p in row.evict:
            evict(p)
        cmd = [*row.argv, "--port", str(self.port)]
        self.proc = subprocess.Popen(group.joined(cmd) if group else cmd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=self.err)
        self.peak_bytes, self.exit, self.died, self.failed = 0, None, False, ""

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LeverError(f"bench: {self.row.name} exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise LeverError(f"bench: {self.row.name} did not answer /health within {START_S:g} s")

    def tail(self) -> str:
        self.err.seek(0)
        lines = [x for x in self.err.read().strip().splitlines() if x.strip()]
        return lines[-1].strip()[:600] if lines else "no output"

    def stop(self) -> None:
        self.died = self.proc.poll() is not None  # it exited (or was killed by its cap) before the bench was done
        if not self.died:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exit = self.proc.returncode
        self.peak_bytes = self.group.peak_bytes if self.group else 0


@contextlib.contextmanager
def serving(rows: Sequence[Row], cap_bytes: int | None):
    """Every row's server, started one after another (each loads alone), in a cgroup of
    `cap_bytes` each when capped; stopped, and their groups' peaks read, when the block ends."""
    with contextlib.ExitStack() as stack:
        servers = []
        try:
            for row in rows:
                group = stack.enter_context(memory_group(cap_bytes)) if cap_bytes else None
                servers.append(Served(row, group))
                try:
                    servers[-1].wait_ready()
                except LeverError as e:  # its row says why (a plan over the cap); the others still run
                    servers[-1].failed = str(e)
            yield servers
        finally:
            for s in servers:
                s.stop()


def ask(url: str, body: dict, client) -> dict:
    """One /infill: wall seconds at the client, the completion, its tokens, or why it failed."""
    t0 = time.perf_counter()
    try:
        r = client.post(url + "/infill", json=body, timeout=REQUEST_S)
        wall = time.perf_counter() - t0
        d = r.json() if r.status_code == 200 else {}
        if r.status_code != 200:
            return {"ok": False, "wall_s": wall, "error": f"HTTP {r.status_code}: {r.text[:200]}"}
    except Exception as e:  # noqa: BLE001 - a failed request is a row's failure, not the bench's
        return {"ok": False, "wall_s": time.perf_counter() - t0, "error": f"{type(e).__name__}: {e}"[:300]}
    return {"ok": True, "wall_s": wall, "content": d.get("content", ""), "tokens": list(d.get("tokens") or ()),
            "n_predicted": int(d.get("tokens_predicted", 0)), "n_evaluated": int(d.get("tokens_evaluated", 0)),
            "timings": d.get("timings") or {}}


def alternate(servers, requests: Sequence[FimRequest], n_predict: int, *, warmup: FimRequest | None = None,
              out=print) -> list[dict]:
    """Each request to each server in turn (the rows' order), after one untimed `warmup` request to each."""
    import httpx

    results = []
    with httpx.Client() as client:
        if warmup is not None:
            for s in servers:
                if not s.failed:
                    ask(s.url, warmup.body(n_predict), client)
        for i, req in enumerate(requests):
            for s in servers:
                if s.failed:
                    results.append({"ok": False, "wall_s": 0.0, "error": s.failed, "request": i, "server": s.row.name})
                    continue
                load = os.getloadavg()[0]  # a shared machine's: what the others ran meanwhile
                r = ask(s.url, req.body(n_predict), client) | {"request": i, "server": s.row.name, "load_1m": load}
                out(f"request {i + 1}/{len(requests)} {req.file}:{req.line} {s.row.name}: " +
                    (f"{r['wall_s']:.2f} s, {r['n_predicted']} tokens" if r["ok"] else r["error"]))
                results.append(r)
    return results


def _quantile(xs: list[float], q: int) -> float:
    if not xs:
        return float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def ratio_band(lever_s: list[float], other_s: list[float], seed: int = 0) -> dict:
    """Lever's time over the other's, request by request: their geometric mean, a bootstrap band
    of 95% over the requests (seeded: the same figures give the same band), min and max."""
    logs = [math.log(a / b) for a, b in zip(lever_s, other_s)]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(BOOTSTRAP))
    lo, hi = means[int(0.025 * BOOTSTRAP)], means[int(0.975 * BOOTSTRAP) - 1]
    return {"ratio": math.exp(statistics.fmean(logs)), "band": [math.exp(lo), math.exp(hi)],
            "min": math.exp(min(logs)), "max": math.exp(max(logs)), "pairs": len(logs)}


def summarize(results: list[dict], names: Sequence[str], greedy: list[list[int]] | None = None) -> dict:
    """Per server: its times and tokens; beside Lever's, per request, the time ratio and whether
    the completions (and the prompt lengths read) are equal; Lever's tokens against `greedy`."""
    by = {(r["request"], r["server"]): r for r in results}
    rows = {}
    for name in names:
        mine = [r for r in results if r["server"] == name]
        ok = [r for r in mine if r["ok"]]
        walls = [r["wall_s"] for r in ok]
        row = {"ok": len(ok), "runs": len(mine), "median_s": statistics.median(walls) if walls else float("nan"),
               "p90_s": _quantile(walls, 90), "tokens": sum(r["n_predicted"] for r in ok),
               "why": next((r["error"] for r in mine if not r["ok"]), "")}
        row["tok_s"] = row["tokens"] / sum(walls) if walls else 0.0
        if name != LEVER:
            pairs = [(by[(r["request"], LEVER)], r) for r in ok if by.get((r["request"], LEVER), {}).get("ok")]
            row["lever_over"] = ratio_band([a["wall_s"] for a, _ in pairs], [b["wall_s"] for _, b in pairs]) \
                if pairs else None
            row["same_text"] = sum(a["content"] == b["content"] for a, b in pairs)
            row["same_prompt"] = sum(a["n_evaluated"] == b["n_evaluated"] for a, b in pairs)
            row["compared"] = len(pairs)
        rows[name] = row
    loads = [r["load_1m"] for r in results if "load_1m" in r]
    out = {"rows": rows, "load_1m": [min(loads), max(loads)] if loads else None}
    if greedy is not None:
        lever = [by.get((i, LEVER), {}) for i in range(len(greedy))]
        out["lever_greedy"] = {"equal": sum(r.get("ok", False) and r["tokens"] == g for r, g in zip(lever, greedy)),
                               "compared": sum(r.get("ok", False) for r in lever)}
    return out


def print_summary(summary: dict, out, *, title: str, peaks: dict | None = None) -> None:
    lines, notes = [], []
    for name, r in summary["rows"].items():
        over, done = r.get("lever_over"), r["ok"] > 0
        lines.append([name, f"{r['ok']}/{r['runs']}", f"{r['median_s']:.2f}" if done else "-",
                      f"{r['p90_s']:.2f}" if done else "-", f"{r['tok_s']:.2f}" if done else "-",
                      "" if not over else f"{over['ratio']:.2f}x ({over['band'][0]:.2f}-{over['band'][1]:.2f})",
                      f"{r['same_text']}/{r['compared']}" if name != LEVER else "-",
                      *([f"{peaks.get(name, 0) / 2**20:.0f}"] if peaks is not None else [])])
        if r["ok"] < r["runs"]:
            notes.append(f"  {name}: {r['runs'] - r['ok']} of {r['runs']} requests failed: {r['why']}")
        if name != LEVER and r["compared"] and r["same_prompt"] < r["compared"]:
            notes.append(f"  {name}: read as many prompt tokens as Lever on {r['same_prompt']}/{r['compared']}")
    show(["server", "done", "median s", "p90 s", "tok/s", "Lever time / its", "same text",
          *(["peak MiB"] if peaks is not None else [])], lines, out, title=title)
    for n in notes:
        out(n)
    g = summary.get("lever_greedy")
    if g is not None:
        out(f"Lever's tokens = the target's own greedy decoding of the same FIM prompt: {g['equal']}/{g['compared']}")
    if summary.get("load_1m"):
        lo, hi = summary["load_1m"]
        out(f"machine load (1-minute average) as the requests went out: {lo:.1f}-{hi:.1f}, {os.cpu_count()} cores")
    out("Lever time / its: geometric mean over the requests of Lever's wall time over that server's (below 1: "
        "Lever faster), 95% bootstrap band; same text: completions equal to Lever's; tok/s: tokens over wall time")


def greedy_reference(target: str, *, ctx: int, n_predict: int, threads: int) -> Callable[[list[FimRequest]], list]:
    """The target's own greedy decoding (Flash-AR) of each request's FIM prompt, built as `lever
    serve` builds it (lever.gguf.fim within the context less the reply's room)."""

    def run(requests: list[FimRequest]) -> list[list[int]]:
        import lever
        from lever.gguf.fim import fim_ids

        room = ctx - min(n_predict, ctx // 4)
        with lever.load(target=target, kind="flash-ar", n_ctx=ctx, threads=threads) as ar:
            return [list(ar.run(ar.prepare(ids=fim_ids(ar.tokenizer, prefix=q.prefix, suffix=q.suffix, n_room=room),
                                           max_tokens=n_predict)).tokens) for q in requests]

    return run


@contextlib.contextmanager
def own_copies(names: Sequence[str], files: dict[str, Sequence[str]], enabled: bool):
    """`place(name, path)`: with `enabled`, each named row's own copy of its files (a directory
    beside the first, removed after), written through to storage so eviction drops it."""
    if not enabled or not names:
        yield None
        return
    first = next(iter(p for ps in files.values() for p in ps))
    with tempfile.TemporaryDirectory(prefix=".lever-bench-fim-", dir=Path(first).parent) as d:
        copies = {}
        for name in names:
            for i, path in enumerate(files[name]):
                dst = Path(d) / f"{len(copies)}-{Path(path).name}"
                shutil.copyfile(path, dst)
                fd = os.open(dst, os.O_RDONLY)
                try:
                    os.fsync(fd)  # a dirty page stays cached: written through first
                finally:
                    os.close(fd)
                copies[(name, path)] = str(dst)
        yield lambda name, path: copies.get((name, path), path)


def bench_fim(requests: list[FimRequest], rows: list[Row], *, n_predict: int, cap_bytes: int | None = None,
              warmup: FimRequest | None = None, greedy=None, meta: dict | None = None, out=print,
              json_path=None) -> dict:
    """Every request to every row's server in turn (module doc); the table, and the document --json writes."""
    with serving(rows, cap_bytes) as servers:
        results = alternate(servers, requests, n_predict, warmup=warmup, out=out)
    peaks = {s.row.name: s.peak_bytes for s in servers}
    exits = {s.row.name: s.exit for s in servers}
    reference = greedy(requests) if greedy is not None and any(r["server"] == LEVER and r["ok"] for r in results) \
        else None
    summary = summarize(results, [r.name for r in rows], reference)
    setting = "in DRAM" if cap_bytes is None else \
        f"cap {cap_bytes / 2**20:.0f} MiB each (page cache counted)"
    out("")
    print_summary(summary, out, peaks=peaks if cap_bytes else None,
                  title=f"/infill {setting}: {len(requests)} requests, n_predict {n_predict}")
    died = {s.row.name: s.exit for s in servers if s.died}
    if died:
        out("exited before the bench was done: " + ", ".join(f"{k} (exit {v})" for k, v in died.items()))
    doc = {**(meta or {}), "cap_bytes": cap_bytes, "n_predict": n_predict,
           "commands": {r.name: list(r.argv) for r in rows}, "requests": [attrs.asdict(q) for q in requests],
           "results": results, "greedy": reference, "peak_bytes": peaks, "exits": exits, "died": sorted(died),
           "summary": summary}
    if json_path is not None:
        write_json(json_path, doc)
        out(f"wrote {json_path}")
    return doc


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("fim", help="lever serve's /infill beside llama-server's, the same requests, in DRAM or capped")
    b.add_argument("-m", "--model", default=None, metavar="TARGET.gguf", help=f"the target (default: {TARGET})")
    b.add_argument("-md", "--model-draft", default=None, metavar="DRAFT.gguf", help=f"the draft (default: {DRAFT})")
    b.add_argument("--ctx-size", type=n_ctx, default=N_CTX, metavar="N",
                   help=f"both servers' context (default {N_CTX})")
    b.add_argument("--requests", type=int_in(1, 1000), default=8, help="requests, each from another file")
    b.add_argument("--n-predict", type=bench_tokens, default=32, help="tokens asked per request")
    b.add_argument("--prefix-lines", type=int_in(1, 10_000), default=32, help="lines before the cursor, at most")
    b.add_argument("--suffix-lines", type=int_in(1, 10_000), default=12, help="lines after the hole, at most")
    b.add_argument("--hole-lines", type=int_in(1, 100), default=2, help="lines left out at the cursor")
    b.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0, help="which files and cursors")
    b.add_argument("--cap", type=memory_size, default=None, metavar="SIZE",
                   help="each server in a memory cgroup of this size, page cache counted (root)")
    b.add_argument("--lever-mem", type=memory_size, default=None, metavar="SIZE",
                   help=f"lever serve's --mem under --cap (default: {LEVER_MARGIN >> 20} MiB below the cap)")
    b.add_argument("--spec-ks", default=SPEC_KS,
                   help=f"llama-server's draft lengths, a row each (--spec-draft-n-max; default {SPEC_KS})")
    b.add_argument("--rows", default=None,
                   help="only these rows, in turn (default: lever, llama-server k=K for each K, llama-server no draft)")
    b.add_argument("--lever-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a --set for lever serve (repeat for several)")
    b.add_argument("--lever-no-grammars", action="store_true",
                   help="lever serve --no-grammars: no room planned for structured output, which FIM requests "
                        "never bring (llama-server allocates a grammar's memory only when a request brings one)")
    b.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama-server (default: $LLAMA_SERVER, beside llama-bench, on PATH)")
    b.add_argument("--no-reference", action="store_true", help="skip the check of Lever against greedy decoding")
    b.add_argument("--json", type=Path, default=None, help="write every request's figures to this file")
    add_common(b)
    b.set_defaults(func=main, check=check_args)
    return b


def _names(args) -> list[str]:
    """The rows --spec-ks and --rows leave, in turn."""
    every = row_names(parse_list(args.spec_ks, "--spec-ks", Range(1, 64, integer=True), max_items=8))
    if args.rows is None:
        return every
    names = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in names if r not in every]
    if not names or bad or len(set(names)) != len(names):
        raise LeverError(f"--rows: {bad[0] + ' is no row' if bad else 'give each row once'}; the rows: "
                         f"{', '.join(every)}")
    return names


def pair_of(args) -> tuple[str, str]:
    """-m and -md (default: the Qwen pair in $LEVER_MODELS), each checked to be a file."""
    from lever.errors import regular_file

    target = args.model or str(models_dir() / TARGET)
    draft = args.model_draft or str(models_dir() / DRAFT)
    for path, flag in ((target, "-m"), (draft, "-md")):
        try:
            regular_file(path, "model")
        except LeverError as e:
            raise LeverError(f"{flag} {e} (`lever pull qwen2.5-coder` fetches the default pair)") from None
    return target, draft


def check_args(args) -> dict:
    """The files, rows and sizes, before any server starts; returns what main needs of them."""
    target, draft = pair_of(args)
    names = _names(args)
    server = find_server(args.llama_server) if set(names) - {LEVER} else None
    if set(names) - {LEVER} and not server:
        raise LeverError("llama-server not found: give --llama-server PATH or $LLAMA_SERVER (or --rows lever)")
    cap = parse_bytes(args.cap) if args.cap else None
    if cap is not None and cap < 64 << 20:
        raise LeverError(f"--cap: {args.cap} is below the 64 MiB any server needs")
    mem = parse_bytes(args.lever_mem) if args.lever_mem else (cap - LEVER_MARGIN if cap else None)
    if args.lever_mem and cap is None:
        raise LeverError("--lever-mem: only under --cap (in DRAM lever serve plans for what the machine has)")
    if cap is not None and not 0 < mem < cap:
        raise LeverError(f"--lever-mem: {mem} bytes is not below the cap's {cap}")
    output_file(args.json, "--json")
    check_overrides(args.lever_set)
    return {"target": target, "draft": draft, "names": names, "server": server, "cap": cap, "mem": mem}


def main(args) -> int:
    c = check_args(args)
    from lever.gguf.tokenizer import Tokenizer

    threads = args.threads or os.cpu_count() or 1
    tok = Tokenizer.from_gguf(c["target"])
    root = Path(sysconfig.get_paths()["stdlib"])
    picked = sample_requests(args.requests + 1, seed=args.seed, root=root, prefix_lines=args.prefix_lines,
                             suffix_lines=args.suffix_lines, hole_lines=args.hole_lines,
                             count=lambda text: len(tok.encode(text, add_bos=False)))
    meta = {"cpu": cpu_model(), "cores": os.cpu_count(), "machine": platform.platform(),
            "python": platform.python_version(), "stdlib": str(root), "seed": args.seed, "threads": threads,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "target": c["target"],
            "draft": c["draft"], "n_ctx": args.ctx_size, "llama_n_batch": N_BATCH, "lever_mem_bytes": c["mem"],
            "lever_grammars": not args.lever_no_grammars}
    say = functools.partial(print, flush=True)  # each request's line as it comes: a run takes minutes
    say(f"cpu: {meta['cpu']}, {meta['cores']} cores, {threads} threads; requests from {root} (seed {args.seed})")
    llama = [n for n in c["names"] if n != LEVER]
    files = {n: (c["target"],) if n == LLAMA_AR else (c["target"], c["draft"]) for n in llama}
    with own_copies(llama, files, c["cap"] is not None) as place:
        rows = rows_for(c["names"], target=c["target"], draft=c["draft"], server=c["server"], ctx=args.ctx_size,
                        threads=threads, cap_bytes=c["cap"], lever_mem=c["mem"], lever_sets=args.lever_set,
                        place=place, lever_grammars=not args.lever_no_grammars)
        greedy = None if args.no_reference else greedy_reference(c["target"], ctx=args.ctx_size,
                                                                 n_predict=args.n_predict, threads=threads)
        bench_fim(picked[1:], rows, n_predict=args.n_predict, cap_bytes=c["cap"], warmup=picked[0], greedy=greedy,
                  meta=meta, out=say, json_path=args.json)
    return 0
