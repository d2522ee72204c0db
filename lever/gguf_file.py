"""Opening a GGUF file: the one place Lever touches the format's container.

Everything downstream (model spec, weights, tokenizer, the flash backend's read plans) asks
this module for metadata values and tensor locations. Parsing is gguf-py's (the format's own
reader); this module turns its failures into one-line errors naming the file, and checks each
tensor against the type table in lever.quants so an unsupported type is refused at open time,
not in the middle of a pass.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np

from lever.errors import LeverError
from lever.quants import TypeTraits, traits


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


class GGUFFile:
    """Metadata and tensor table of one GGUF file, with its bytes memory-mapped (not read)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise LeverError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise LeverError(f"{self.path}: is a directory, not a GGUF file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise LeverError(f"{self.path}: not a GGUF file (magic {magic!r})")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except (ValueError, IndexError, KeyError, OverflowError, MemoryError, UnicodeDecodeError) as e:
            raise LeverError(f"{self.path}: corrupt or truncated GGUF: {e}") from None
        self.tensors: dict[str, TensorInfo] = {}
        file_size = self.path.stat().st_size
        for t in self.reader.tensors:
            tt = traits(t.tensor_type)
            if tt is None:
                name = getattr(t.tensor_type, "name", str(t.tensor_type))
                raise LeverError(f"{self.path}: tensor {t.name}: unsupported tensor type {name}")
            shape = tuple(int(d) for d in reversed(t.shape))
            info = TensorInfo(t.name, tt, shape, int(t.data_offset), int(t.n_bytes))
            if info.offset + info.n_bytes > file_size:
                raise LeverError(f"{self.path}: tensor {t.name} extends past the end of the file (truncated?)")
            self.tensors[t.name] = info

    @property
    def arch(self) -> str:
        return self.get_str("general.architecture")

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def get_str(self, key: str) -> str:
        value = self.get(key)
        if value is None:
            raise LeverError(f"{self.path}: missing metadata key {key}")
        return str(value)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise LeverError(f"{self.path}: missing metadata key {key}")
        return value

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a (n_rows, row_bytes) uint8 view of the mapping (no copy)."""
        info = self.tensor(name)
        flat = self.reader.data[info.offset : info.offset + info.n_bytes]
        return flat.reshape(info.n_rows, info.n_bytes // info.n_rows)

    def tensor(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise LeverError(f"{self.path}: missing tensor {name}")
        return info

    def floats(self, name: str) -> np.ndarray:
        """A small float tensor (norm weight, bias) as a float32 array (copied)."""
        info = self.tensor(name)
        from lever import native

        return native.dequantize(info.type.ggml_id, self.raw(name), info.n_rows, info.n_cols).reshape(info.shape)
