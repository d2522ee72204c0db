"""`lever inspect MODEL`: what a GGUF file holds (architecture, sizes, tensor types)."""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import numpy as np

from lever.cli.common import add_common
from lever.gguf.file import GGUFFile
from lever.gguf.spec import read_spec


def add_parser(sub) -> argparse.ArgumentParser:
    i = sub.add_parser("inspect", help="describe a GGUF model")
    i.add_argument("model", type=Path)
    add_common(i)
    i.set_defaults(func=main)
    return i


def main(args) -> int:
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
