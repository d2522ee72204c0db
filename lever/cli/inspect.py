"""`lever inspect MODEL [--check]`: what a GGUF file holds (architecture, sizes, tensor types);
with --check, every tensor read and checked for NaN and Inf (lever.model.finite.scan, a chunk
at a time), each one holding any listed, and a non-zero exit if any does."""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import numpy as np

from lever.cli.common import add_common
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.spec import read_spec
from lever.model.finite import scan


def add_parser(sub) -> argparse.ArgumentParser:
    i = sub.add_parser("inspect", help="describe a GGUF model")
    i.add_argument("model", type=Path)
    i.add_argument("--check", dest="scan_tensors", action="store_true",
                   help="read every tensor and list those holding NaN or Inf (exit 1 if any)")
    add_common(i)
    i.set_defaults(func=main, check=check_args)
    return i


def check_args(args) -> None:
    """Nothing but the model's path, which the loader checks as it opens it."""


def main(args) -> int:
    f = GGUFFile(args.model)
    spec = read_spec(f)
    n_params = sum(int(np.prod(t.shape)) for t in f.tensors.values())
    hist = collections.Counter(t.type.name for t in f.tensors.values())
    layer_bytes = [sum(t.n_bytes for n, t in f.tensors.items() if n.startswith(f"blk.{i}."))
                   for i in range(spec.n_layer)]
    other = sum(t.n_bytes for n, t in f.tensors.items() if not n.startswith("blk."))
    print(f"file:          {f.path} ({f.path.stat().st_size / 2**20:.1f} MiB)")
    print(f"architecture:  {spec.arch}  name: {f.get('general.name', '?')}")
    print(f"layers:        {spec.n_layer}   embd: {spec.n_embd}   ff: {spec.n_ff}   vocab: {spec.n_vocab}")
    print(f"heads:         {spec.n_head} q / {spec.n_head_kv} kv, head dim {spec.head_dim}, rope dims {spec.n_rot} "
          f"({'neox' if spec.rope_neox else 'normal'}, base {spec.rope_base:g})")
    print(f"context:       {spec.n_ctx_train} (trained)   rms eps: {spec.rms_eps:g}")
    print(f"parameters:    {n_params:,} ({n_params / 1e6:.2f} M)")
    print("tensor types:  " + ", ".join(f"{k} x{v}" for k, v in sorted(hist.items())))
    print(f"bytes/layer:   {np.mean(layer_bytes) / 2**20:.2f} MiB mean "
          f"(min {min(layer_bytes):,}, max {max(layer_bytes):,})")
    print(f"other tensors: {other / 2**20:.2f} MiB (embeddings, output, norms)")
    return check_tensors(f) if getattr(args, "scan_tensors", False) else 0


def check_tensors(f: GGUFFile) -> int:
    """Every tensor read a chunk at a time (block-quantized ones dequantized only where a scale
    is not finite); those holding NaN or Inf are listed with their counts, then refused in one line."""
    bad = list(scan(f))
    for name, n_nan, n_inf in bad:
        print(f"non-finite:    {name}: {n_nan} NaN, {n_inf} Inf of {f.tensors[name].shape}")
    print(f"checked:       {len(f.tensors)} tensors, {len(bad)} holding NaN or Inf")
    if bad:
        raise LeverError(f"{f.path}: {len(bad)} of {len(f.tensors)} tensors hold NaN or Inf (listed above)")
    return 0
