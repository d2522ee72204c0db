"""`lever convert IN.gguf OUT.gguf`: rewrite a model so every tensor starts on a page boundary.

The flash backend reads each streamed layer with O_DIRECT, which transfers whole aligned
blocks. In a GGUF written with the usual 32-byte alignment a layer starts and ends mid-page,
so every read carries rounding slack; with `general.alignment` = 4096 a layer's tensors are a
run of whole pages and a read is exactly the layer. The metadata and tensor bytes are copied
unchanged (through gguf-py, the format's own writer), and the result is read back and
compared before it replaces OUT.

Every input is first read by Lever's own checked loader (lever.gguf.file.GGUFFile), so a file
Lever refuses (five dimensions, misaligned data, a crafted count) is refused here with the
same line instead of being rewritten into one that looks converted; the output is read back by
it too. OUT is written through lever.outputs: a temp file beside it, named with the pid, renamed
into place, removed on any exception or signal, and reaped by the next convert if the process
was killed outright.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
from gguf import GGUFValueType as VT

from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.outputs import atomic_path, writable_destination

ALIGNMENT_KEY = "general.alignment"
# Tensor alignment a convert may ask for: GGUF's own default is 32 (below it, gguf-py and
# llama.cpp assume 32); O_DIRECT, what this rewrite is for, needs the 4096-byte page; 64 KiB
# covers every page size a phone or a server uses (arm64's largest is 64 KiB). Anything larger
# only adds padding - up to the alignment per tensor, gigabytes at 1 GiB - and helps no read.
MIN_ALIGNMENT = 32
MAX_ALIGNMENT = 65536


def check_alignment(alignment) -> None:
    if (isinstance(alignment, bool) or not isinstance(alignment, int) or not MIN_ALIGNMENT <= alignment <= MAX_ALIGNMENT
            or alignment & (alignment - 1)):
        raise LeverError(f"alignment must be a power of two in [{MIN_ALIGNMENT}, {MAX_ALIGNMENT}] bytes "
                         f"(4096 for O_DIRECT), got {alignment!r}")


class _Writer(gguf.GGUFWriter):
    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
        # gguf-py refuses empty arrays; the format allows them and a faithful copy keeps them.
        if vtype == VT.ARRAY and len(val) == 0:
            head = self._pack("I", vtype) if add_vtype else b""
            return head + self._pack("I", sub_type) + self._pack("Q", 0)
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def _is_virtual(key: str) -> bool:
    return key.startswith("GGUF.")  # the reader's view of the header, not stored KV pairs


def _field_value(path: Path, field) -> tuple[object, VT, VT | None]:
    """(value, type, array item type) from the field's own bytes: strings stay bytes, so a
    value that is not valid UTF-8 is still copied as it was."""
    vtype = VT(field.types[0])
    if vtype == VT.STRING:
        return field.parts[field.data[0]].tobytes(), vtype, None
    if vtype != VT.ARRAY:
        return field.parts[field.data[0]][0].item(), vtype, None
    item_type = VT(int(field.parts[3][0]))  # parts: key length, key, type, item type, count, items
    if item_type == VT.ARRAY:
        raise LeverError(f"{path}: metadata key {field.name}: nested arrays are not supported")
    if item_type == VT.STRING:
        return [field.parts[i].tobytes() for i in field.data], vtype, item_type
    return [field.parts[i][0].item() for i in field.data], vtype, item_type


def _record_bytes(field) -> bytes:
    return b"".join(p.tobytes() for p in field.parts)


def _read(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except (OSError, ValueError, IndexError, KeyError, OverflowError) as e:
        raise LeverError(f"{path}: cannot read as GGUF: {e}") from None


def _write(reader: gguf.GGUFReader, src: Path, dst: Path, alignment: int) -> None:
    w = _Writer(dst, "", endianess=reader.endianess)
    w.kv_data[0].clear()  # re-added below in the input's order, architecture included
    for key, field in reader.fields.items():
        if _is_virtual(key):
            continue
        if key == ALIGNMENT_KEY:
            w.add_uint32(key, alignment)
            continue
        value, vtype, item_type = _field_value(src, field)
        w.add_key_value(key, value, vtype, sub_type=item_type)
    if ALIGNMENT_KEY not in reader.fields:
        w.add_uint32(ALIGNMENT_KEY, alignment)
    w.data_alignment = alignment
    for t in reader.tensors:
        # Shape in numpy order (GGUF dims reversed), as add_tensor_info expects; any dtype but
        # uint8 makes it take the shape as elements, not as bytes to convert.
        shape = [int(d) for d in reversed(t.shape.tolist())]
        w.add_tensor_info(t.name, shape, np.dtype(np.float32), int(t.n_bytes), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in reader.tensors:
        w.write_tensor_data(t.data, tensor_endianess=reader.endianess)  # bytes as they were
    w.close()


def _verify(src: gguf.GGUFReader, out_path: Path, alignment: int) -> None:
    out = _read(out_path)

    def fail(what: str) -> LeverError:
        return LeverError(f"{out_path}: converted file differs from the input: {what}")

    keys_in = [k for k in src.fields if not _is_virtual(k) and k != ALIGNMENT_KEY]
    keys_out = [k for k in out.fields if not _is_virtual(k) and k != ALIGNMENT_KEY]
    if keys_in != keys_out:
        raise fail(f"metadata keys {sorted(set(keys_in) ^ set(keys_out)) or 'order'}")
    for k in keys_in:
        if _record_bytes(src.fields[k]) != _record_bytes(out.fields[k]):
            raise fail(f"metadata key {k}")
    if out.alignment != alignment:
        raise fail(f"{ALIGNMENT_KEY} is {out.alignment}, expected {alignment}")
    if [t.name for t in src.tensors] != [t.name for t in out.tensors]:
        raise fail("tensor names or order")
    for a, b in zip(src.tensors, out.tensors):
        if a.tensor_type != b.tensor_type or a.shape.tolist() != b.shape.tolist():
            raise fail(f"tensor {a.name}: type or shape")
        if b.data_offset % alignment:
            raise fail(f"tensor {b.name} starts at {b.data_offset}, not a multiple of {alignment}")
        if not np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)):
            raise fail(f"tensor {a.name}: bytes")


def convert(in_path: str | os.PathLike, out_path: str | os.PathLike, alignment: int = 4096) -> None:
    """Write in_path's model to out_path with every tensor aligned to `alignment` bytes."""
    src, dst = Path(in_path), Path(out_path)
    check_alignment(alignment)
    writable_destination(dst, "output")
    GGUFFile(src)  # Lever's checked loader first: what Lever refuses, convert refuses, in the same line
    reader = _read(src)
    # Written beside the destination and renamed into place, so a failure (disk full, a
    # mismatch on reading back, Ctrl-C, SIGTERM) never leaves a half-written OUT nor the
    # temp file - and IN may equal OUT.
    with atomic_path(dst, "output") as tmp:
        try:
            _write(reader, src, tmp, alignment)
        except OSError as e:
            raise LeverError(f"{dst}: cannot write: {e.strerror or e}") from None
        except ValueError as e:
            raise LeverError(f"{src}: cannot convert: {e}") from None
        _verify(reader, tmp, alignment)
        GGUFFile(tmp)  # and what it wrote is a file Lever loads
