"""The models a command runs: `-c CONFIG`, or `-m TARGET [-md DRAFT]` as llama.cpp's tools take
them, with `--ctx-size N` (llama.cpp's long name: `-c` is Lever's config, as every script and
the README use it).

Shared by run, serve, chat and the benches, below them and above the config and the pairing
(lever.pipelines.pairing). Without -c, `-m` runs examples/model.toml (Lever's trees, layers kept
resident as far as the machine's memory allows, or --mem); with no draft, or one that cannot
propose for the target, the free sources draft and one line says so. With -c, -m and -md
replace the config's paths. --set always comes after, and wins. A model is a path, else a
model of $LEVER_MODELS by the name or the path `lever list` shows (`-m qwen2.5-coder-1.5b`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lever.cli.common import input_text_file, n_ctx
from lever.errors import LeverError, regular_file
from lever.hub.pull import find_model
from lever.pipelines.pairing import free_sets, pair
from lever.shipped import shipped


def add_models(p: argparse.ArgumentParser, *, default: str = "the shipped pair") -> None:
    p.add_argument("-c", "--config", type=Path, default=None, help=f"TOML config (default: {default})")
    p.add_argument("-m", "--model", default=None, metavar="TARGET.gguf",
                   help="the target GGUF, streamed from flash (without -c: no config needed)")
    p.add_argument("-md", "--model-draft", default=None, metavar="DRAFT.gguf",
                   help="the draft GGUF, resident; none, or one whose tokenizer differs: the free sources draft")
    p.add_argument("--ctx-size", type=n_ctx, default=None, metavar="N", help="context length in tokens ([model] n_ctx)")


def check_models(args) -> None:
    """The files named, before anything is loaded: each a regular file, the config a small one."""
    if args.config is not None:
        input_text_file(args.config, "-c", "config file")
    if args.model is not None:
        args.model = _gguf(args.model, "-m")
    if args.model_draft:
        args.model_draft = _gguf(args.model_draft, "-md")
    if args.model is None and args.config is None and args.model_draft:
        raise LeverError("-md: a draft needs its target: give -m TARGET.gguf too (or -c CONFIG)")


def _gguf(path: str, flag: str) -> str:
    """The model file a flag names: a path, else a model of $LEVER_MODELS by its name or its
    path there (as `lever list` shows them), as ollama's and mlx-lm's users name theirs."""
    try:
        regular_file(path, "model")
        return path
    except LeverError as e:
        if (found := find_model(path)) is not None:
            return str(found)
        raise LeverError(f"{flag} {e} (lever pull NAME fetches a model; lever list shows those here)") from None


def config_and_sets(args, *, default: str = "default.toml", say=None) -> tuple[Path, list[str]]:
    """The config file the command loads and the overrides its model flags stand for (to go
    before the command line's own --set). `say` gets the pairing's one line (stderr by default)."""
    sets: list[str] = []
    if args.config is None and args.model is not None:
        pairing = pair(args.model, args.model_draft)
        if pairing.note is not None:
            (say or _stderr)(f"lever: {pairing.note}")
        config, sets = shipped("model.toml"), list(pairing.sets)
    else:
        config = args.config or shipped(default)
        sets += [f"model.target={json.dumps(args.model)}"] if args.model is not None else []
        if args.model_draft:
            sets.append(f"model.draft={json.dumps(args.model_draft)}")
        elif args.model_draft is not None:  # -md "": no draft model, the free sources
            sets += free_sets()
    if args.ctx_size is not None:
        sets.append(f"model.n_ctx={args.ctx_size}")
    return config, sets


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def bench_config(args, *, required: bool = True, say=None) -> tuple[str | None, list[str]]:
    """A bench's config and overrides (its children run `lever run -c CONFIG --set ...`): the
    model flags' sets first, the command line's --set after. Without -c or -m: the shipped
    pair's config when not `required` (None: the children's own default), else refused."""
    if args.config is None and args.model is None:
        if required:
            raise LeverError("give -c CONFIG, or -m TARGET.gguf [-md DRAFT.gguf]")
        return None, list(getattr(args, "set", None) or ())
    config, sets = config_and_sets(args, say=say)
    return str(config), [*sets, *(getattr(args, "set", None) or ())]
