"""`lever logits -m MODEL --tokens IDS --out F.npy`: full-vocabulary logits after every position."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from lever.backends.cpu.kv_cache import causal_mask
from lever.cli.common import add_common, output_file, parse_tokens
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.spec import read_spec
from lever.model.transformer import Model
from lever.outputs import atomic_write


def add_parser(sub) -> argparse.ArgumentParser:
    lg = sub.add_parser("logits", help="full-vocabulary logits after every position, as .npy")
    lg.add_argument("-m", "--model", type=Path, required=True)
    lg.add_argument("--tokens", required=True, help="comma-separated token ids")
    lg.add_argument("--out", type=Path, required=True,
                    help="output .npy, float32 (n_tokens, vocab), written under exactly this name")
    add_common(lg)
    lg.set_defaults(func=main, check=check_args)
    return lg


def check_args(args) -> list[int]:
    """The ids (in int64's range, at least one) and the destination, before the model is read."""
    ids = parse_tokens(args.tokens)
    if not ids:
        raise LeverError("--tokens: no token ids given")
    output_file(args.out, "--out")
    return ids


def main(args) -> int:
    ids = np.asarray(check_args(args), np.int64)
    f = GGUFFile(args.model)  # the header alone (mapped, not read) says the vocabulary and the context
    spec = read_spec(f)
    bad = ids[(ids < 0) | (ids >= spec.n_vocab)]
    if bad.size:
        raise LeverError(f"--tokens: token id {int(bad[0])} is not in the vocabulary of {args.model} "
                         f"(ids 0..{spec.n_vocab - 1})")
    if ids.size > spec.n_ctx_train:
        raise LeverError(f"--tokens: {ids.size} tokens, over the context of {spec.n_ctx_train}")
    model = Model(file=f)
    cache = model.new_cache(ids.size)
    hidden = model.forward(ids, np.arange(ids.size, dtype=np.int32), causal_mask(0, ids.size), cache)
    logits = model.logits(hidden).astype(np.float32)  # (n_tokens, n_vocab)
    # NaN logits are no output to save (the forward checked its hidden state)
    model.check_logits(logits, np.arange(ids.size))
    with atomic_write(args.out, "wb", "--out") as out:  # np.save given a name would append .npy to it
        np.save(out, logits)
    print(f"wrote {args.out}: logits {logits.shape} float32", file=sys.stderr)
    return 0
