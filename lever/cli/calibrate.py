"""`lever calibrate`: fits the pruning predictor and TreeExpand's acceptance table from real trees.

It runs the configured speculative pipeline over prompts cut from a corpus, unpruned, with a
lever.policy.fit Recorder observing PrunedVerify; fits on the first part of the prompts and
chooses the layer and threshold on the held-out rest (lever.policy.fit). The artifact goes
beside the target model, keyed to its bytes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import attrs
import numpy as np
from rich.progress import Progress

from lever.cli.common import (
    MAX_CORPUS_BYTES,
    add_common,
    add_set,
    check_sets,
    input_text_file,
    int_in,
    output_file,
)
from lever.config import Config, load_config
from lever.errors import LeverError, regular_file
from lever.gguf.identity import ModelIdentity, file_sha256
from lever.gguf.tokenizer import Tokenizer
from lever.model.transformer import Model
from lever.outputs import atomic_path, writable_destination
from lever.pipelines.engine import run_pipeline
from lever.pipelines.plan import cost_model
from lever.policy.fit import (
    HELD_OUT_SHARE,
    THRESHOLDS,
    Recorder,
    TreeRecord,
    choose,
    depth_report,
    evaluate,
    examples,
    fit_correction,
    fit_table,
)
from lever.policy.predictor import Artifact, artifact_path


def corpus_prompts(path: Path, tok: Tokenizer, n_prompts: int, prompt_tokens: int) -> list[str]:
    """n_prompts pieces of the corpus, each `prompt_tokens` tokens long, spread over the file."""
    regular_file(path, "corpus")
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise LeverError(f"{path}: cannot read corpus ({e.strerror})") from None
    ids = tok.encode(text)
    if len(ids) < prompt_tokens * 2:
        raise LeverError(f"{path}: corpus of {len(ids)} tokens, too short for prompts of {prompt_tokens}")
    starts = np.linspace(0, len(ids) - prompt_tokens, n_prompts).astype(int)
    return [tok.decode(ids[s : s + prompt_tokens]) for s in starts]


def calibrate(cfg: Config, corpus: Path, out: Path | None = None, n_prompts: int = 12, n_gen: int = 32,
              prompt_tokens: int = 48, layers: tuple[int, ...] | None = None, progress=None) -> tuple[Artifact, Path]:
    if cfg.pipeline.kind != "speculative" or not cfg.model.draft:
        raise LeverError(f"{cfg.where}: [pipeline] kind: calibration needs a speculative pipeline with a draft")
    target_path = cfg.model.target
    path = writable_destination(out or artifact_path("", target_path), "--out")  # before the runs, not after
    model = Model(target_path, load_layers=False)
    n_layer = model.spec.n_layer
    shares = (0.25, 0.375, 0.5, 0.625, 0.75)
    layers = layers or tuple(sorted({max(0, min(n_layer - 2, round(n_layer * f))) for f in shares}))
    tok = Tokenizer.from_gguf(model.file)
    prompts = corpus_prompts(corpus, tok, n_prompts, prompt_tokens)
    run_cfg = attrs.evolve(cfg, predictor=attrs.evolve(cfg.predictor, enabled=False),
                           generate=attrs.evolve(cfg.generate, n_predict=n_gen, temperature=0.0))
    per_prompt: list[list[TreeRecord]] = []
    for i, prompt in enumerate(prompts):
        rec = Recorder(model, layers)
        run_pipeline(run_cfg, prompt, observer=rec)
        per_prompt.append(rec.trees[:-1] if len(rec.trees) > 1 else rec.trees)  # the last cycle has no successor
        if progress:
            progress(i + 1, len(prompts))
    n_fit = max(1, round(len(prompts) * (1 - HELD_OUT_SHARE)))
    fit = [r for p in per_prompt[:n_fit] for r in p]
    held = [r for p in per_prompt[n_fit:] for r in p] or fit
    cost = cost_model(run_cfg)
    table = fit_table(fit)
    grid, per_layer = [], {}
    for m in layers:
        corr = fit_correction([(z, q, y) for _, _, z, q, y, _ in examples(fit, m)])
        per_layer[m] = corr
        grid += [evaluate(held, m, corr, th, cfg.predictor.max_prune_share, cost) for th in THRESHOLDS]
    best = choose(grid)
    report = dict(best)
    report.update({"per_layer_correction": {str(k): attrs.asdict(v) for k, v in per_layer.items()}, "grid": grid,
                   "fit_trees": len(fit),
                   "held_out_trees": len(held), "depth": depth_report(held, fit_table(fit)),
                   "corpus": str(corpus), "date": time.strftime("%Y-%m-%d")})
    art = Artifact(ModelIdentity.of(target_path), file_sha256(target_path), best["layer"], best["threshold"],
                   per_layer[best["layer"]], table, report)
    with atomic_path(path, "--out") as tmp:  # the whole artifact or none, whatever stops the write
        art.write(tmp)
    return art, path


def add_parser(sub) -> argparse.ArgumentParser:
    ca = sub.add_parser("calibrate", help="fit the pruning predictor and the acceptance table on a corpus")
    ca.add_argument("-c", "--config", type=Path, required=True, help="a speculative pipeline's TOML config")
    ca.add_argument("--corpus", type=Path, required=True, help="text the prompts are cut from")
    ca.add_argument("--out", type=Path, default=None,
                    help="default: beside the target, <target>.lever-predictor.msgpack")
    ca.add_argument("--n-prompts", type=int_in(1, MAX_PROMPTS), default=18,
                    help="prompts cut from the corpus (a third held out)")
    ca.add_argument("--n-gen", type=int_in(1, MAX_TOKENS), default=40, help="tokens generated per prompt")
    ca.add_argument("--prompt-tokens", type=int_in(1, MAX_TOKENS), default=48, help="tokens per prompt")
    add_set(ca)
    add_common(ca)
    ca.set_defaults(func=main, check=check_args)
    return ca


# A calibration runs n_prompts x n_gen tokens through the pair: a few thousand fit any table,
# and past these it is hours of work nobody asked for.
MAX_PROMPTS = 1000
MAX_TOKENS = 4096


def check_args(args) -> None:
    """The files and the destination, before the config's models are opened (the default
    destination, beside the target, is checked by calibrate() once the config names it)."""
    input_text_file(args.config, "-c", "config file")
    input_text_file(args.corpus, "--corpus", "corpus", MAX_CORPUS_BYTES)
    output_file(args.out, "--out")
    check_sets(args)


def main(args) -> int:
    check_args(args)
    cfg = load_config(args.config, args.set)
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
