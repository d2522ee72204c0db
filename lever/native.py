"""ctypes binding of Lever's native kernels (native/lever_kernels.h).

Every per-token computation of the model core passes through here. The library is built by
the package install (CMake via scikit-build-core) and found beside this module. ctypes
releases the GIL during each call, so a worker thread computing a layer does not block the
thread reading the next one from flash. The numpy references of these kernels live in
lever/reference/; tests compare the two.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from lever.errors import LeverError

ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512", 3: "neon"}
_ERRORS = {-1: "unsupported tensor type", -2: "bad shape", -3: "out of memory"}
_LIB_NAMES = ("liblever_kernels.so", "liblever_kernels.dylib")

_f32p = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
_i32p = np.ctypeslib.ndpointer(np.int32, flags="C_CONTIGUOUS")
_u8p = np.ctypeslib.ndpointer(np.uint8, flags="C_CONTIGUOUS")
_i64 = ctypes.c_int64
_int = ctypes.c_int


def _find_library() -> Path:
    override = os.environ.get("LEVER_NATIVE_LIB")
    if override:
        return Path(override)
    import lever

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
    sig = {
        "lever_isa_best": ([], _int),
        "lever_get_isa": ([], _int),
        "lever_set_isa": ([_int], _int),
        "lever_dequantize": ([_int, ctypes.c_void_p, _i64, _i64, _f32p], _int),
        "lever_matmul": ([_int, ctypes.c_void_p, _i64, _i64, _f32p, _i64, _f32p, _int], _int),
        "lever_rmsnorm": ([_f32p, _f32p, _i64, _i64, ctypes.c_float, _f32p], None),
        "lever_rope": ([_f32p, _i32p, _i64, _i64, _i64, _i64, _f32p, _int, ctypes.c_float], None),
        "lever_attention": (
            [_f32p, _i64, _i64, _i64, ctypes.c_void_p, ctypes.c_void_p, _int, _i64, _i64, _u8p,
             ctypes.c_float, _f32p, _int],
            _int,
        ),
        "lever_swiglu": ([_f32p, _f32p, _i64, _f32p], None),
    }
    for name, (argtypes, restype) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    return lib


_lib = _load()
n_threads_default = 0  # 0: all cores (OpenMP decides)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise LeverError(f"native {what} failed: {_ERRORS.get(rc, rc)}")


def _ptr(buf) -> int:
    """Address of a read-only buffer (numpy array, memmap slice) without copying it."""
    arr = np.asarray(buf)
    if not arr.flags.c_contiguous:
        raise ValueError("weight buffer must be contiguous")
    return arr.ctypes.data


def isa() -> str:
    return ISA_NAMES[_lib.lever_get_isa()]


def best_isa() -> str:
    return ISA_NAMES[_lib.lever_isa_best()]


def set_isa(name: str) -> str:
    code = {v: k for k, v in ISA_NAMES.items()}[name]
    return ISA_NAMES[_lib.lever_set_isa(code)]


def dequantize(type_id: int, data, n_rows: int, n_cols: int) -> np.ndarray:
    out = np.empty((n_rows, n_cols), np.float32)
    _check(_lib.lever_dequantize(type_id, _ptr(data), n_rows, n_cols, out), "dequantize")
    return out


def matmul(type_id: int, w, n_out: int, n_in: int, x: np.ndarray, out: np.ndarray | None = None,
           n_threads: int | None = None) -> np.ndarray:
    """x @ W.T for a weight matrix W stored as n_out rows of n_in in type `type_id`."""
    x = np.ascontiguousarray(x, np.float32)
    n_tok = x.shape[0]
    if out is None:
        out = np.empty((n_tok, n_out), np.float32)
    nt = n_threads_default if n_threads is None else n_threads
    _check(_lib.lever_matmul(type_id, _ptr(w), n_out, n_in, x, n_tok, out, nt), "matmul")
    return out


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    n = x.shape[-1]
    if out is None:
        out = np.empty_like(x)
    _lib.lever_rmsnorm(x, np.ascontiguousarray(w, np.float32), x.size // n, n, eps, out)
    return out


def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, inv_freq: np.ndarray, neox: bool,
         attn_factor: float = 1.0) -> None:
    """In place on x: (n_tok, n_head, head_dim)."""
    assert x.flags.c_contiguous and x.dtype == np.float32
    n_tok, n_head, head_dim = x.shape
    _lib.lever_rope(x, np.ascontiguousarray(pos, np.int32), n_tok, n_head, head_dim, n_rot,
                    np.ascontiguousarray(inv_freq, np.float32), int(neox), attn_factor)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float,
              out: np.ndarray | None = None, n_threads: int | None = None) -> np.ndarray:
    """q: (n_tok, n_head, hd); k, v: (n_kv, n_kv_head, hd) f32 or f16; mask: (n_tok, n_kv) bool."""
    q = np.ascontiguousarray(q, np.float32)
    n_tok, n_head, hd = q.shape
    n_kv, n_kv_head, _ = k.shape
    kv_type = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}[k.dtype]
    assert k.dtype == v.dtype and k.flags.c_contiguous and v.flags.c_contiguous
    if out is None:
        out = np.empty_like(q)
    nt = n_threads_default if n_threads is None else n_threads
    m = np.ascontiguousarray(mask, np.uint8)
    _check(_lib.lever_attention(q, n_tok, n_head, hd, k.ctypes.data, v.ctypes.data, kv_type,
                                n_kv, n_kv_head, m, scale, out, nt), "attention")
    return out


def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    gate = np.ascontiguousarray(gate, np.float32)
    up = np.ascontiguousarray(up, np.float32)
    if out is None:
        out = np.empty_like(gate)
    _lib.lever_swiglu(gate, up, gate.size, out)
    return out


