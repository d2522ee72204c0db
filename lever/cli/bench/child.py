"""A `lever run --json` in its own process: what the side-by-side benches are made of.

Each run gets its own process so its peak RSS and its page cache are its own, and a crash or a
hang in one pipeline is one failed row, not a failed bench.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence

from lever.errors import LeverError


def run_json(config: str | None, sets: list[str], prompt: str, n: int, extra: Sequence[str] = ()) -> dict:
    """One `lever run --json` in its own process, so peak RSS and the page cache are its own;
    `extra`: more of `lever run`'s flags (--json-schema FILE)."""
    cmd = [sys.executable, "-m", "lever", "run", "-p", prompt, "-n", str(n), "--json", *extra]
    if config:
        cmd += ["-c", config]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1] if proc.stderr else proc.returncode
        raise LeverError(f"lever run failed: {why}")
    return json.loads(proc.stdout)
