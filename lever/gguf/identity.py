"""Model files named quickly: what a profile or a predictor artifact says it was made from.

Hashing the first MiB (header, metadata, tensor table) and the size tells two files apart
without reading a gigabyte; a whole-file hash is kept for artifacts whose fit depends on
every weight.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import attrs

from lever.errors import LeverError

IDENTITY_BYTES = 2**20  # a model file is named by the hash of its first MiB and its size


@attrs.frozen
class ModelIdentity:
    """A model file, named quickly: hashing the first MiB (header, metadata, tensor table)
    and the size tells two files apart without reading a gigabyte."""

    path: str
    size_bytes: int
    sha256_first_mib: str

    @classmethod
    def of(cls, path: str | os.PathLike) -> ModelIdentity:
        p = Path(path)
        try:
            with open(p, "rb") as f:
                head = f.read(IDENTITY_BYTES)
            size = p.stat().st_size
        except OSError as e:
            raise LeverError(f"{p}: cannot read: {e.strerror or e}") from None
        return cls(str(p), size, hashlib.sha256(head).hexdigest())

    def same_file(self, other: ModelIdentity) -> bool:
        """Same bytes, wherever the file now lies."""
        return (self.size_bytes, self.sha256_first_mib) == (other.size_bytes, other.sha256_first_mib)


def file_sha256(path: str | os.PathLike) -> str:
    """The whole file's hash (for artifacts fitted to every weight), leaving it out of the page cache."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
        if hasattr(os, "posix_fadvise"):  # the target lives on flash: do not leave it in the page cache
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return h.hexdigest()
