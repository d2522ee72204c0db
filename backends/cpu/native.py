"""ctypes binding of Lever's native kernels (native/lever_kernels.h).

Every per-token computation of the model core passes through here. The library is built by
the package install (CMake via scikit-build-core) and found beside this module. ctypes
releases the GIL during each call, so a worker thread computing a layer does not block the
thread reading the next one from flash. The numpy references of these kernels live in
lever/model/reference/; tests compare the two.
"""

from __future__ import annotations

import ctypes
import os
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import lever
from lever.errors import LeverError

ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512", 3: "neon"}
# Weight layouts (enum lever_layout): GGUF's rows, or Lever's tiles of TILE_ROWS interleaved rows.
ROWS, TILES = 0, 1
TILE_ROWS = 16
_ERRORS = {-1: "unsupported tensor type", -2: "bad shape", -3: "out of memory"}
_LIB_NAMES = ("liblever_kernels.so", "liblever_kernels.dylib")

_vp = ctypes.c_void_p
_i64 = ctypes.c_int64
_int = ctypes.c_int


def _find_library() -> Path:
    override = os.environ.get("LEVER_NATIVE_LIB")
    if override:
        return Path(override)

    for base in lever.__path__:
        for name in _LIB_NAMES:
            if (Path(base) / name).is_file():
                return Path(base) / name
    raise LeverError(
        "native kernels not built: liblever_kernels not found beside the lever package; "
        "install with `pip install -e .`"
    )


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_find_library()))
    # Arrays pass as raw addresses: numpy's ndpointer checks cost time on every argument of every
    # call, and a decode step makes hundreds of calls (docs/measurements.md, 'ctypes call overhead').
    # The wrappers below check dtype and layout instead.
    sig = {
        "lever_isa_best": ([], _int),
        "lever_get_isa": ([], _int),
        "lever_set_isa": ([_int], _int),
        "lever_dequantize": ([_int, _vp, _i64, _i64, _vp], _int),
        "lever_matmul": ([_int, _int, _vp, _i64, _i64, _vp, _i64, _vp, _int], _int),
        "lever_tiled_bytes": ([_int, _i64, _i64], _i64),
        "lever_pack": ([_int, _vp, _i64, _i64, _vp, _int], _int),
        "lever_unpack_rows": ([_int, _vp, _i64, _i64, _vp, _i64, _vp], _int),
        "lever_type_layout": ([_int, _vp, _vp, _vp], _int),
        "lever_matmul_many": ([_int, _vp, _vp, _i64, _int], _int),
        "lever_layer_forward": ([_vp, _vp, _vp, _i64, _vp, _vp, _i64, _vp, _vp, _int, _vp, _int], _int),
        "lever_struct_sizes": ([_vp], None),
        "lever_rmsnorm": ([_vp, _vp, _i64, _i64, ctypes.c_float, _vp], None),
        "lever_rope": ([_vp, _vp, _i64, _i64, _i64, _i64, _vp, _int, ctypes.c_float], None),
        "lever_attention": ([_vp, _i64, _i64, _i64, _vp, _vp, _int, _i64, _i64, _vp, ctypes.c_float, _vp, _int], _int),
        "lever_swiglu": ([_vp, _vp, _i64, _vp], None),
        "lever_top_k": ([_vp, _i64, _i64, _int, _vp, _vp], _int),
    }
    for name, (argtypes, restype) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    return lib


class Matrix(ctypes.Structure):
    """lever_matrix: one weight matrix and where its product goes."""

    _fields_ = [("type", _int), ("layout", _int), ("w", _vp), ("n_out", _i64), ("n_in", _i64), ("y", _vp)]


class LayerDims(ctypes.Structure):
    """lever_layer_dims: a model's layer shape, shared by its layers."""

    _fields_ = [("n_embd", _i64), ("n_head", _i64), ("n_head_kv", _i64), ("head_dim", _i64), ("n_ff", _i64),
                ("n_rot", _i64), ("rms_eps", ctypes.c_float), ("attn_scale", ctypes.c_float), ("rope_neox", _int),
                ("inv_freq", _vp)]


class LayerWeightsC(ctypes.Structure):
    """lever_layer_weights: the addresses of one layer's tensors (kept alive by their owner)."""

    _fields_ = [(n, _vp) for n in ("attn_norm", "ffn_norm", "bq", "bk", "bv", "q_norm", "k_norm")] + \
               [(n, Matrix) for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]


