"""`lever generate -m MODEL -p PROMPT`: text from one model held in DRAM, streamed as it decodes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lever.cli.common import add_common, int_in, n_predict, sampling
from lever.config import MAX_CTX
from lever.gguf.tokenizer import StreamDecoder, Tokenizer
from lever.model.generate import generate
from lever.model.sampling import SamplingParams
from lever.model.transformer import Model


def add_parser(sub) -> argparse.ArgumentParser:
    g = sub.add_parser("generate", help="generate text with one model held in memory")
    g.add_argument("-m", "--model", type=Path, required=True, help="GGUF model file")
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("-n", type=n_predict, default=128, help="tokens to generate")
    g.add_argument("--temp", type=sampling("temperature"), default=0.0, help="temperature (0: greedy)")
    g.add_argument("--top-k", type=sampling("top_k"), default=0, help="keep the k likeliest tokens (0: off)")
    g.add_argument("--top-p", type=sampling("top_p"), default=1.0, help="nucleus: the likeliest tokens up to this mass")
    g.add_argument("--min-p", type=sampling("min_p"), default=0.0, help="drop tokens under min_p x the likeliest's")
    g.add_argument("--repeat-penalty", type=sampling("repeat_penalty"), default=1.0, help="llama.cpp's (1: off)")
    g.add_argument("--seed", type=sampling("seed"), default=-1, help="sampling seed (-1: a fresh one)")
    g.add_argument("--ctx", type=int_in(0, MAX_CTX), default=0,
                   help="context length (default: min(4096, trained))")
    g.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None, help="add BOS (default: the file's)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_common(g)
    g.set_defaults(func=main, check=check_args)
    return g


def check_args(args) -> None:
    """Every flag is checked by its argparse type (lever.cli.common); nothing here depends on two."""


def _sampling(args) -> SamplingParams:
    return SamplingParams(args.temp, args.top_k, args.top_p, args.seed, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty)


def main(args) -> int:
    check_args(args)
    params = _sampling(args)
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

    res = generate(model, prompt, args.n, params, n_ctx, frozenset(tok.eos_ids), on_token)
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
