"""The `lever` command: argument parsing and user-facing errors for every subcommand.

Each subcommand is a small function over the library; a LeverError (or a missing file, or
Ctrl-C) becomes one line on stderr and a non-zero exit, with the traceback only under --debug.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import numpy as np

from lever.errors import LeverError


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    p.add_argument("--threads", type=int, default=0, help="compute threads (0: all cores)")


def _parse_tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise LeverError(f"--tokens: expected comma-separated integers, got {text!r}") from None


def cmd_generate(args) -> int:
    from lever.generate import generate
    from lever.model import Model
    from lever.sampling import SamplingParams
    from lever.tokenizer import StreamDecoder, Tokenizer

    params = SamplingParams(args.temp, args.top_k, args.top_p, args.seed)
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


def cmd_inspect(args) -> int:
    from lever.gguf_file import GGUFFile
    from lever.model_spec import read_spec

    f = GGUFFile(args.model)
    spec = read_spec(f)
    n_params = sum(int(np.prod(t.shape)) for t in f.tensors.values())
    hist = collections.Counter(t.type.name for t in f.tensors.values())
    layer_bytes = [sum(t.n_bytes for n, t in f.tensors.items() if n.startswith(f"blk.{i}.")) for i in range(spec.n_layer)]
    other = sum(t.n_bytes for n, t in f.tensors.items() if not n.startswith("blk."))
    print(f"file:          {f.path} ({f.path.stat().st_size / 2**20:.1f} MiB)")
    print(f"architecture:  {spec.arch}  name: {f.get('general.name', '?')}")
    print(f"layers:        {spec.n_layer}   embd: {spec.n_embd}   ff: {spec.n_ff}   vocab: {spec.n_vocab}")
    print(f"heads:         {spec.n_head} q / {spec.n_head_kv} kv, head dim {spec.head_dim}, rope dims {spec.n_rot} "
          f"({'neox' if spec.rope_neox else 'normal'}, base {spec.rope_base:g})")
    print(f"context:       {spec.n_ctx_train} (trained)   rms eps: {spec.rms_eps:g}")
    print(f"parameters:    {n_params:,} ({n_params / 1e6:.2f} M)")
    print("tensor types:  " + ", ".join(f"{k} x{v}" for k, v in sorted(hist.items())))
    print(f"bytes/layer:   {np.mean(layer_bytes) / 2**20:.2f} MiB mean (min {min(layer_bytes):,}, max {max(layer_bytes):,})")
    print(f"other tensors: {other / 2**20:.2f} MiB (embeddings, output, norms)")
    return 0


def cmd_logits(args) -> int:
    from lever.kv_cache import causal_mask
    from lever.model import Model

    model = Model(args.model)
    ids = np.asarray(_parse_tokens(args.tokens), np.int64)
    if ids.size == 0:
        raise LeverError("--tokens: no token ids given")
    if ids.size > model.spec.n_ctx_train:
        raise LeverError(f"--tokens: {ids.size} tokens, over the context of {model.spec.n_ctx_train}")
    cache = model.new_cache(ids.size)
    hidden = model.forward(ids, np.arange(ids.size, dtype=np.int32), causal_mask(0, ids.size), cache)
    logits = model.logits(hidden).astype(np.float32)  # (n_tokens, n_vocab)
    np.save(args.out, logits)
    print(f"wrote {args.out}: logits {logits.shape} float32", file=sys.stderr)
    return 0


DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "default.toml"


def cmd_run(args) -> int:
    from lever.config import load_config
    from lever.run import run_pipeline

    overrides = (args.set or []) + ([f"generate.n_predict={args.n}"] if args.n is not None else [])
    cfg = load_config(args.config or DEFAULT_CONFIG, overrides)
    prompt = args.prompt if args.prompt is not None else cfg.generate.prompt
    if not prompt:
        raise LeverError(f"{cfg.path}: no prompt: give -p PROMPT or [generate] prompt")

    def on_text(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    if not args.json:
        sys.stdout.write(prompt)
    res = run_pipeline(cfg, prompt, None if args.json else on_text, args.trace)
    if args.json:
        print(json.dumps(res.as_json()))
        return 0
    print()
    print_summary(res, file=sys.stderr)
    return 0


def print_summary(res, file) -> None:
    mib = 2**20
    p = lambda *a: print(*a, file=file)  # noqa: E731
    p(f"pipeline {res.pipeline}: {len(res.tokens)} tokens in {res.n_passes} passes, stop: {res.stop_reason}")
    p(f"  decode      {res.decode_tps:.2f} tok/s ({res.ms_per_token:.1f} ms/token), prefill {res.prefill_s:.2f} s, "
      f"{res.accepted_per_pass:.2f} tokens/pass from trees of {res.mean_tree_nodes:.1f} nodes")
    p(f"  flash       {res.flash_mb_per_token:.1f} MB/token from the device "
      f"({res.streamed_bytes_per_pass / 1e6:.1f} MB streamed per pass), {res.flash_gbps:.2f} GB/s while reading")
    p(f"  overlap     {100 * res.overlap_share:.0f}% of read time hidden under compute; per pass: "
      f"read {res.io_s / max(res.n_passes, 1) * 1e3:.1f} ms, compute {res.compute_s / max(res.n_passes, 1) * 1e3:.1f} ms, "
      f"wall {res.pass_wall_ratio:.2f}x max(read, compute)")
    if res.draft_s:
        n = max(res.n_passes, 1)
        p(f"  cycle       verify pass {res.verify_pass_s / n * 1e3:.0f} ms, accept {res.stage_s.get('accept', 0) / n * 1e3:.0f} ms, "
          f"draft {res.draft_s / n * 1e3:.0f} ms of which {100 * res.draft_hidden_share:.0f}% ran during verification; "
          f"{100 * res.lookahead_hit_share:.0f}% of cycles started from rows drafted ahead")
    if res.memory is not None:
        p(f"  memory      peak RSS {res.peak_rss_bytes / mib:.0f} MiB, planned before loading {res.memory.describe()}; "
          f"bound with margin {res.memory.rss_bound_bytes / mib:.0f} MiB")
    p("  stages      " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(res.stage_s.items())))
    if res.placement:
        p("  placement   " + ", ".join(f"{k}: {v}" for k, v in res.placement.items()))
    if res.baseline is not None:
        b = res.baseline
        same = "the same tokens" if res.baseline_tokens_equal else "DIFFERENT tokens"
        p(f"  vs {b.pipeline:<8} {res.speedup:.2f}x faster: {b.ms_per_token:.1f} ms/token on the same prompt, "
          f"{b.flash_mb_per_token:.1f} MB/token from the device, {same}")


def cmd_calibrate(args) -> int:
    from rich.progress import Progress

    from lever.calibrate import calibrate
    from lever.config import load_config

    cfg = load_config(args.config, args.set or [])
    with Progress(transient=True) as bar:
        task = bar.add_task("calibrating (prompts)", total=args.n_prompts)
        art, path = calibrate(cfg, args.corpus, args.out, args.n_prompts, args.n_gen, args.prompt_tokens,
                              progress=lambda i, n: bar.update(task, completed=i))
    r = art.report
    print(f"predictor: layer {art.layer}, threshold {art.threshold}, correction {art.correction}")
    print(f"held out ({r['held_out_trees']} trees): tokens/pass {r['tokens_per_pass']:.2f} -> "
          f"{r['tokens_per_pass_pruned']:.2f} pruned, token-layers after layer {art.layer} cut "
          f"{100 * r['late_token_layers_cut']:.0f}%, estimated tokens/s {r['tps']:.2f} -> {r['tps_pruned']:.2f}")
    print("acceptance by depth (held out): " + ", ".join(
        f"{d['depth']}: {d['predicted']:.3f} predicted / {d['observed']:.3f} observed" for d in r["depth"]))
    print(f"wrote {path}")
    return 0


def cmd_convert(args) -> int:
    from lever.convert import convert

    convert(args.input, args.output, args.alignment)
    print(f"wrote {args.output} (tensors aligned to {args.alignment} bytes)", file=sys.stderr)
    return 0


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise LeverError(f"{flag}: expected numbers separated by commas, got {text!r}") from None


def cmd_bench(args) -> int:
    if args.what == "model":
        from lever.bench import bench_models

        if bool(args.model) == bool(args.config):
            raise LeverError("lever bench model: give -m MODEL.gguf or -c CONFIG (its target and draft)")
        if args.model:
            paths = [str(args.model)]
        else:
            from lever.config import load_config

            cfg = load_config(args.config, args.set or [])
            paths = [str(cfg.resolve_path(p)) for p in (cfg.model.target, cfg.model.draft) if p]
        if args.rounds < 1 or args.n_gen < 1:
            raise LeverError("lever bench model: --rounds and --n-gen must be at least 1")
        from lever.bench import find_llama_bench, find_tool

        lb = find_llama_bench(args.llama_bench)
        dram = None
        if args.config:  # then the config's decoding in DRAM, beside llama-completion
            lc = find_tool("llama-completion", args.llama_completion, "LLAMA_COMPLETION", lb)
            dram = dict(config=str(args.config), sets=args.set or [], prompt=args.prompt, n=args.n_decode,
                        llama_completion_path=lc)
        bench_models(paths, args.n_gen, rounds=args.rounds, llama_bench_path=lb, threads=args.threads,
                     json_path=args.json, dram=dram)
    elif args.what == "flash":
        from lever.bench import bench_flash

        if not args.config:
            raise LeverError("lever bench flash: -c CONFIG is required")
        bench_flash(str(args.config), args.prompt, args.n_gen, cap_bytes_per_s=args.cap)
    elif args.what == "pipelines":
        from lever.bench_pipelines import DEFAULT_PROMPTS, bench_pipelines, read_prompts

        if not args.config:
            raise LeverError("lever bench pipelines: -c CONFIG is required")
        prompts = read_prompts(args.prompts or DEFAULT_PROMPTS)
        bench_pipelines(str(args.config), prompts, args.n_gen, _floats(args.budgets, "--budgets"),
                        tuple(int(k) for k in _floats(args.chain_ks, "--chain-ks")), args.set or [], args.json,
                        args.plot, pruning=args.pruning)
    elif args.what == "fuzz":
        _bench_fuzz(args)
    return 0


def _bench_fuzz(args) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from lever.fuzz import run_fuzz

    n = args.n or 100_000
    columns = (TextColumn("fuzzing"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
               TimeRemainingColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("fuzz", total=n, status="")

        def progress(r) -> None:
            if r.n % 50 == 0 or r.n == n:
                bar.update(task, completed=r.n, status=f"{r.rate:.0f}/s, {sum(r.findings.values())} findings")

        report = run_fuzz(n, args.seed or 0, args.corpus, args.timeout, progress=progress)
    print("\n".join(report.lines()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lever", description="Flash-resident speculative decoding of LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with one model held in memory")
    g.add_argument("-m", "--model", type=Path, required=True, help="GGUF model file")
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("-n", type=int, default=128, help="tokens to generate")
    g.add_argument("--temp", type=float, default=0.0, help="temperature (0: greedy)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ctx", type=int, default=0, help="context length (default: min(4096, trained))")
    g.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None, help="add BOS (default: the file's)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_common(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("inspect", help="describe a GGUF model")
    i.add_argument("model", type=Path)
    _add_common(i)
    i.set_defaults(func=cmd_inspect)

    lg = sub.add_parser("logits", help="full-vocabulary logits after every position, as .npy")
    lg.add_argument("-m", "--model", type=Path, required=True)
    lg.add_argument("--tokens", required=True, help="comma-separated token ids")
    lg.add_argument("--out", type=Path, required=True, help="output .npy, float32 (n_tokens, vocab)")
    _add_common(lg)
    lg.set_defaults(func=cmd_logits)

    r = sub.add_parser("run", help="generate through a configured pipeline (target streamed from flash)")
    r.add_argument("-c", "--config", type=Path, default=None,
                   help="TOML config (default: examples/default.toml, the shipped model pair)")
    r.add_argument("-p", "--prompt", default=None, help="default: the config's [generate] prompt")
    r.add_argument("-n", type=int, default=None, help="tokens to generate (overrides [generate] n_predict)")
    r.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    r.add_argument("--json", action="store_true", help="print one JSON object with the run's figures")
    r.add_argument("--trace", type=Path, default=None, help="write a Chrome/Perfetto trace here")
    _add_common(r)
    r.set_defaults(func=cmd_run)

    ca = sub.add_parser("calibrate", help="fit the pruning predictor and the acceptance table on a corpus")
    ca.add_argument("-c", "--config", type=Path, required=True, help="a speculative pipeline's TOML config")
    ca.add_argument("--corpus", type=Path, required=True, help="text the prompts are cut from")
    ca.add_argument("--out", type=Path, default=None, help="default: beside the target, <target>.lever-predictor.msgpack")
    ca.add_argument("--n-prompts", type=int, default=18, help="prompts cut from the corpus (a third held out)")
    ca.add_argument("--n-gen", type=int, default=40, help="tokens generated per prompt")
    ca.add_argument("--prompt-tokens", type=int, default=48, help="tokens per prompt")
    ca.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    _add_common(ca)
    ca.set_defaults(func=cmd_calibrate)

    cv = sub.add_parser("convert", help="rewrite a GGUF with 4096-byte tensor alignment (for O_DIRECT reads)")
    cv.add_argument("input", type=Path)
    cv.add_argument("output", type=Path)
    cv.add_argument("--alignment", type=int, default=4096)
    _add_common(cv)
    cv.set_defaults(func=cmd_convert)

    b = sub.add_parser("bench", help="benchmarks printed as ratios measured side by side")
    b.add_argument("what", choices=["model", "flash", "pipelines", "fuzz"],
                   help="model: tg/pp tokens/s of a model (-m) or a config's two (-c) in DRAM, vs llama-bench; "
                        "flash: Flash-AR at DRAM budgets 0-100%%, with overlap figures; "
                        "pipelines: Flash-AR, Chain-SD, EdgeLLM-like and Lever side by side; "
                        "fuzz: crafted and mutated GGUFs through the loader and the tokenizer")
    b.add_argument("-m", "--model", type=Path)
    b.add_argument("-c", "--config", type=Path)
    b.add_argument("-p", "--prompt", default="def quicksort(arr):")
    b.add_argument("--cap", type=float, default=0.0, help="flash: also run with this bandwidth cap (bytes/s)")
    b.add_argument("--prompts", type=Path, default=None,
                   help="pipelines: a file of prompts separated by lines holding only --- (default: examples/prompts/code.txt)")
    b.add_argument("--budgets", default="0,0.25,0.5,0.75", help="pipelines: DRAM budgets, fractions of the layer bytes")
    b.add_argument("--chain-ks", default="2,4,6,8", help="pipelines: Chain-SD lengths swept (the best is reported)")
    b.add_argument("--json", type=Path, default=None, help="model, pipelines: write every figure to this file")
    b.add_argument("--plot", type=Path, default=None, help="pipelines: draw speedup against budget (matplotlib)")
    b.add_argument("--pruning", action="store_true",
                   help="pipelines: also Lever with its pruning predictor (run `lever calibrate` first)")
    b.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    b.add_argument("--n-gen", type=int, default=32)
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--llama-bench", default=None, help="llama-bench binary to compare with (or $LLAMA_BENCH)")
    b.add_argument("--llama-completion", default=None,
                   help="model -c: llama-completion to compare decoding with (or $LLAMA_COMPLETION; default: beside llama-bench)")
    b.add_argument("--n-decode", type=int, default=64, help="model -c: tokens decoded from --prompt, everything in DRAM")
    b.add_argument("--n", type=int, default=None, help="fuzz: inputs to run (default 100000)")
    b.add_argument("--seed", type=int, default=None, help="fuzz: random seed (default 0)")
    b.add_argument("--corpus", type=Path, default=None, help="fuzz: write each finding's input here, named by hash")
    b.add_argument("--timeout", type=float, default=5.0, help="fuzz: seconds an input may take before it is a hang")
    _add_common(b)
    b.set_defaults(func=cmd_bench)

    from lever.profile import add_profile_parser

    add_profile_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from lever import native

        native.n_threads_default = args.threads
        return args.func(args)
    except LeverError as e:
        if args.debug:
            raise
        print(f"lever: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if args.debug:
            raise
        print(f"lever: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nlever: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
