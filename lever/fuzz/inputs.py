"""GGUF files for the loader fuzzer (lever.fuzz): a writer that will write anything, and seed mutation.

Every random decision comes from a `Chooser`, so one code path serves the seeded random run of
`lever bench fuzz` and hypothesis in the tests (which can then shrink a failing input). A file
is a `Blob`: its first bytes and its length, the rest zeros, since tensor data past the header
is never parsed and need not be carried around. `Desc` describes a file structurally (typed
key-values, tensor infos, counts that may lie) and `serialize` writes it without judging it;
`parse_seed` reads a real file back into one and notes where every count, length, type, dim
and offset lies, which `mutate` then aims at, besides bit flips, overwrites with boundary
values, splices, duplicated or deleted chunks, truncation and cross-overs between seeds.
lever.fuzz.models builds the consistent tiny models and injects semantic faults.
"""
from __future__ import annotations

import math
import random
import struct
from pathlib import Path
from typing import Any, Protocol

import attrs

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_WIDTH = {U8: 1, I8: 1, U16: 2, I16: 2, U32: 4, I32: 4, F32: 4, BOOL: 1, U64: 8, I64: 8, F64: 8}
_SCALAR_TYPES = tuple(_WIDTH)
INTS = [0, 1, 2, 3, 7, 8, 31, 32, 33, 255, 256, 4095, 4096, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
        2**53, 2**63 - 1, 2**63, 2**64 - 1, -1, -2, -(2**31), -(2**63)]
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, 1e30, 3.4e38, float("inf"), float("-inf"), float("nan"), 2.0**31, 1e-45]
DATA_KEPT = 4096  # bytes of a seed's tensor data kept in its prefix (rope_freqs, norms); the rest reads as zeros
MAX_SIZE = 1 << 23  # a generated file never claims more than this many bytes


class Chooser(Protocol):
    """Where every random decision comes from: random.Random here, hypothesis in the tests."""

    def int(self, lo: int, hi: int) -> int: ...


class RandomChooser:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


def choice(ch: Chooser, seq):
    return seq[ch.int(0, len(seq) - 1)]


def chance(ch: Chooser, percent: int) -> bool:
    return ch.int(0, 99) < percent


@attrs.frozen
class Blob:
    """A GGUF file as its first bytes plus its length; the bytes past the prefix are zeros."""

    prefix: bytes
    size: int

    def __attrs_post_init__(self):
        if len(self.prefix) > self.size:
            object.__setattr__(self, "prefix", self.prefix[: self.size])

    def materialize(self) -> bytes:
        return self.prefix + bytes(self.size - len(self.prefix))

    @classmethod
    def of(cls, data: bytes) -> Blob:
        return cls(data.rstrip(b"\0"), len(data))

    def write(self, path: Path) -> None:
        with open(path, "wb") as f:
            f.write(self.prefix)
            f.truncate(self.size)  # a hole: no bytes written for the zeros


# --- the structured description and its writer ------------------------------------------------


@attrs.define
class KV:
    key: str
    vtype: int
    value: Any
    elem: int = 0  # element type of an ARRAY


@attrs.define
class TensorDesc:
    name: str
    dims: list[int]  # GGUF order: the row length first
    ggml_type: int
    offset: int | None = None  # relative to the data section; None: placed after the previous tensor
    content: bytes | None = None  # None: zeros


@attrs.define
class Desc:
    kvs: list[KV]
    tensors: list[TensorDesc]
    version: int = 3
    n_kv: int | None = None  # None: the true counts
    n_tensors: int | None = None

    def find(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    def set(self, key: str, vtype: int, value: Any, elem: int = 0) -> None:
        kv = self.find(key)
        if kv is None:
            self.kvs.append(KV(key, vtype, value, elem))
        else:
            kv.vtype, kv.value, kv.elem = vtype, value, elem

    def drop(self, key: str) -> None:
        self.kvs = [kv for kv in self.kvs if kv.key != key]

    @property
    def arch(self) -> str:
        kv = self.find("general.architecture")
        return kv.value if kv is not None and isinstance(kv.value, str) else "llama"


def _string(s: str | bytes) -> bytes:
    b = s if isinstance(s, bytes) else s.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(b)) + b


def _scalar(vt: int, v: Any) -> bytes:
    if vt in (F32, F64):
        try:
            v = float(v)
        except (TypeError, ValueError):
            v = 0.0
        if vt == F32 and math.isfinite(v) and abs(v) > 3.4028234e38:
            v = float("inf") if v > 0 else float("-inf")
        return struct.pack("<f" if vt == F32 else "<d", v)
    w = _WIDTH[vt]
    return (int(v) & ((1 << (8 * w)) - 1)).to_bytes(w, "little")  # wraps: -1 becomes all ones


