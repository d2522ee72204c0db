"""`lever generate -m MODEL -p PROMPT`: text from one model held in DRAM, streamed as it decodes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import attrs

from lever.cli.common import add_common, add_knobs, int_in, knob_values
from lever.config import KNOBS, MAX_CTX, GenerateConfig
from lever.gguf.tokenizer import StreamDecoder, Tokenizer
from lever.model.generate import generate
from lever.model.transformer import Model


def add_parser(sub) -> argparse.ArgumentParser:
    g = sub.add_parser("generate", help="generate text with one model held in memory")
    g.add_argument("-m", "--model", type=Path, required=True, help="GGUF model file")
    g.add_argument("-p", "--prompt", required=True)
    add_knobs(g, *KNOBS, defaults=attrs.asdict(GenerateConfig()))  # every knob, [generate]'s defaults
    g.add_argument("--ctx", type=int_in(0, MAX_CTX), default=0,
                   help="context length (default: min(4096, trained))")
    g.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None, help="add BOS (default: the file's)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_common(g)
    g.set_defaults(func=main, check=check_args)
    return g


def check_args(args) -> None:
    """Every flag is checked by its argparse type (lever.cli.common); nothing here depends on two."""


def main(args) -> int:
    check_args(args)
    gen = GenerateConfig(**knob_values(args))
    params = gen.params()
    model = Model(args.model)
    tok = Tokenizer.from_gguf(model.file)
    prompt = tok.encode(args.prompt, add_bos=None if args.bos is None else args.bos)
    n_ctx = min(args.ctx, model.spec.n_ctx_train) if args.ctx else min(4096, model.spec.n_ctx_train)

    stream = StreamDecoder(tok, at_start=False)  # the completion continues the prompt: keep its space
    on_token = None
    if not args.json:
        sys.stdout.write(args.prompt)
        sys.stdout.flush()

        def on_token(t: int) -> None:
            sys.stdout.write(stream.push(t))
            sys.stdout.flush()

    res = generate(model, prompt, gen.n_predict, params, n_ctx, frozenset(tok.eos_ids), on_token)
    if args.json:
        d = StreamDecoder(tok, at_start=False)
        text = "".join(d.push(t) for t in res.tokens) + d.flush()
        print(json.dumps({
            "model": str(args.model), "prompt_tokens": res.prompt_tokens, "tokens": res.tokens, "text": text,
            "prefill_s": res.prefill_s, "decode_s": res.decode_s, "prefill_tps": res.prefill_tps,
            "decode_tps": res.decode_tps, "stop_reason": res.stop_reason,
        }))
    else:
        sys.stdout.write(stream.flush() + "\n")
        print(f"prefill: {len(res.prompt_tokens)} tokens, {res.prefill_tps:.1f} tok/s | "
              f"decode: {len(res.tokens)} tokens, {res.decode_tps:.1f} tok/s | stop: {res.stop_reason}",
              file=sys.stderr)
    return 0
