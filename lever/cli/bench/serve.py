"""`lever bench serve [-c CONFIG] [--seconds S] [--mem SIZE]`: `lever serve` under hostile clients
while a well-behaved one, of another API key, keeps asking.

One server process (the shipped pair unless -c) with two API keys, the good client's and the
attackers', and a client that asks for short completions back to back, polls /health, and holds
a conversation it continues after each phase (was it kept?). Phases:
- `calm` (S seconds): the good client alone (the baseline, same run);
- one of S/2 seconds for each of issue 46's attacks alone: fat bodies (4 MiB of empty objects,
  and ones that parse and queue), slow bodies (declared 4 MiB, 12 bytes sent), bursts of /live
  readers, conversations pressing on the kept ones; and the attacker's key generating 200
  tokens back to back (one generation runs at a time: what another key's long one costs);
- `hostile` (S): all of those beside workers that send bodies over the bound (declared and
  real), JSON nested past the parser, prompts past the context, fields Lever does not honour,
  headers a byte at a time, idle connections past the cap, no key / a rebound Host / a
  cross-site Origin / a form body, special-token text in messages, clients that leave
  mid-stream and from the queue, grammars past the bounds;
- `template` (S): a second server whose chat template never ends, hammered with chats (each
  costs one render up to `--timeout`), while the good client asks for completions.
The attackers run in a process of their own at the lowest priority (lever.cli.bench.attacks
says why). With --mem, each server runs with it inside a memory cgroup of that size (root). Printed per
phase: the good client's answers, failures, p50 / p99 latency and p99 over calm's, /health's
p99, what the hostile requests got (by status), the server's peak RSS (the kernel's high-water
mark) against its memory plan (the children's RSS beside it, outside the plan), and whether the
good key's conversation came back from the kept ones.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from lever.cli.bench import attacks
from lever.cli.bench.attacks import ATTACK_KEY, EACH, HOSTILE, MAX_CONNECTIONS, PROMPT, Attack, Target
from lever.cli.common import add_common, add_set, check_sets, float_in, output_file
from lever.cli.models import add_models, bench_config, check_models
from lever.cli.table import show
from lever.errors import LeverError
from lever.outputs import write_json

KEY = "bench-serve-key"  # the good client's
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "<|im_start|>assistant\n")  # for a pair without a template of its own (the shipped one)
LOOP_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
TIMEOUT_S = 1.0  # the servers' --timeout: headers, bodies, renders
CACHE_RAM_MIB = 4  # kept conversations: 2 MiB a key, so the attacker's fill its share within a phase
START_S = 120.0


class Live:
    """A `lever serve` child on a free port, its stderr in a file."""

    def __init__(self, config: str | None, sets: list[str], *extra: str, wrap=None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.err = tempfile.TemporaryFile("w+")
        cmd = [sys.executable, "-m", "lever", "serve", "--port", str(self.port), "--api-key", KEY, "--api-key",
               ATTACK_KEY, "--timeout", str(TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
               *(["-c", config] if config else []), *(x for s in sets for x in ("--set", s)), *extra]
        self.proc = subprocess.Popen(wrap(cmd) if wrap else cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self.err)
        import httpx

        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if self.proc.poll() is not None:
                    raise LeverError(f"bench serve: lever serve exited: {self.stderr()[-300:]}") from None
                time.sleep(0.2)
        else:
            self.stop()
            raise LeverError(f"bench serve: lever serve did not answer within {START_S:g} s")
        m = re.search(r"memory plan (\d+) MiB", self.stderr())
        self.plan_mib = int(m.group(1)) if m else 0

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()

    def rss_mib(self) -> tuple[float, float]:
        """The server's peak RSS (the kernel's high-water mark: nothing between two looks is
        missed) and its children's RSS now (the renderer, the grammar compiler), MiB."""
        import psutil

        try:
            p = psutil.Process(self.proc.pid)
            kids = sum(c.memory_info().rss for c in p.children(recursive=True))
            status = open(f"/proc/{self.proc.pid}/status").read()
            peak = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024
            return peak, kids / 2**20
        except (psutil.Error, OSError, AttributeError):
            return 0.0, 0.0

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def good_client(live: Live, stop: threading.Event, out: dict) -> None:
    """Short completions back to back: (latency ms, status) each; /health polled beside them."""
    import httpx

    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                status = c.post(live.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8},
                                headers=headers).status_code
            except httpx.HTTPError:
                status = 0
            out["ms"].append((time.perf_counter() - t0) * 1000)
            out["status"][status] += 1


