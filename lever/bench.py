"""Benchmarks that print ratios measured side by side in one run (never timed unit tests).

`lever bench model` times the model core the way llama-bench does: `tg` (decode tokens/s at
batch 1, from an almost empty context) and `pp` (tokens/s of one N-token forward with the
output projection on the last row). When a llama-bench binary is given (or on PATH), the same
file is measured with it in alternating rounds, so both see the same machine load.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time

import numpy as np

from lever.errors import LeverError
from lever.kv_cache import causal_mask
from lever.model import Model


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


def llama_bench(binary: str, model_path: str, n_prompt: int, n_gen: int, threads: int) -> dict[str, float]:
    cmd = [binary, "-m", model_path, "-p", str(n_prompt), "-n", str(n_gen), "-r", "1", "-o", "json"]
    if threads:
        cmd += ["-t", str(threads)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        raise LeverError(f"llama-bench failed ({binary}): {e}") from None
    res = {}
    for row in json.loads(out):
        key = "pp" if row["n_prompt"] else "tg"
        res[key] = float(row["avg_ts"])
    return res


def find_llama_bench(explicit: str | None) -> str | None:
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise LeverError(f"--llama-bench: {explicit} is not an executable file")
        return explicit
    return os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")


def bench_model(model_path: str, n_prompt: int = 32, n_gen: int = 32, rounds: int = 3,
                llama_bench_path: str | None = None, threads: int = 0, out=print) -> dict:
    model = Model(model_path)
    lb = find_llama_bench(llama_bench_path)
    lever_tg(model, 4)  # warm the page cache and the kernels' threads
    samples: dict[str, list[float]] = {"lever_tg": [], "lever_pp": [], "llama_tg": [], "llama_pp": []}
    for r in range(rounds):
        samples["lever_tg"].append(lever_tg(model, n_gen))
        samples["lever_pp"].append(lever_pp(model, n_prompt))
        if lb:
            ref = llama_bench(lb, model_path, n_prompt, n_gen, threads)
            samples["llama_tg"].append(ref["tg"])
            samples["llama_pp"].append(ref["pp"])
        out(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items() if v))
    med = {k: statistics.median(v) for k, v in samples.items() if v}
    out(f"\nmodel: {model_path}")
    out(f"{'test':<8}{'lever tok/s':>14}{'llama.cpp tok/s':>18}{'ratio':>8}")
    for test, n in (("tg", n_gen), ("pp", n_prompt)):
        ours = med[f"lever_{test}"]
        ref = med.get(f"llama_{test}")
        ratio = f"{ours / ref:.2f}x" if ref else "-"
        out(f"{test}{n:<6}{ours:>14.1f}{(f'{ref:.1f}' if ref else 'n/a'):>18}{ratio:>8}")
    if not lb:
        out("(no llama-bench found: pass --llama-bench PATH or set LLAMA_BENCH for the side-by-side ratio)")
    return med
