"""Non-finite numbers (NaN, Inf) in a model's weights, activations, logits and probabilities.

The model core's guard, used by lever.model.transformer and by everything that reads logits
(Accept, Draft, the DRAM loop, `lever logits`): on the hot path one reduction over an array
already computed (`finite`: a NaN anywhere makes the max NaN, an Inf makes the max or the min one), and only once
that fails, the diagnosis that names the file, the model, the position and the layer or tensor at
fault. `scan_tensor` reads one tensor a chunk at a time, for the load-time scan of the small float
tensors (`check_small_tensors`) and `lever inspect --check`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import numpy as np

from lever.backends.cpu import native
from lever.errors import LeverError
from lever.gguf.file import GGUFFile, TensorInfo

SCAN_CHUNK_BYTES = 16 << 20  # of a tensor read at a time: a scan's memory, whatever the model
LOAD_SCAN_ELEMS = 1 << 20  # float tensors up to this many values are scanned at load (norms, biases)
FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16}
# The f16 fields of each block type, as byte offsets in its block: a block's values are these
# scales times small integers (at most 65504 x 63 x 16 in magnitude), so a block holds a NaN or
# an Inf exactly when one of them is not finite, and a scan need not dequantize a clean tensor.
SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
HINT = "`lever inspect --check` lists every tensor that holds any"


def finite(x: np.ndarray) -> bool:
    """Whether x holds no NaN and no Inf, by a max and a min over it (a NaN anywhere makes
    both NaN). Both: the kernels quantize activations by their largest finite magnitude, so a
    row with a -Inf and no NaN goes through the next matmul as finite nonsense, not as NaN."""
    return x.size == 0 or (math.isfinite(x.max()) and math.isfinite(x.min()))


def first_bad_row(x: np.ndarray) -> int | None:
    """The first row of x (n, ...) holding a NaN or an Inf, or None (the diagnosis, not the hot path)."""
    bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
    return int(np.argmax(bad)) if bad.any() else None


def counts(x: np.ndarray) -> tuple[int, int]:
    """(NaNs, Infs) in x."""
    return int(np.isnan(x).sum()), int(np.isinf(x).sum())


def said(n_nan: int, n_inf: int) -> str:
    return " and ".join(s for s in (f"{n_nan} NaN" if n_nan else "", f"{n_inf} Inf" if n_inf else "") if s) or "none"


class NonFiniteError(LeverError):
    """NaN or Inf where a run reads numbers, in one line: which model (target or draft), its file,
    what held them, at which position of the text, and the layer or tensor found at fault."""

    def __init__(self, what: str, *, path=None, role: str = "", position: int | None = None, layer: str = "",
                 cause: str = ""):
        self.what, self.path, self.role = what, path, role
        self.position, self.layer, self.cause = position, layer, cause
        who = " ".join(s for s in (f"{role} model" if role else "", str(path) if path else "") if s)
        line = f"{who}: " if who else ""
        line += f"non-finite {what}"
        if position is not None:
            line += f" at position {position}"
        if layer:
            line += f", {layer}"
        if cause:
            line += f": {cause}"
        super().__init__(line)

    def evolve(self, **changes) -> NonFiniteError:
        """The same error with fields filled in by a caller that knows more (the role, the position)."""
        fields = dict(path=self.path, role=self.role, position=self.position, layer=self.layer, cause=self.cause)
        fields.update({k: v for k, v in changes.items() if v is not None})
        return NonFiniteError(self.what, **fields)


def _chunks(f: GGUFFile, info: TensorInfo) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, rows (n, row_bytes) uint8) of a tensor, read with pread a bounded chunk at a time."""
    row_bytes = info.n_bytes // info.n_rows
    step = max(1, SCAN_CHUNK_BYTES // max(row_bytes, 1))
    for r0 in range(0, info.n_rows, step):
        r1 = min(info.n_rows, r0 + step)
        yield r0, f.read_rows(info.name, r0, r1)


def _chunk_counts(info: TensorInfo, raw: np.ndarray) -> tuple[int, int]:
    t = info.type.name
    if t in FLOAT_DTYPES:
        return counts(raw.view(FLOAT_DTYPES[t]))
    if t == "BF16":  # the top half of a float32
        return counts((raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32))
    offsets = SCALE_OFFSETS.get(t)
    if offsets is not None:
        blocks = raw.reshape(-1, info.type.block_bytes)
        if all(np.isfinite(blocks[:, o : o + 2].copy().view(np.float16)).all() for o in offsets):
            return 0, 0
    return counts(native.dequantize(info.type.ggml_id, raw, raw.shape[0], info.n_cols))


def scan_tensor(f: GGUFFile, name: str) -> tuple[int, int]:
    """(NaNs, Infs) among a tensor's values, read and checked a chunk at a time (bounded memory);
    a block-quantized tensor is dequantized only when one of its scales is not finite."""
    info = f.tensor(name)
    n_nan = n_inf = 0
    for _, raw in _chunks(f, info):
        a, b = _chunk_counts(info, raw)
        n_nan, n_inf = n_nan + a, n_inf + b
    return n_nan, n_inf


def scan(f: GGUFFile, names: Iterable[str] | None = None) -> Iterator[tuple[str, int, int]]:
    """(name, NaNs, Infs) of every tensor of `names` (all, in file order, when None) that holds any."""
    for name in f.tensors if names is None else names:
        n_nan, n_inf = scan_tensor(f, name)
        if n_nan or n_inf:
            yield name, n_nan, n_inf


def first_bad_tensor(f: GGUFFile, names: Iterable[str]) -> str:
    """'tensor X holds 3 NaN' for the first of `names` holding any, else ''. The diagnosis only."""
    for name, n_nan, n_inf in scan(f, names):
        return f"tensor {name} holds {said(n_nan, n_inf)}"
    return ""


def check_small_tensors(f: GGUFFile) -> None:
    """Refuses a file whose small float tensors (norm weights, biases, rope factors, whatever is
    F32, F16 or BF16 and at most LOAD_SCAN_ELEMS values) hold a NaN or an Inf: a model loads
    only a few hundred KiB of them, so the scan is cheap next to loading (docs/measurements.md,
    'Reliability, round 2 (issue 18; 2026-12-02, AMD EPYC Zen 4, 2 vCPUs)'), and a NaN norm
    weight would otherwise pass every other check and make every logit NaN."""
    for info in f.tensors.values():
        if info.type.name not in ("F32", "F16", "BF16") or info.n_rows * info.n_cols > LOAD_SCAN_ELEMS:
            continue
        raw = f.read_rows(info.name, 0, info.n_rows)
        dtype = FLOAT_DTYPES.get(info.type.name)
        if dtype is not None and math.isfinite(raw.view(dtype).max()) and math.isfinite(raw.view(dtype).min()):
            continue  # the common case: two reductions, no copy
        n_nan, n_inf = _chunk_counts(info, raw)
        if n_nan or n_inf:
            raise NonFiniteError("weights", path=f.path, cause=f"tensor {info.name} holds {said(n_nan, n_inf)}; {HINT}")
