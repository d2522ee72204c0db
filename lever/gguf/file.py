"""Opening a GGUF file: the one place Lever touches the format's container.

Everything downstream (model spec, weights, tokenizer, the flash backend's read plans) asks
this module for metadata values and tensor locations. The header is parsed here, with gguf-py's
type tables, rather than by gguf-py's reader: that reader makes two numpy arrays per vocabulary
string, which for a Qwen-sized vocabulary is more peak RSS than a phone can spare for metadata
(docs/measurements.md, 'Opening a GGUF: vocabulary strings'). Here a string array becomes a list
of str and a numeric array a zero-copy view of the mapped file. Every count, length and offset
is checked against the file's size before it is used, and no two tensors may share bytes, so a
corrupt or truncated file gives one line naming the file and the field, never a huge allocation
or a crash. What the values mean (sizes, shapes, the vocabulary) is checked where they are
used: model_spec, model and tokenizer. Tensor data is never read here: it stays mapped until
used.
"""

from __future__ import annotations

import itertools
import os
import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from gguf import GGMLQuantizationType
from gguf import GGUFValueType as VT

from lever.errors import LeverError, regular_file, shown
from lever.gguf.types import TypeTraits, traits

_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16}  # small tensors read without the kernels
DEFAULT_ALIGNMENT = 32  # GGUF's alignment when general.alignment is absent
MAX_DIMS = 4  # ggml tensors have at most four dimensions
_SCALARS: dict[VT, np.dtype] = {
    VT.UINT8: np.dtype("<u1"), VT.INT8: np.dtype("<i1"), VT.UINT16: np.dtype("<u2"), VT.INT16: np.dtype("<i2"),
    VT.UINT32: np.dtype("<u4"), VT.INT32: np.dtype("<i4"), VT.FLOAT32: np.dtype("<f4"), VT.BOOL: np.dtype("<u1"),
    VT.UINT64: np.dtype("<u8"), VT.INT64: np.dtype("<i8"), VT.FLOAT64: np.dtype("<f8"),
}


@attrs.frozen
class TensorInfo:
    name: str
    type: TypeTraits
    shape: tuple[int, ...]  # numpy order: (n_rows, n_cols) for a matrix, GGUF dims reversed
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def n_cols(self) -> int:
        return self.shape[-1]


