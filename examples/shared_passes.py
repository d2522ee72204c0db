"""N generations at once through one engine, their trees verified in shared passes (issue 49).

Each client is a thread running `Engine.run` with the engine's Batcher (lever.pipelines.batcher);
the figures: aggregate tokens/s, each client's wall time, passes against trees. Not yet the
issue's bench (llama-server --parallel beside it, under a cap): a probe of where batching stands.

    python examples/shared_passes.py examples/model.toml --clients 1,2,4 \\
        --set model.target=\\"/work/deep/qwen-1.5b-deep5.gguf\\" --set flash.dram_budget=0
"""

from __future__ import annotations

import argparse
import threading
import time

import attrs

from lever.config import load_config
from lever.pipelines.batcher import WAIT_S
from lever.pipelines.compose import Request
from lever.pipelines.engine import Engine

PROMPTS = ["def parse_config(path):\n    \"\"\"Read a TOML file", "class LRUCache:\n    def __init__(self, capacity):",
           "import numpy as np\n\ndef softmax(x):", "def binary_search(xs, target):",
           "async def fetch(session, url):", "def fibonacci(n):\n    \"\"\"Return", "SELECT name, COUNT(*) FROM",
           "fn main() {\n    let args"]


def clients(engine: Engine, n: int, n_predict: int, wait_s: float = WAIT_S) -> dict:
    """n generations at once (one alone: no batcher); their tokens and times."""
    reqs = [Request(engine.encode(p), generate=attrs.evolve(engine.plan.generate, n_predict=n_predict))
            for p in (PROMPTS * n)[:n]]
    batcher = engine.batcher(wait_s) if n > 1 else None
    out: list = [None] * n

    def run(i: int) -> None:
        if batcher is not None:
            batcher.join()
        try:
            t0 = time.perf_counter()
            r = engine.run(attrs.evolve(reqs[i], batcher=batcher))
            out[i] = (r.tokens, time.perf_counter() - t0)
        finally:
            if batcher is not None:
                batcher.leave()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    n_tokens = sum(len(o[0]) for o in out)
    return {"clients": n, "tokens": [o[0] for o in out], "wall_s": wall, "client_s": [o[1] for o in out],
            "tok_s": n_tokens / wall, "passes": batcher.passes if batcher else None,
            "trees": batcher.trees if batcher else None}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("-n", "--n-predict", type=int, default=32)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--wait-ms", type=float, default=WAIT_S * 1e3, help="how long a pass waits for the others' trees")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, ['pipeline.baseline=""', *args.set])
    rows = []
    with Engine.open(cfg) as engine:
        engine.run(Request(engine.encode("x = 1"), generate=attrs.evolve(engine.plan.generate, n_predict=4)))  # warm
        for n in (int(x) for x in args.clients.split(",")):
            r = clients(engine, n, args.n_predict, args.wait_ms / 1e3)
            shared = f"; {r['passes']} passes for {r['trees']} trees" if r["passes"] is not None else ""
            print(f"{n} client(s): {sum(map(len, r['tokens']))} tokens in {r['wall_s']:.1f} s = {r['tok_s']:.2f} "
                  f"tok/s aggregate; each client {', '.join(f'{s:.1f}' for s in r['client_s'])} s{shared}", flush=True)
            rows.append(r)
    return rows


if __name__ == "__main__":
    main()
