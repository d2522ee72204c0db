"""`lever logits -m MODEL --tokens IDS --out F.npy`: full-vocabulary logits after every position."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from lever.backends.cpu.kv_cache import causal_mask
from lever.cli.common import add_common, parse_tokens
from lever.errors import LeverError
from lever.model.transformer import Model


def add_parser(sub) -> argparse.ArgumentParser:
    lg = sub.add_parser("logits", help="full-vocabulary logits after every position, as .npy")
    lg.add_argument("-m", "--model", type=Path, required=True)
    lg.add_argument("--tokens", required=True, help="comma-separated token ids")
    lg.add_argument("--out", type=Path, required=True, help="output .npy, float32 (n_tokens, vocab)")
    add_common(lg)
    lg.set_defaults(func=main)
    return lg


def main(args) -> int:
    model = Model(args.model)
    ids = np.asarray(parse_tokens(args.tokens), np.int64)
    if ids.size == 0:
        raise LeverError("--tokens: no token ids given")
    if ids.size > model.spec.n_ctx_train:
        raise LeverError(f"--tokens: {ids.size} tokens, over the context of {model.spec.n_ctx_train}")
    cache = model.new_cache(ids.size)
    hidden = model.forward(ids, np.arange(ids.size, dtype=np.int32), causal_mask(0, ids.size), cache)
    logits = model.logits(hidden).astype(np.float32)  # (n_tokens, n_vocab)
    model.check_logits(logits, np.arange(ids.size))  # NaN logits are no output to save (the forward checked its hidden state)
    np.save(args.out, logits)
    print(f"wrote {args.out}: logits {logits.shape} float32", file=sys.stderr)
    return 0