_lib = _load()
n_threads_default = 0  # 0: all cores; set through default_threads
_local = threading.local()
_open_defaults: list[list[int]] = []  # the default_threads blocks open now, in any thread, latest last
_base_default = 0  # n_threads_default before the first of them opened
_defaults_lock = threading.Lock()


@contextmanager
def default_threads(n: int):
    """Kernel threads for every call in the process inside the block (0: leave as it is):
    `[runtime] threads` or `--threads` for one command or one run. Blocks may overlap across
    threads (a server's request thread, lever.api's stream thread, beside a run in the main
    thread): the latest block still open holds, and when the last one ends the process is back
    where it was. Each block ends only itself; a block that sets nothing changes nothing, even
    when it ends inside another thread's."""
    global n_threads_default, _base_default
    if not n:
        yield
        return
    mine = [n]
    with _defaults_lock:
        if not _open_defaults:
            _base_default = n_threads_default
        _open_defaults.append(mine)
        n_threads_default = n
    try:
        yield
    finally:
        with _defaults_lock:
            del _open_defaults[next(i for i, b in enumerate(_open_defaults) if b is mine)]
            n_threads_default = _open_defaults[-1][0] if _open_defaults else _base_default


@contextmanager
def threads(n: int):
    """Kernel threads for the calls this thread makes inside the block (0: the process default,
    all cores unless `default_threads` says otherwise). Drafting ahead runs on one core so that
    the reads it overlaps are not starved of CPU."""
    prev = getattr(_local, "n", None)
    _local.n = n
    try:
        yield
    finally:
        _local.n = prev


def _threads(n_threads: int | None) -> int:
    if n_threads is not None:
        return n_threads
    local = getattr(_local, "n", None)
    return local or n_threads_default


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise LeverError(f"native {what} failed: {_ERRORS.get(rc, rc)}")


def _ptr(buf) -> int:
    """Address of a contiguous buffer (numpy array, memmap slice) without copying it."""
    arr = buf if isinstance(buf, np.ndarray) else np.asarray(buf)
    if not arr.flags.c_contiguous:
        raise ValueError("buffer must be contiguous")
    return arr.__array_interface__["data"][0]


def _addr(a: np.ndarray, dtype) -> int:
    """Address of an array the kernel reads or writes as `dtype`, checked."""
    if a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"expected a contiguous {np.dtype(dtype).name} array, got {a.dtype} {a.shape}")
    return a.__array_interface__["data"][0]


