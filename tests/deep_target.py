"""A deep target for the tests: every block of a GGUF, then copies that add nothing.

Each source block is followed by `factor - 1` copies whose two projections into the residual
stream (attention output, FFN down) are zero: a copy reads and computes all its weights but
adds exactly 0, so the deep file's logits equal the source's and greedy tokens must too. It
stands in, at test size, for the phone-sized target of issue 33 (a model several times the
memory it may use) without the multi-GB file.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

from lever.gguf.convert import _field_value, _Writer

ZEROED = ("attn_output.weight", "ffn_down.weight")  # what writes a block's output to the residual
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def write_deep_target(src: Path, dst: Path, factor: int) -> Path:
    r = gguf.GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    count_key = f"{arch}.block_count"
    n_block = int(r.fields[count_key].parts[-1][0])
    w = _Writer(dst, "", endianess=r.endianess)
    w.kv_data[0].clear()
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue
        if key == count_key:
            w.add_uint32(key, n_block * factor)
            continue
        value, vtype, item_type = _field_value(src, field)
        w.add_key_value(key, value, vtype, sub_type=item_type)
    w.data_alignment = r.alignment
    blocks: dict[int, list] = {}
    plan = []  # (name, source tensor, zeroed)
    for t in r.tensors:
        if m := _BLOCK.match(t.name):
            blocks.setdefault(int(m[1]), []).append((m[2], t))
        else:
            plan.append((t.name, t, False))
    for i in range(n_block):
        for copy in range(factor):
            plan += [(f"blk.{i * factor + copy}.{part}", t, copy > 0 and part in ZEROED) for part, t in blocks[i]]
    for name, t, _ in plan:
        shape = [int(d) for d in reversed(t.shape.tolist())]
        w.add_tensor_info(name, shape, np.dtype(np.float32), int(t.n_bytes), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, t, zeroed in plan:  # all-zero bytes decode to zeros in every type used here
        w.write_tensor_data(np.zeros(int(t.n_bytes), np.uint8) if zeroed else t.data, tensor_endianess=r.endianess)
    w.close()
    return dst


def write_shallow_copy(src: Path, dst: Path, n_block: int) -> Path:
    """The first `n_block` blocks of a GGUF, its head and tokenizer the same: a draft that
    shares its target's vocabulary and disagrees with it often (its last blocks are gone)."""
    r = gguf.GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    count_key = f"{arch}.block_count"
    w = _Writer(dst, "", endianess=r.endianess)
    w.kv_data[0].clear()
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue
        if key == count_key:
            w.add_uint32(key, n_block)
            continue
        value, vtype, item_type = _field_value(src, field)
        w.add_key_value(key, value, vtype, sub_type=item_type)
    w.data_alignment = r.alignment
    kept = [t for t in r.tensors if not (m := _BLOCK.match(t.name)) or int(m[1]) < n_block]
    for t in kept:
        shape = [int(d) for d in reversed(t.shape.tolist())]
        w.add_tensor_info(t.name, shape, np.dtype(np.float32), int(t.n_bytes), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in kept:
        w.write_tensor_data(t.data, tensor_endianess=r.endianess)
    w.close()
    return dst