def _value(vt: int, v: Any, elem: int = 0) -> bytes:
    if vt == STR:
        return _string(v)
    if vt == ARR:
        if elem == ARR:  # nested arrays: the count and nothing after it
            return struct.pack("<IQ", elem, len(v))
        return struct.pack("<IQ", elem, len(v)) + b"".join(_value(elem, x) for x in v)
    if vt in _WIDTH:
        return _scalar(vt, v)
    return b""  # an unknown type code: nothing follows it


def tensor_bytes(ggml_type: int, dims: list[int]) -> int:
    import gguf

    n = 1
    for d in dims:
        n *= max(d, 0)
    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return n
    return n // block * size


def serialize(d: Desc, alignment: int = 32) -> Blob:
    head = [b"GGUF", struct.pack("<I", d.version & 0xFFFFFFFF),
            _scalar(U64, len(d.tensors) if d.n_tensors is None else d.n_tensors),
            _scalar(U64, len(d.kvs) if d.n_kv is None else d.n_kv)]
    for kv in d.kvs:
        head += [_string(kv.key), _scalar(U32, kv.vtype), _value(kv.vtype, kv.value, kv.elem)]
    align = d.find("general.alignment")
    power_of_two = align is not None and isinstance(align.value, int) and not align.value & (align.value - 1)
    if power_of_two and 0 < align.value <= 4096:
        alignment = align.value
    placed, end = [], 0
    for t in d.tensors:
        off = t.offset if t.offset is not None else -(-end // alignment) * alignment
        n = tensor_bytes(t.ggml_type, t.dims)
        if t.offset is None:
            end = off + n
        placed.append((t, off, n))
        head += [_string(t.name), _scalar(U32, len(t.dims)), *(_scalar(U64, x) for x in t.dims),
                 _scalar(U32, t.ggml_type), _scalar(U64, off)]
    header = b"".join(head)
    start = -(-len(header) // alignment) * alignment
    data = bytearray()
    size = start
    for t, off, n in placed:
        if 0 <= off and off + n <= MAX_SIZE:
            size = max(size, start + off + n)
            if t.content:
                data[len(data):] = bytes(max(0, off - len(data)))
                data[off : off + len(t.content)] = t.content
    prefix = header + bytes(start - len(header)) + bytes(data)
    return Blob(prefix, max(min(size, MAX_SIZE), len(prefix)))


# --- reading a seed file back into a Desc, and where its fields lie ----------------------------


@attrs.frozen
class Field:
    pos: int
    width: int
    kind: str  # "count", "length", "vtype", "value", "ndims", "dim", "ttype", "offset"


@attrs.frozen
class Seed:
    name: str
    blob: Blob
    fields: tuple[Field, ...]
    header_end: int


def parse_seed(name: str, data: bytes) -> tuple[Seed, Desc]:
    """A valid GGUF's structure: its Desc (tensor contents dropped) and the position of every field."""
    pos = 0
    fields: list[Field] = []

    def take(fmt: str, kind: str | None = None):
        nonlocal pos
        (v,) = struct.unpack_from(fmt, data, pos)
        if kind:
            fields.append(Field(pos, struct.calcsize(fmt), kind))
        pos += struct.calcsize(fmt)
        return v

    def string() -> str:
        nonlocal pos
        n = take("<Q", "length")
        s = data[pos : pos + n].decode("utf-8", "surrogatepass")
        pos += n
        return s

    fmts = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
            U64: "<Q", I64: "<q", F64: "<d"}

    def value(vt: int):
        if vt == STR:
            return string()
        if vt == ARR:
            elem, n = take("<I", "vtype"), take("<Q", "length")
            return [value(elem) for _ in range(n)], elem
        return take(fmts[vt], "value")

    pos = 4
    version = take("<I", "value")
    n_tensors, n_kv = take("<Q", "count"), take("<Q", "count")
    kvs = []
    for _ in range(n_kv):
        key = string()
        vt = take("<I", "vtype")
        v = value(vt)
        kvs.append(KV(key, vt, *v) if vt == ARR else KV(key, vt, v))
    tensors = []
    for _ in range(n_tensors):
        tname = string()
        dims = [take("<Q", "dim") for _ in range(take("<I", "ndims"))]
        tensors.append(TensorDesc(tname, dims, take("<I", "ttype"), take("<Q", "offset")))
    d = Desc(kvs, tensors, version)
    align = d.find("general.alignment")
    start = -(-pos // (align.value if align else 32)) * (align.value if align else 32)
    blob = Blob(data[: start + DATA_KEPT], len(data))
    return Seed(name, blob, tuple(fields), pos), d


def seed_from_desc(name: str, d: Desc) -> Seed:
    return parse_seed(name, serialize(d).materialize())[0]


def reduce_vocab(d: Desc, n_keep: int) -> Desc:
    """The same model with only its first n_keep tokens (merges among them, embedding rows cut)."""
    tokens = d.find("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.value) <= n_keep:
        return d
    kept = set(tokens.value[:n_keep])
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        kv = d.find(key)
        if kv is not None:
            kv.value = kv.value[:n_keep]
    merges = d.find("tokenizer.ggml.merges")
    if merges is not None:
        merges.value = [m for m in merges.value
                        if len(p := m.split(" ")) == 2 and p[0] in kept and p[1] in kept and p[0] + p[1] in kept]
    vocab_size = d.find(f"{d.arch}.vocab_size")
    if vocab_size is not None:
        vocab_size.value = n_keep
    for t in d.tensors:
        if t.name in ("token_embd.weight", "output.weight"):
            t.dims = [t.dims[0], n_keep]
        t.offset = None  # laid out again, packed
    return d


def load_seeds(paths: list[Path], n_vocab_max: int = 1024) -> list[Seed]:
    """Seeds from files (absent ones skipped); a large vocabulary is cut so each input stays fast."""
    seeds = []
    for p in paths:
        if not p.exists():
            continue
        data = p.read_bytes()
        seed, d = parse_seed(p.name, data)
        n_tokens = len(getattr(d.find("tokenizer.ggml.tokens"), "value", []))
        if n_tokens > n_vocab_max:
            seed = seed_from_desc(p.name + f"[:{n_vocab_max}]", reduce_vocab(d, n_vocab_max))
        seeds.append(seed)
    return seeds


# --- byte-level mutation of seeds -------------------------------------------------------------


def _put(buf: bytearray, pos: int, width: int, value: int) -> None:
    if 0 <= pos and pos + width <= len(buf):
        buf[pos : pos + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")


def mutate(ch: Chooser, seed: Seed, other: Seed | None = None) -> Blob:
    """One to four mutations of a seed: field values first (while the positions still hold), then
    bit flips, overwrites, splices, duplicated or deleted chunks, truncation, a cross-over."""
    buf, size = bytearray(seed.blob.prefix), seed.blob.size
    end = min(seed.header_end + 64, len(buf))
    n = ch.int(1, 4)
    ops = sorted(ch.int(0, 8) for _ in range(n))
    for op in ops:
        pos = ch.int(0, max(end - 1, 0)) if chance(ch, 90) else ch.int(0, max(len(buf) - 1, 0))
        if op <= 1 and seed.fields:  # a known field: counts, lengths, types, dims, offsets, scalar values
            kinds = sorted({f.kind for f in seed.fields})  # kind first: string lengths would crowd out the rest
            kind = choice(ch, kinds)
            f = choice(ch, [f for f in seed.fields if f.kind == kind])
            if f.kind in ("vtype", "ttype"):
                types = [0, 4, 5, 8, 9, 10, 12, 13, 30, 99, 2**31, 2**32 - 1]
                value = choice(ch, types) if chance(ch, 70) else ch.int(0, 40)
            elif f.kind == "ndims":
                value = choice(ch, [0, 1, 2, 3, 4, 5, 2**32 - 1])
            else:
                value = choice(ch, INTS) if chance(ch, 60) else ch.int(0, 1 << (8 * f.width)) + choice(ch, [-1, 0, 1])
            _put(buf, f.pos, f.width, value)
        elif op == 2:
            if buf:
                buf[min(pos, len(buf) - 1)] ^= 1 << ch.int(0, 7)
        elif op == 3:
            _put(buf, pos, choice(ch, [1, 2, 4, 8]), choice(ch, INTS))
        elif op == 4 and end > 1:  # splice one header region over another
            a, n_bytes = ch.int(0, end - 1), ch.int(1, 64)
            chunk = bytes(buf[a : a + n_bytes])
            buf[pos : pos + len(chunk)] = chunk
        elif op == 5 and end > 1:  # a duplicated chunk: everything after it moves
            a, n_bytes = ch.int(0, end - 1), ch.int(1, 256)
            chunk = bytes(buf[a : a + n_bytes])
            buf[a:a] = chunk
            size += len(chunk)
        elif op == 6 and end > 1:
            a, n_bytes = ch.int(0, end - 1), ch.int(1, 64)
            cut = len(buf[a : a + n_bytes])
            del buf[a : a + n_bytes]
            size -= cut
        elif op == 7:  # truncation, mostly inside the header or just after it
            size = ch.int(0, end + 64) if chance(ch, 70) else ch.int(0, size)
        elif op == 8 and other is not None:  # this seed's start, another's rest
            cut = ch.int(0, min(pos, len(buf)))
            at = ch.int(0, max(other.header_end - 1, 0))
            tail = other.blob.prefix[at:]
            buf = buf[:cut] + bytearray(tail)
            size = cut + other.blob.size - at
    return Blob(bytes(buf), max(size, 0))