def _f32(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous else \
        np.ascontiguousarray(a, np.float32)


def isa() -> str:
    return ISA_NAMES[_lib.lever_get_isa()]


def best_isa() -> str:
    return ISA_NAMES[_lib.lever_isa_best()]


def set_isa(name: str) -> str:
    code = {v: k for k, v in ISA_NAMES.items()}[name]
    return ISA_NAMES[_lib.lever_set_isa(code)]


def dequantize(type_id: int, data, n_rows: int, n_cols: int) -> np.ndarray:
    out = np.empty((n_rows, n_cols), np.float32)
    _check(_lib.lever_dequantize(type_id, _ptr(data), n_rows, n_cols, _addr(out, np.float32)), "dequantize")
    return out


def tiled_bytes(type_id: int, n_out: int, n_in: int) -> int:
    """Bytes of an (n_out, n_in) matrix in the tile layout (whole tiles, zero rows padding)."""
    n = _lib.lever_tiled_bytes(type_id, n_out, n_in)
    if n <= 0 and n_out > 0:
        raise LeverError(f"native tiled_bytes failed: unsupported type {type_id} or shape ({n_out}, {n_in})")
    return n


def pack(type_id: int, w, n_out: int, n_in: int, out: np.ndarray | None = None,
         n_threads: int | None = None) -> np.ndarray:
    """The row-layout matrix w in the tile layout: a flat uint8 array of tiled_bytes(...)."""
    size = tiled_bytes(type_id, n_out, n_in)
    if out is None:
        out = np.empty(size, np.uint8)
    if out.nbytes != size or not out.flags.c_contiguous:
        raise ValueError(f"pack: output of {out.nbytes} bytes for a tiled matrix of {size}")
    _check(_lib.lever_pack(type_id, _ptr(w), n_out, n_in, _ptr(out), _threads(n_threads)), "pack")
    return out


def unpack_rows(type_id: int, tiled, n_out: int, n_in: int, rows: np.ndarray) -> np.ndarray:
    """Rows (ids < n_out) of a tiled matrix, back in the row layout: (len(rows), row_bytes) uint8."""
    rows = np.ascontiguousarray(rows, np.int64)
    row_bytes = tiled_bytes(type_id, 1, n_in) // TILE_ROWS
    out = np.empty((rows.size, row_bytes), np.uint8)
    _check(_lib.lever_unpack_rows(type_id, _ptr(tiled), n_out, n_in, _addr(rows, np.int64), rows.size,
                                  _addr(out, np.uint8)), "unpack_rows")
    return out


def type_layout(type_id: int) -> tuple[int, int, tuple[tuple[int, int, int], ...]]:
    """The C type table's row: (block, block_bytes, tile segments as (offset, bytes, width))."""
    block, nbytes, seg = ctypes.c_int(), ctypes.c_int(), (ctypes.c_int * 9)()
    n = _lib.lever_type_layout(type_id, ctypes.byref(block), ctypes.byref(nbytes), seg)
    _check(min(n, 0), "type_layout")
    return block.value, nbytes.value, tuple(tuple(seg[3 * i: 3 * i + 3]) for i in range(n))


def matmul(type_id: int, w, n_out: int, n_in: int, x: np.ndarray, out: np.ndarray | None = None,
           n_threads: int | None = None, layout: int = ROWS) -> np.ndarray:
    """x @ W.T for a weight matrix W stored as n_out rows of n_in in type `type_id`, in the row
    layout or (layout=TILES) as pack() made it."""
    x = _f32(x)
    n_tok = x.size // n_in
    if x.size != n_tok * n_in:
        raise ValueError(f"matmul: activations of {x.size} values are not rows of {n_in}")
    if out is None:
        out = np.empty((n_tok, n_out), np.float32)
    nt = _threads(n_threads)
    _check(_lib.lever_matmul(type_id, layout, _ptr(w), n_out, n_in, _addr(x, np.float32), n_tok,
                             _addr(out, np.float32), nt), "matmul")
    return out


def struct_sizes() -> tuple[int, int, int]:
    """sizeof(lever_matrix, lever_layer_dims, lever_layer_weights) as the library sees them."""
    out = np.zeros(3, np.int64)
    _lib.lever_struct_sizes(_addr(out, np.int64))
    return tuple(int(v) for v in out)


def matrix(type_id: int, w, n_out: int, n_in: int, layout: int = ROWS) -> Matrix:
    return Matrix(type_id, layout, _ptr(w), n_out, n_in, None)


def matmul_many(mats: list[Matrix], x: np.ndarray, n_threads: int | None = None) -> list[np.ndarray]:
    """x @ W.T for each matrix (same n_in), in one job of the thread pool, x quantized once."""
    x = _f32(x)
    n_in = mats[0].n_in
    n_tok = x.size // n_in
    if x.size != n_tok * n_in:
        raise ValueError(f"matmul_many: activations of {x.size} values are not rows of {n_in}")
    outs = [np.empty((n_tok, m.n_out), np.float32) for m in mats]
    arr = (Matrix * len(mats))(*mats)
    for m, y in zip(arr, outs):
        m.y = _addr(y, np.float32)
    _check(_lib.lever_matmul_many(len(mats), ctypes.addressof(arr), _addr(x, np.float32), n_tok, _threads(n_threads)),
           "matmul_many")
    return outs


def layer_forward(dims: LayerDims, weights: LayerWeightsC, x: np.ndarray, *, pos: np.ndarray, mask: np.ndarray,
                  k_cache: np.ndarray, v_cache: np.ndarray, rows: np.ndarray,
                  n_threads: int | None = None) -> np.ndarray:
    """lever_layer_forward: the layer's output for x (n_tok, n_embd), a new array; the tokens' k, v
    go to cache rows `rows` (int64, one per token); attention sees rows [0, mask.shape[1])."""
    out = np.array(x, np.float32, order="C")  # a copy: x is the caller's
    n_tok = out.shape[0]
    if pos.dtype != np.int32 or rows.dtype != np.int64 or pos.size != n_tok or rows.size != n_tok:
        raise ValueError("layer_forward: pos (int32) and rows (int64) need one entry per token")
    if mask.shape[0] != n_tok or mask.shape[1] > k_cache.shape[0] or k_cache.shape != v_cache.shape:
        raise ValueError(f"layer_forward: mask {mask.shape} for {n_tok} tokens over a cache of {k_cache.shape[0]} rows")
    if rows.size and (rows.min() < 0 or rows.max() >= k_cache.shape[0]):
        raise ValueError("layer_forward: a row is outside the cache")
    as_is = mask.dtype == np.bool_ and mask.flags.c_contiguous
    m = mask.view(np.uint8) if as_is else np.ascontiguousarray(mask, np.uint8)
    _check(_lib.lever_layer_forward(ctypes.addressof(dims), ctypes.addressof(weights), _addr(out, np.float32), n_tok,
                                    _addr(pos, np.int32), _addr(m, np.uint8), m.shape[1], _addr(k_cache, k_cache.dtype),
                                    _addr(v_cache, v_cache.dtype), _KV_TYPES[k_cache.dtype], _addr(rows, np.int64),
                                    _threads(n_threads)), "layer_forward")
    return out


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    x, w = _f32(x), _f32(w)
    n = x.shape[-1]
    if w.size != n:
        raise ValueError(f"rmsnorm: weight of {w.size} for rows of {n}")
    if out is None:
        out = np.empty_like(x)
    _lib.lever_rmsnorm(_addr(x, np.float32), _addr(w, np.float32), x.size // n, n, eps, _addr(out, np.float32))
    return out


def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, inv_freq: np.ndarray, neox: bool,
         attn_factor: float = 1.0) -> None:
    """In place on x: (n_tok, n_head, head_dim)."""
    n_tok, n_head, head_dim = x.shape
    pos = np.ascontiguousarray(pos, np.int32)
    inv_freq = _f32(inv_freq)
    if pos.size != n_tok or inv_freq.size < n_rot // 2:
        raise ValueError("rope: positions or frequencies do not match x")
    _lib.lever_rope(_addr(x, np.float32), _addr(pos, np.int32), n_tok, n_head, head_dim, n_rot,
                    _addr(inv_freq, np.float32), int(neox), attn_factor)


_KV_TYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float,
              out: np.ndarray | None = None, n_threads: int | None = None) -> np.ndarray:
    """q: (n_tok, n_head, hd); k, v: (n_kv, n_kv_head, hd) f32 or f16; mask: (n_tok, n_kv) bool."""
    q = _f32(q)
    n_tok, n_head, hd = q.shape
    n_kv, n_kv_head, _ = k.shape
    if k.dtype != v.dtype or k.shape != v.shape or k.dtype not in _KV_TYPES:
        raise ValueError("attention: k and v must share a shape and a float32/float16 dtype")
    if mask.shape != (n_tok, n_kv):
        raise ValueError(f"attention: mask {mask.shape} for {n_tok} tokens over {n_kv} rows")
    if out is None:
        out = np.empty_like(q)
    as_is = mask.dtype == np.bool_ and mask.flags.c_contiguous
    m = mask.view(np.uint8) if as_is else np.ascontiguousarray(mask, np.uint8)
    nt = _threads(n_threads)
    _check(_lib.lever_attention(_addr(q, np.float32), n_tok, n_head, hd, _addr(k, k.dtype), _addr(v, v.dtype),
                                _KV_TYPES[k.dtype], n_kv, n_kv_head, _addr(m, np.uint8), scale,
                                _addr(out, np.float32), nt), "attention")
    return out


def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    gate, up = _f32(gate), _f32(up)
    if gate.size != up.size:
        raise ValueError("swiglu: gate and up differ in size")
    if out is None:
        out = np.empty_like(gate)
    _lib.lever_swiglu(_addr(gate, np.float32), _addr(up, np.float32), gate.size, _addr(out, np.float32))
    return out


def top_k(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest of each row of x (n, m): ids (n, k) int64 and values (n, k) float32, by
    falling value, ties to the lower index; NaN is never chosen."""
    x = _f32(x).reshape(-1, x.shape[-1])
    ids, vals = np.empty((x.shape[0], k), np.int64), np.empty((x.shape[0], k), np.float32)
    _check(_lib.lever_top_k(_addr(x, np.float32), x.shape[0], x.shape[1], k, _addr(ids, np.int64),
                            _addr(vals, np.float32)), "top_k")
    return ids, vals
