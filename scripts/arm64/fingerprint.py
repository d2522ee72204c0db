"""Fingerprints of Lever's bit-exact kernels, for comparing two machines (run.sh: x86_64 and
emulated aarch64). Takes a second or two natively, ~20 s under qemu.

    python scripts/arm64/fingerprint.py OUT.json          # on each machine
    python scripts/arm64/fingerprint.py --compare A.json B.json

Every ISA the CPU runs (scalar and the best SIMD one) computes: the widening of all 65,536
F16 and BF16 bit patterns (NaN payloads included), dequantization and matmul of every Lever
weight type in both layouts (GGUF's rows and Lever's tiles; 1, 5 and 37 tokens, a partial tile)
on tests/native's seeded weights and activations, and rmsnorm. The contract (native/
quants_internal.h) is that all of these are bit-identical on every ISA, so each check's
SHA-256 must be one value across ISAs and machines. Attention and swiglu use each ISA's own
exp and are compared within tolerances by tests/native/test_ops.py instead."""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.native

import numpy as np  # noqa: E402

from lever.backends.cpu import native  # noqa: E402
from lever.gguf.types import TYPES  # noqa: E402
from tests.native.test_matmul import activations  # noqa: E402
from tests.native.test_quants import TYPE_NAMES, random_weights, rng_for  # noqa: E402

N_IN = {"F32": 172, "F16": 96, "BF16": 96, "Q8_0": 160, "Q4_0": 160, "Q5_0": 160, "Q4_K": 512, "Q6_K": 512}
N_OUT = 37


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def checks() -> dict[str, str]:
    out = {}
    bits = np.arange(1 << 16, dtype=np.uint16)
    for name in ("F16", "BF16"):
        out[f"widen-all-16-bit-{name}"] = sha(native.dequantize(TYPES[name].ggml_id, bits, 1, bits.size))
    for name in TYPE_NAMES:
        tid, n_in = TYPES[name].ggml_id, N_IN[name]
        rng = rng_for("arm64-fingerprint", name)
        w = random_weights(rng, name, N_OUT, n_in)
        x = activations(rng, 37, n_in)
        out[f"dequantize-{name}"] = sha(native.dequantize(tid, w, N_OUT, n_in))
        tiles = native.pack(tid, w, N_OUT, n_in)
        for n_tok in (1, 5, 37):
            out[f"matmul-{name}-rows-{n_tok}"] = sha(native.matmul(tid, w, N_OUT, n_in, x[:n_tok]))
            out[f"matmul-{name}-tiles-{n_tok}"] = sha(native.matmul(tid, tiles, N_OUT, n_in, x[:n_tok],
                                                                   layout=native.TILES))
    rng = rng_for("arm64-fingerprint", "rmsnorm")
    x = rng.standard_normal((7, 896)).astype(np.float32)
    g = rng.standard_normal(896).astype(np.float32)
    out["rmsnorm"] = sha(native.rmsnorm(x, g, 1e-6))
    return out


def measure(path: str) -> None:
    isas = ["scalar", native.best_isa()] if native.best_isa() != "scalar" else ["scalar"]
    per_isa = {}
    for isa in isas:
        assert native.set_isa(isa) == isa
        per_isa[isa] = checks()
    native.set_isa(native.best_isa())
    result = {"machine": platform.machine(), "isas": isas,
              "checks": {k: {isa: per_isa[isa][k] for isa in isas} for k in per_isa["scalar"]}}
    Path(path).write_text(json.dumps(result, indent=1))
    print(f"{result['machine']}: {len(result['checks'])} checks on {', '.join(isas)} -> {path}")


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    bad = []
    for k in a["checks"]:
        values = set(a["checks"][k].values()) | set(b["checks"].get(k, {"missing": "missing"}).values())
        if len(values) != 1:
            bad.append(k)
    for k in bad:
        print(f"DIFFERENT {k}: {a['machine']} {a['checks'][k]} vs {b['machine']} {b['checks'].get(k)}")
    where = f"{a['machine']} ({'+'.join(a['isas'])}) and {b['machine']} ({'+'.join(b['isas'])})"
    if bad:
        print(f"fingerprint: {len(bad)} of {len(a['checks'])} checks differ between {where}")
        return 1
    print(f"fingerprint: all {len(a['checks'])} checks bit-identical on {where}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"] and len(sys.argv) == 4:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    measure(sys.argv[1])