class _Cursor:
    """Reads little-endian values from the mapped header, checking every length first."""

    def __init__(self, data: np.ndarray, path: Path):
        self.data, self.path, self.pos = data, path, 0
        self.size = data.size
        self.where = "header"

    def fail(self, why: str) -> LeverError:
        return LeverError(f"{self.path}: corrupt or truncated GGUF: {self.where}: {why}")

    def take(self, n: int) -> np.ndarray:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"needs {n} bytes at offset {self.pos}, file has {self.size}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, vt: VT):
        dt = _SCALARS[vt]
        v = self.take(dt.itemsize).view(dt)[0].item()
        return bool(v) if vt == VT.BOOL else v

    def u32(self) -> int:
        return self.scalar(VT.UINT32)

    def u64(self) -> int:
        return self.scalar(VT.UINT64)

    def string(self) -> str:
        n = self.u64()
        return self.take(n).tobytes().decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row: a vocabulary's 150,000 tokens and merges. One pass over a
        memoryview, not a numpy slice per field: those slices made opening a Qwen-sized GGUF a
        large part of the wait for the first token (docs/measurements.md,
        'The app engine: chat turns, first tokens, long prompts (issue 17)', cold start)."""
        view = memoryview(self.data)
        unpack, size, pos = struct.Struct("<Q").unpack_from, self.size, self.pos
        out = []
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(f"needs 8 bytes at offset {pos}, file has {size}")
            (n,) = unpack(view, pos)
            if n > size - pos - 8:
                self.pos = pos + 8
                raise self.fail(f"needs {n} bytes at offset {pos + 8}, file has {size}")
            out.append(str(view[pos + 8 : pos + 8 + n], "utf-8", "replace"))
            pos += 8 + n
        self.pos = pos
        return out

    def value_type(self) -> VT:
        code = self.u32()
        try:
            return VT(code)
        except ValueError:
            raise self.fail(f"unknown value type {code}") from None

    def value(self, vt: VT) -> Any:
        if vt == VT.STRING:
            return self.string()
        if vt == VT.ARRAY:
            elem, count = self.value_type(), self.u64()
            if elem == VT.STRING:
                if count > (self.size - self.pos) // 8:  # every string costs at least its 8-byte length
                    raise self.fail(f"array of {count} strings cannot fit in the file")
                return self.strings(count)
            if elem == VT.ARRAY:
                raise self.fail("nested arrays are not supported")
            dt = _SCALARS[elem]
            arr = self.take(count * dt.itemsize).view(dt)
            return arr.astype(bool) if elem == VT.BOOL else arr
        return self.scalar(vt)


class GGUFFile:
    """Metadata and tensor table of one GGUF file, with its bytes memory-mapped (not read)."""

    def __init__(self, path: str | os.PathLike):
        self.path = regular_file(path, "file")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise LeverError(f"{self.path}: not a GGUF file (magic {magic!r})")
        self.data = np.memmap(self.path, np.uint8, mode="r", shape=(size,))
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse(_Cursor(self.data, self.path))

    def _parse(self, c: _Cursor) -> None:
        c.take(4)
        self.version = c.u32()
        if self.version not in (2, 3):
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            if swapped in (1, 2, 3):  # e.g. 50331648 = 0x03000000: llama.cpp's big-endian (s390x) files
                raise LeverError(f"{self.path}: big-endian GGUF (version {swapped} byte-swapped), which Lever "
                                 f"does not read (it reads little-endian GGUF 2 and 3)")
            raise c.fail(f"version {self.version} is not supported (2 and 3 are)")
        n_tensors, n_kv = c.u64(), c.u64()
        if n_kv > c.size // 12 or n_tensors > c.size // 24:  # each entry takes at least that many bytes
            raise c.fail(f"{n_kv} metadata entries / {n_tensors} tensors cannot fit in {c.size} bytes")
        for i in range(n_kv):
            c.where = f"metadata entry {i}"
            key = c.string()
            c.where = f"metadata key {shown(key)}"
            if key in self.metadata:
                raise c.fail("duplicate key")
            self.metadata[key] = c.value(c.value_type())
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        is_int = isinstance(alignment, int) and not isinstance(alignment, bool)
        if not is_int or alignment <= 0 or alignment & (alignment - 1):
            c.where = "metadata key general.alignment"
            raise c.fail(f"{shown(repr(alignment))} is not a power of two")
        raw = []
        for i in range(n_tensors):
            c.where = f"tensor info {i}"
            name = c.string()
            c.where = f"tensor {shown(name)}"
            n_dims = c.u32()
            if not 1 <= n_dims <= MAX_DIMS:
                raise c.fail(f"{n_dims} dimensions")
            dims = [c.u64() for _ in range(n_dims)]
            raw.append((name, dims, c.u32(), c.u64(), c.where))
        data_start = -(-c.pos // alignment) * alignment
        for name, dims, type_id, rel, where in raw:
            c.where = where
            self._add_tensor(c, name, dims, type_id, data_start + rel, alignment)
        self._check_overlaps()

    def _check_overlaps(self) -> None:
        # two tensors sharing bytes: a crafted file's way to alias weights, never a converter's
        spans = sorted((t.offset, t.offset + t.n_bytes, t.name) for t in self.tensors.values())
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            if start < end:
                raise LeverError(f"{self.path}: corrupt GGUF: tensor {shown(b)}: data at offset {start} overlaps "
                                 f"tensor {shown(a)}, which ends at {end}")

    def _add_tensor(self, c: _Cursor, name: str, dims: list[int], type_id: int, offset: int, alignment: int) -> None:
        tt = traits(type_id)
        if tt is None:

            try:
                tname = GGMLQuantizationType(type_id).name
            except ValueError:
                tname = f"#{type_id}"
            raise LeverError(f"{self.path}: tensor {shown(name)}: unsupported tensor type {tname}")
        n_elems = 1
        for d in dims:
            if d <= 0 or d > c.size * tt.block_elems:
                raise c.fail(f"dimension {d} out of range")
            n_elems *= d
            if n_elems > c.size * tt.block_elems:  # more elements than the file could hold
                raise c.fail(f"{dims} elements cannot fit in the file")
        if dims[0] % tt.block_elems:
            raise c.fail(f"row of {dims[0]} is not a multiple of {tt.name}'s block of {tt.block_elems}")
        n_bytes = n_elems // tt.block_elems * tt.block_bytes
        if offset % alignment:
            raise c.fail(f"data offset {offset} is not aligned to {alignment}")
        if offset + n_bytes > c.size:
            raise c.fail(f"data [{offset}, {offset + n_bytes}) extends past the end of the file ({c.size} bytes)")
        if name in self.tensors:
            raise c.fail("duplicate tensor name")
        self.tensors[name] = TensorInfo(name, tt, tuple(reversed(dims)), offset, n_bytes)

    @property
    def arch(self) -> str:
        return self.get_str("general.architecture")

    def has(self, key: str) -> bool:
        return key in self.metadata

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def get_str(self, key: str) -> str:
        value = self.metadata.get(key)
        if not isinstance(value, str):
            raise LeverError(f"{self.path}: missing metadata key {key}" if value is None
                             else f"{self.path}: metadata key {key} is not a string")
        return value

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a (n_rows, row_bytes) uint8 view of the mapping (no copy)."""
        info = self.tensor(name)
        flat = self.data[info.offset : info.offset + info.n_bytes]
        return flat.reshape(info.n_rows, info.n_bytes // info.n_rows)

    def read_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) of a tensor read from the file with pread, not faulted in through the
        mapping: (r1 - r0, row_bytes) uint8 in anonymous memory. A model made resident is read
        this way, so a file truncated or replaced meanwhile is an error here, not a SIGBUS when
        a weight is next touched, and its pages do not stay in this process's RSS."""
        info = self.tensor(name)
        row_bytes = info.n_bytes // info.n_rows
        out = np.empty((r1 - r0, row_bytes), np.uint8)
        start, want, got = info.offset + r0 * row_bytes, out.nbytes, 0
        buf = memoryview(out.reshape(-1))
        try:
            with open(self.path, "rb", buffering=0) as f:
                while got < want:  # a regular file returns less only at its end
                    n = os.preadv(f.fileno(), [buf[got:]], start + got)
                    if n <= 0:
                        break
                    got += n
        except OSError as e:
            raise LeverError(f"{self.path}: cannot read tensor {name}: {e.strerror or e}") from None
        if got != want:
            raise LeverError(f"{self.path}: tensor {name}: read {got} of {want} bytes at offset {start}: "
                             f"truncated or replaced since it was opened")
        return out

    def tensor(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise LeverError(f"{self.path}: missing tensor {name}")
        return info

    def floats(self, name: str) -> np.ndarray:
        """A small float tensor (norm weight, rope factors) as a float32 array (copied). These are
        stored as F32 (or F16, BF16) by every converter; a quantized one is refused, not dequantized here
        (the kernels sit above the file format)."""
        info = self.tensor(name)
        raw = self.raw(name)
        if info.type.name == "BF16":  # the top half of a float32
            return (np.array(raw.view(np.uint16), dtype=np.uint32) << 16).view(np.float32).reshape(info.shape)
        dtype = _FLOAT_DTYPES.get(info.type.name)
        if dtype is None:
            raise LeverError(f"{self.path}: tensor {name} is {info.type.name}; a norm or factor tensor must be "
                             f"F32, F16 or BF16")
        return np.array(raw.view(dtype), dtype=np.float32).reshape(info.shape)  # a copy, not a memmap
