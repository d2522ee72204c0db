"""Several requests' trees in one streamed pass of the target, against a pass each (issue 49).

Reads every layer of a target from flash by O_DIRECT (nothing resident), as a Lever pass at
budget 0 does, and runs N requests' trees of T nodes through it with
PrunedVerify's batched layer (backends/cpu/batch.py), then the same trees one request per
pass: the read is paid once for N, the compute N times. Reads and compute run one after the
other here (no Prefetch overlap), so the figures split the pass into its two costs; each
request's hidden states in the shared pass are checked equal to its own, bit for bit.

    python examples/batched_pass.py /work/deep/qwen-1.5b-deep5.gguf --requests 4 --nodes 22
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from lever.backends.cpu.batch import Segment, layer_forward_batch
from lever.backends.cpu.kv_cache import KVCache
from lever.backends.cpu.layer import load_layer
from lever.backends.flash import FlashConfig
from lever.backends.flash.pool import StagingBuffer
from lever.backends.flash.store import FlashStore
from lever.gguf.file import GGUFFile
from lever.gguf.spec import read_spec

PREFIX_ROWS = 500  # committed rows each request's tree attends to beside its own


def streamed_pass(store: FlashStore, f: GGUFFile, xs: list[np.ndarray], caches: list[KVCache],
                  mask: np.ndarray, pos: np.ndarray) -> tuple[list[np.ndarray], float, float]:
    """One pass over every layer, read from flash, for the requests `xs` (each (T, n_embd)) at
    once; their outputs, and the seconds spent reading and computing."""
    spec = read_spec(f)
    n_tok = mask.shape[0]
    segments = [Segment(c, slice(PREFIX_ROWS, PREFIX_ROWS + n_tok), pos, mask) for c in caches]
    buf = StagingBuffer(0, max(store.layer_bytes))
    x, read_s, compute_s = np.concatenate(xs), 0.0, 0.0
    for i in range(spec.n_layer):
        t0 = time.perf_counter()
        lw = load_layer(f, spec, i, raws=store.read_layer(i, buf))
        t1 = time.perf_counter()
        x = layer_forward_batch(spec, lw, x, segments=segments, layer=i, inv_freq=spec.inv_freq())
        compute_s += time.perf_counter() - t1
        read_s += t1 - t0
        store.release_layer(i)
    return np.split(x, len(xs)), read_s, compute_s


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=22)
    args = ap.parse_args(argv)
    f = GGUFFile(args.target)
    spec = read_spec(f)
    rng = np.random.default_rng(0)
    n, t = args.requests, args.nodes
    xs = [rng.standard_normal((t, spec.n_embd)).astype(np.float32) * 0.1 for _ in range(n)]
    mask = np.ones((t, PREFIX_ROWS + t), bool)
    mask[:, PREFIX_ROWS:] = np.tril(np.ones((t, t), bool))  # a chain: each tree's shape changes no cost
    pos = np.arange(PREFIX_ROWS, PREFIX_ROWS + t, dtype=np.int32)

    def caches() -> list[KVCache]:
        out = []
        for _ in range(n):
            c = KVCache(spec, PREFIX_ROWS + t)
            c.n_rows = PREFIX_ROWS
            out.append(c)
        return out

    with FlashStore(args.target, FlashConfig(mode="direct", dram_budget=0), file=f) as store:
        shared, read_s, compute_s = streamed_pass(store, f, xs, caches(), mask, pos)
        alone = [streamed_pass(store, f, [x], [c], mask, pos) for x, c in zip(xs, caches())]
    same = all(np.array_equal(s, a[0][0]) for s, a in zip(shared, alone))
    each_s = sum(a[1] + a[2] for a in alone)
    print(f"{n} requests x {t} nodes, {spec.n_layer} layers read by O_DIRECT each pass")
    print(f"  one pass for all: read {read_s:.2f} s + compute {compute_s:.2f} s = {read_s + compute_s:.2f} s")
    print(f"  a pass each:      read {sum(a[1] for a in alone):.2f} s + compute {sum(a[2] for a in alone):.2f} s "
          f"= {each_s:.2f} s")
    print(f"  aggregate speed-up {each_s / (read_s + compute_s):.2f}x; each request's hidden states as alone: {same}")
    return {"shared_s": read_s + compute_s, "each_s": each_s, "read_s": read_s, "compute_s": compute_s, "same": same}


if __name__ == "__main__":
    main()