def health_poller(live: Live, stop: threading.Event, out: dict) -> None:
    import httpx

    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            httpx.get(live.url + "/health", timeout=30)
        except httpx.HTTPError:
            pass
        out["health_ms"].append((time.perf_counter() - t0) * 1000)
        rss, kids = live.rss_mib()
        out["rss"] = max(out["rss"], rss)
        out["child_rss"] = max(out["child_rss"], kids)
        stop.wait(0.1)


def conversation(live: Live, before=None) -> tuple[dict, int]:
    """The good client's conversation: its first turn (None), or its next after `before`: the
    reply and the prompt tokens that came back from the kept conversations."""
    import httpx

    msgs = [{"role": "user", "content": "def parse_args(argv): " * 24}]
    if before is not None:
        msgs += [{"role": "assistant", "content": before["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "more"}]
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 4},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=300).json()
    return r, ((r.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def phase(live: Live, seconds: float, workers=(), nice: int = attacks.NICE) -> dict:
    """The good client (and /health) for `seconds` beside `workers` (lever.cli.bench.attacks, in
    a process of their own); its conversation started before and continued after, to see
    whether the workers pushed it out of the kept ones."""
    first, _ = conversation(live)
    stop = threading.Event()
    out = {"ms": [], "status": Counter(), "health_ms": [], "rss": 0.0, "child_rss": 0.0}
    attack = Attack(Target(live.url, live.port), workers, nice) if workers else None
    threads = [threading.Thread(target=good_client, args=(live, stop, out), daemon=True),
               threading.Thread(target=health_poller, args=(live, stop, out), daemon=True)]
    if attack is not None:
        attack.start()
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    seen = attack.stop() if attack is not None else {}
    for t in threads:
        t.join(120)
    chats = "choices" in first  # the endless template's server answers no chat
    cached = conversation(live, first)[1] if chats else 0
    return {**out, "hostile": seen, "conversation_cached": cached,
            "conversation_tokens": (first.get("usage") or {}).get("prompt_tokens", 0) if chats else 0}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def bench_serve(config: str | None, sets: list[str], seconds: float, *, mem: str | None = None, out=print,
                json_path=None, nice: int = attacks.NICE) -> dict:
    """The phases (module doc); with `mem`, each server runs with `--mem mem` in a memory cgroup
    of that size (lever.cli.bench.cgroup), as a phone would hold it to its share."""
    results = {}
    with _capped(mem) as wrap:
        extra = ("--mem", mem) if mem else ()
        live = Live(config, sets if config else [f"model.chat_template={json.dumps(CHATML)}", *sets], *extra,
                    "--cache-ram", str(CACHE_RAM_MIB), wrap=wrap)
        try:
            results["calm"] = phase(live, seconds, nice=nice)
            for worker in EACH:
                results[worker.__name__.replace("_", " ")] = phase(live, seconds / 2, (worker,), nice)
            results["hostile"] = phase(live, seconds, HOSTILE, nice)
            for r in results.values():
                r["plan_mib"] = live.plan_mib
        finally:
            rc = live.stop()
    tracebacks = live.stderr().count("Traceback")
    with _capped(mem) as wrap:
        loop = Live(config, [*sets, f"model.chat_template={json.dumps(LOOP_TEMPLATE)}"], *extra, "--cache-ram",
                    str(CACHE_RAM_MIB), wrap=wrap)
        try:
            results["template"] = phase(loop, seconds, (attacks.endless_renders,), nice)
            results["template"]["plan_mib"] = loop.plan_mib
        finally:
            rc2 = loop.stop()
    tracebacks += loop.stderr().count("Traceback")
    calm_p99 = _pct(results["calm"]["ms"], 99)
    rows = []
    for name, r in results.items():
        good = sum(v for k, v in r["status"].items() if k == 200)
        failed = sum(v for k, v in r["status"].items() if k != 200)
        p50, p99 = _pct(r["ms"], 50), _pct(r["ms"], 99)
        r.update(good=good, failed=failed, p50_ms=p50, p99_ms=p99, health_p99_ms=_pct(r["health_ms"], 99),
                 p99_over_calm=p99 / calm_p99 if calm_p99 else float("nan"))
        hostile = sum(r["hostile"].values())
        rows.append([name, good, failed, f"{p50:.0f}", f"{p99:.0f}", f"{r['p99_over_calm']:.2f}x",
                     f"{r['health_p99_ms']:.0f}", hostile, f"{r['rss']:.0f}/{r['plan_mib']}",
                     f"{r['child_rss']:.0f}", f"{r['conversation_cached']}/{r['conversation_tokens']}"])
    show(["phase", "good", "failed", "p50", "p99", "p99/calm", "health p99", "hostile", "peak RSS/plan", "child",
          "conv. cached"], rows, out,
         title=f"{seconds:g} s a phase ({config or 'shipped pair'}), --timeout {TIMEOUT_S:g} s, --max-connections "
               f"{MAX_CONNECTIONS}, --cache-ram {CACHE_RAM_MIB}"
               + (f", --mem {mem} in a cgroup of {mem}" if mem else "") + " (ms, MiB)")
    for name in ("hostile", "template"):
        out(f"{name}: " + ", ".join(f"{k}: {v}" for k, v in sorted(results[name]["hostile"].items())))
    killed = [c for c in (rc, rc2) if c in (-9, 137)]
    out(f"server exits {rc} and {rc2} on SIGTERM ({'KILLED' if killed else 'none killed'}); {tracebacks} tracebacks "
        "in their stderr")
    summary = {"exit_codes": [rc, rc2], "tracebacks": tracebacks, "killed": bool(killed),
               "within_plan": all(r["rss"] <= r["plan_mib"] for r in results.values()),
               "good_p99_over_calm": results["hostile"]["p99_over_calm"]}
    result = {"seconds": seconds, "phases": {k: {x: v for x, v in r.items() if x not in ("ms", "health_ms")} |
                                             {"status": {str(s): n for s, n in r["status"].items()}}
                                             for k, r in results.items()}, "summary": summary}
    if json_path:
        write_json(json_path, result)
    return result


@contextlib.contextmanager
def _capped(mem: str | None):
    """A wrapper that runs a command in a memory cgroup of `mem` bytes (None: as it is)."""
    if mem is None:
        yield None
        return
    from lever.backends.flash.config import parse_bytes
    from lever.cli.bench.cgroup import memory_group

    with memory_group(parse_bytes(mem)) as group:
        yield group.joined


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("serve", help="lever serve under hostile clients: a good client's latency, RSS vs the plan")
    add_models(b)
    b.add_argument("--seconds", type=float_in(1, 3600), default=20.0, help="length of each phase")
    b.add_argument("--json", type=Path, default=None)
    add_set(b)
    add_common(b)
    b.set_defaults(func=main, check=check_args)
    return b


def check_args(args) -> None:
    check_models(args)
    output_file(args.json, "--json")
    check_sets(args)


def main(args) -> int:
    check_args(args)
    # --mem: each server runs with it, in a memory cgroup of that size (root)
    config, sets = bench_config(args, required=False, say=print)
    bench_serve(config, sets, args.seconds, mem=args.mem, json_path=args.json)
    return 0
