"""llama.cpp's tools, found once and run the same way by every bench that sets Lever beside them.

Below the benches (model, pipelines, cap, fim): where llama-bench, llama-completion,
llama-speculative and llama-server are (a path given, an environment variable, beside
llama-bench, on PATH), the command line of a greedy run of each (of llama-server: its start),
and the figures read back from what they print.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from lever.errors import LeverError

EVAL_LINE = re.compile(r"\beval time =\s*[\d.]+ ms /\s*(\d+) runs.*?([\d.]+) tokens per second")
DECODED_LINE = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
PAIR = (("llama-completion", "LLAMA_COMPLETION"), ("llama-speculative", "LLAMA_SPECULATIVE"))


def llama_bench(binary: str, model_path: str, pp: tuple[int, ...], n_gen: int, threads: int) -> dict[str, float]:
    """One llama-bench round of the same tests: {"tg32": tok/s, "pp1": ..., ...}."""
    cmd = [binary, "-m", model_path, "-p", ",".join(map(str, pp)), "-n", str(n_gen), "-r", "1", "-o", "json"]
    if threads:
        cmd += ["-t", str(threads)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        raise LeverError(f"llama-bench failed ({binary}): {e}") from None
    return {f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}": float(row["avg_ts"])
            for row in json.loads(out)}


def find_llama_bench(explicit: str | None) -> str | None:
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise LeverError(f"--llama-bench: {explicit} is not an executable file")
        return explicit
    return os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")


def find_tool(name: str, explicit: str | None, env: str, beside: str | None = None) -> str | None:
    """A llama.cpp tool: the path given, else $env, else next to `beside` (llama-bench), else on PATH."""
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise LeverError(f"--{name}: {explicit} is not an executable file")
        return explicit
    if os.environ.get(env):
        return os.environ[env]
    near = os.path.join(os.path.dirname(beside), name) if beside else None
    return near if near and os.access(near, os.X_OK) else shutil.which(name)


def find_server(explicit: str | None) -> str | None:
    """llama-server: the path given (--llama-server), else $LLAMA_SERVER, else beside llama-bench,
    else on PATH, else None."""
    return find_tool("llama-server", explicit, "LLAMA_SERVER", find_llama_bench(None))


def server_cmd(binary: str, *, target: str, draft: str | None, k: int = 0, n_ctx: int, n_batch: int, threads: int,
               no_repack: bool = False) -> list[str]:
    """llama-server on `target` (with `draft`: its speculative decoding, drafts of at most `k`
    tokens), `n_ctx` tokens of context, prompts read `n_batch` at a time; `no_repack`: the weights
    used as mapped (a cap's runs: repacking copies them out of the page cache, which a
    phone-sized cap cannot hold twice). The caller adds --port."""
    # -md alone loads the draft and never drafts: its speculative type is "none" unless named
    spec = ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(k)] if draft else []
    cmd = [binary, "-m", target, *spec, "-c", str(n_ctx), "-b", str(n_batch), "-t", str(threads)]
    return cmd + (["--no-repack"] if no_repack else [])


def find_pair(llama_dir: str | None) -> tuple[str, str] | None:
    """llama-completion and llama-speculative: in `llama_dir` (both must be there: named by the
    `--llama-cpp` flag), else beside llama-bench as `lever bench model` finds it ($LLAMA_BENCH or
    PATH), else None."""
    if llama_dir:
        for t, _ in PAIR:
            p = Path(llama_dir) / t
            if not (p.is_file() and os.access(p, os.X_OK)):
                raise LeverError(f"--llama-cpp: {llama_dir} holds no executable {t} (build llama.cpp's tools there)")
        return tuple(str(Path(llama_dir) / t) for t, _ in PAIR)
    beside = find_llama_bench(None)
    found = tuple(find_tool(t, None, env, beside) for t, env in PAIR)
    return found if all(found) else None


def completion_cmd(binary: str, *, target: str, prompt: str, n: int, n_ctx: int | None = None, threads: int = 0,
                   extra: Sequence[str] = ()) -> list[str]:
    """A greedy llama-completion run; `n_ctx`: its context, without weight repacking (a cap's
    runs: llama.cpp's default context and repacking do not fit a phone-sized cap); `extra`: more
    of its flags (a grammar's)."""
    cmd = [binary, "-m", target, "-p", prompt, "-n", str(n), "--temp", "0", "-no-cnv", "--no-display-prompt", *extra]
    if threads:
        cmd += ["-t", str(threads)]
    return cmd + (["-c", str(n_ctx), "--no-repack"] if n_ctx else [])


def speculative_cmd(binary: str, *, target: str, draft: str, prompt: str, n: int, k: int, n_ctx: int | None = None,
                    extra: Sequence[str] = ()) -> list[str]:
    """A greedy llama-speculative run with draft chains of k tokens (`n_ctx`, `extra`: as
    completion_cmd's; a grammar constrains the target's and the draft's samplers)."""
    cmd = [binary, "-m", target, "-md", draft, "-p", prompt, "-n", str(n), "--temp", "0", "--spec-draft-n-max",
           str(k), *extra]
    return cmd + (["-c", str(n_ctx), "--no-repack"] if n_ctx else [])


def llama_completion(binary: str, model_path: str, prompt: str, n: int, threads: int,
                     extra: Sequence[str] = ()) -> float:
    """Decode tokens/s of one greedy llama-completion run (its 'eval time' line: prompt excluded)."""
    cmd = completion_cmd(binary, target=model_path, prompt=prompt, n=n, threads=threads, extra=extra)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    except (subprocess.TimeoutExpired, OSError) as e:
        raise LeverError(f"llama-completion failed ({binary}): {e}") from None
    m = EVAL_LINE.search(proc.stderr)
    if proc.returncode != 0 or not m:
        raise LeverError(f"llama-completion failed ({binary}): exit {proc.returncode}, no 'eval time' line")
    return float(m[2])


def llama_speculative(binary: str, target: str, draft: str, prompt: str, n: int, n_draft: int,
                      extra: Sequence[str] = ()) -> float:
    """Decode tokens/s of one greedy llama-speculative run (its 'decoded' line: prompt excluded)."""
    cmd = speculative_cmd(binary, target=target, draft=draft, prompt=prompt, n=n, k=n_draft, extra=extra)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    except (subprocess.TimeoutExpired, OSError) as e:
        raise LeverError(f"llama-speculative failed ({binary}): {e}") from None
    m = DECODED_LINE.search(proc.stderr + proc.stdout)
    if proc.returncode != 0 or not m:
        raise LeverError(f"llama-speculative failed ({binary}): exit {proc.returncode}, no 'decoded' line")
    return float(m[3])
