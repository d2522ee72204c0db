"""Measures the shipped draft/target pair with Lever's own forward pass, and defines its corpus.

The pair in examples/models/ is trained by examples/train_pair.py on the Python standard library
of the running interpreter; this module says which of those files are training data and which
are held out (`stdlib_files`, `is_held_out`), so the trainer, this evaluation and the tests agree
on the split without a copy of the corpus in the repo. `evaluate_pair` runs both models with
`lever.model.transformer.Model` over held-out tokens, teacher-forced, and reports each model's
loss and how often the draft's argmax equals the target's: the rate a greedy chain draft would be accepted at
per token. It needs only lever and numpy (no torch), so it runs wherever Lever runs.

    python examples/eval_pair.py examples/models/stdlib-target-q4_0.gguf examples/models/stdlib-draft-q8_0.gguf
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
import time
from pathlib import Path

import numpy as np

from lever.backends.cpu import native
from lever.backends.cpu.kv_cache import causal_mask
from lever.gguf.tokenizer import Tokenizer
from lever.model.transformer import Model

# Directories that are not library code (test suites: half of the stdlib's bytes, and mostly
# assertions about the other half) or not part of the stdlib at all.
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
HELD_OUT_PERCENT = 5  # files whose path hashes into this slice are never trained on


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative path, path) of every library .py file, sorted by relative path."""
    root = root or stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if not SKIP_DIRS.intersection(rel.parts[:-1]) and p.is_file():
            out.append((rel.as_posix(), p))
    return sorted(out)


def is_held_out(rel: str) -> bool:
    # Decided by the path's hash, not its index, so a file is held out (or not) on every Python
    # version: a file added to a newer stdlib does not shift the others across the split.
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100 < HELD_OUT_PERCENT


def read_source(path: Path) -> str:
    # a few stdlib files are not UTF-8 (test data in Latin-1); their odd bytes become U+FFFD
    return path.read_bytes().decode("utf-8", errors="replace")


def held_out_tokens(tok: Tokenizer, n_tokens: int, root: Path | None = None) -> np.ndarray:
    """The first n_tokens of the held-out stream: each held-out file after an end-of-text token,
    as the training stream is laid out."""
    ids: list[int] = []
    for rel, p in stdlib_files(root):
        if is_held_out(rel):
            ids += [tok.eos_id, *tok.encode(read_source(p), add_bos=False)]
            if len(ids) >= n_tokens:
                break
    return np.asarray(ids[:n_tokens], np.int64)


def window_logits(model: Model, ids: np.ndarray) -> np.ndarray:
    """Logits (n, vocab) after every token of one window, from position 0."""
    n = ids.size
    cache = model.new_cache(n)
    hidden = model.forward(ids, np.arange(n, dtype=np.int32), causal_mask(0, n), cache)
    return model.logits(hidden)


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(-1, keepdims=True)
    return np.log(np.exp(z).sum(-1)) - z[np.arange(targets.size), targets]


def evaluate_pair(target: Model, draft: Model, ids: np.ndarray, window: int | None = None) -> dict:
    """Teacher-forced over `ids` cut into windows of `window` tokens (default: the target's
    training context). agreement: fraction of positions where the draft's argmax equals the
    target's; *_loss: mean next-token cross-entropy in nats."""
    window = window or target.spec.n_ctx_train
    same, t_nll, d_nll, n = 0, 0.0, 0.0, 0
    for start in range(0, ids.size - 1, window):
        w = ids[start : start + window + 1]
        if w.size < 2:
            break
        lt, ld = window_logits(target, w[:-1]), window_logits(draft, w[:-1])
        same += int((lt.argmax(-1) == ld.argmax(-1)).sum())
        t_nll += float(_nll(lt, w[1:]).sum())
        d_nll += float(_nll(ld, w[1:]).sum())
        n += w.size - 1
    return {"tokens": n, "agreement": same / n, "target_loss": t_nll / n, "draft_loss": d_nll / n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("--tokens", type=int, default=16384, help="held-out tokens to measure on")
    ap.add_argument("--threads", type=int, default=1, help="Lever compute threads")
    args = ap.parse_args(argv)
    native.n_threads_default = args.threads
    target, draft = Model(args.target), Model(args.draft)
    tok = Tokenizer.from_gguf(target.file)
    t0 = time.perf_counter()
    res = evaluate_pair(target, draft, held_out_tokens(tok, args.tokens))
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
