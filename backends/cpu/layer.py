"""The CPU backend's layers: weights in the kernels' layouts and one transformer layer over them.

A layer is plain data (`LayerWeights`, its matrices as `Weight`s in the row layout of the file
or the tile layout the kernels stream fastest), so a caller may hand in a layer read from flash
instead of one loaded from the file. `layer_forward` runs one llama-style layer (llama, qwen2,
qwen3) over any set of tokens with explicit positions and an explicit attention mask (so token
trees need nothing else) in one native call; `layer_forward_steps` is the same layer op by op
from Python, the readable specification the native one is tested against.
"""

from __future__ import annotations

import re

import attrs
import numpy as np

from lever.backends.cpu import native
from lever.backends.cpu.kv_cache import KVCache
from lever.errors import LeverError, shown
from lever.gguf.file import GGUFFile
from lever.gguf.spec import ModelSpec

# Rows read and packed at a time when a matrix is made resident (a multiple of the tile
# height): bounds the extra memory of loading to one chunk, 8 MiB for the Qwen heads.
LOAD_CHUNK_ROWS = 4096


@attrs.frozen
class Weight:
    """A matrix of n_out rows by n_in columns in a GGUF tensor type, in the row layout (GGUF's,
    as flash streams it) or the tile layout (native.pack's: what stays resident, since the
    kernels stream it at close to the memory's bandwidth; native/lever_kernels.h)."""

    type_id: int
    n_out: int
    n_in: int
    data: np.ndarray = attrs.field(eq=False)  # rows: (n_out, row_bytes) uint8; tiles: flat uint8
    layout: int = native.ROWS

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return native.matmul(self.type_id, self.data, self.n_out, self.n_in, x, layout=self.layout)  # (n_tok, n_out)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` in the row layout: (len(ids), row_bytes) uint8."""
        ids = np.asarray(ids, np.int64)
        if self.layout == native.TILES:
            return native.unpack_rows(self.type_id, self.data, self.n_out, self.n_in, ids)
        return np.ascontiguousarray(self.data[ids])

    def dequantize(self, ids: np.ndarray | None = None) -> np.ndarray:
        """Rows `ids` (every row when None) as float32: (n, n_in)."""
        ids = np.arange(self.n_out) if ids is None else np.asarray(ids, np.int64)
        return native.dequantize(self.type_id, self.rows(ids), ids.size, self.n_in)

    def tiled(self) -> Weight:
        """This matrix in the tile layout (itself if it is already)."""
        if self.layout == native.TILES:
            return self
        return attrs.evolve(self, data=native.pack(self.type_id, self.data, self.n_out, self.n_in), layout=native.TILES)


def tiled_weight(type_id: int, n_out: int, n_in: int, read_rows) -> Weight:
    """A matrix in the tile layout, its rows fetched by read_rows(r0, r1) -> (r1 - r0, row_bytes)
    a chunk at a time and packed into place, so loading holds one chunk beside the result."""
    data = np.empty(native.tiled_bytes(type_id, n_out, n_in), np.uint8)
    row_bytes = data.size // max(-(-n_out // native.TILE_ROWS) * native.TILE_ROWS, 1)
    for r0 in range(0, n_out, LOAD_CHUNK_ROWS):
        r1 = min(r0 + LOAD_CHUNK_ROWS, n_out)
        dst = data[r0 * row_bytes : r0 * row_bytes + native.tiled_bytes(type_id, r1 - r0, n_in)]
        native.pack(type_id, read_rows(r0, r1), r1 - r0, n_in, out=dst)
    return Weight(type_id, n_out, n_in, data, native.TILES)


def tiled_bytes(f: GGUFFile, name: str) -> int:
    """What tiled_weight allocates for the matrix `name`: the memory plan asks before loading."""
    info = f.tensor(name)
    return native.tiled_bytes(info.type.ggml_id, info.n_rows, info.n_cols)


# Per-layer tensors: field name -> (GGUF name suffix, required).
LAYER_TENSORS: dict[str, tuple[str, bool]] = {
    "attn_norm": ("attn_norm.weight", True),
    "wq": ("attn_q.weight", True),
    "wk": ("attn_k.weight", True),
    "wv": ("attn_v.weight", True),
    "bq": ("attn_q.bias", False),
    "bk": ("attn_k.bias", False),
    "bv": ("attn_v.bias", False),
    "q_norm": ("attn_q_norm.weight", False),
    "k_norm": ("attn_k_norm.weight", False),
    "wo": ("attn_output.weight", True),
    "ffn_norm": ("ffn_norm.weight", True),
    "w_gate": ("ffn_gate.weight", True),
    "w_up": ("ffn_up.weight", True),
    "w_down": ("ffn_down.weight", True),
}
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# Per-layer tensors an architecture cannot run without, beyond the required ones above.
ARCH_TENSORS: dict[str, tuple[str, ...]] = {"qwen2": ("bq", "bk", "bv"), "qwen3": ("q_norm", "k_norm")}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.")


@attrs.frozen
class LayerWeights:
    attn_norm: np.ndarray = attrs.field(eq=False)  # (n_embd,)
    wq: Weight
    wk: Weight
    wv: Weight
    wo: Weight
    ffn_norm: np.ndarray = attrs.field(eq=False)  # (n_embd,)
    w_gate: Weight
    w_up: Weight
    w_down: Weight
    bq: np.ndarray | None = attrs.field(default=None, eq=False)  # (n_head * head_dim,)
    bk: np.ndarray | None = attrs.field(default=None, eq=False)  # (n_kv_head * head_dim,)
    bv: np.ndarray | None = attrs.field(default=None, eq=False)
    q_norm: np.ndarray | None = attrs.field(default=None, eq=False)  # (head_dim,)
    k_norm: np.ndarray | None = attrs.field(default=None, eq=False)
    # The tensors' addresses for native.layer_forward, made once (load_layer) rather than per call.
    native: native.LayerWeightsC | None = attrs.field(default=None, eq=False, repr=False)


def native_weights(lw: LayerWeights) -> native.LayerWeightsC:
    """lw's tensors as lever_layer_weights (their arrays stay owned by lw)."""
    vec = lambda a: None if a is None else native._addr(a, np.float32)
    mat = lambda m: native.matrix(m.type_id, m.data, m.n_out, m.n_in, m.layout)
    return native.LayerWeightsC(*(vec(getattr(lw, n)) for n in ("attn_norm", "ffn_norm", "bq", "bk", "bv", "q_norm",
                                                                "k_norm")),
                                *(mat(getattr(lw, n)) for n in MATRICES))


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    q, kv = spec.n_head * spec.head_dim, spec.kv_dim
    return {
        "attn_norm": (spec.n_embd,), "ffn_norm": (spec.n_embd,),
        "wq": (q, spec.n_embd), "wk": (kv, spec.n_embd), "wv": (kv, spec.n_embd),
        "bq": (q,), "bk": (kv,), "bv": (kv,),
        "q_norm": (spec.head_dim,), "k_norm": (spec.head_dim,),
        "wo": (spec.n_embd, q),
        "w_gate": (spec.n_ff, spec.n_embd), "w_up": (spec.n_ff, spec.n_embd), "w_down": (spec.n_embd, spec.n_ff),
    }


def layer_tensor_names(f: GGUFFile, layer: int) -> dict[str, str]:
    """Field -> GGUF tensor name for the tensors this layer has."""
    names = {}
    for field, (suffix, required) in LAYER_TENSORS.items():
        name = f"blk.{layer}.{suffix}"
        if name in f.tensors:
            names[field] = name
        elif required:
            raise LeverError(f"{f.path}: missing tensor {name}")
    return names


def check_tensors(f: GGUFFile, spec: ModelSpec) -> None:
    """Every tensor the architecture needs is present with the shape the hyperparameters imply,
    and no layer tensor lies beyond block_count, checked when the model opens: a streamed layer
    must not turn out broken halfway through a run."""
    def expect(name: str, shape: tuple[int, ...]) -> None:
        info = f.tensor(name)
        if info.shape != shape:
            raise LeverError(f"{f.path}: tensor {name} has shape {info.shape}, expected {shape}")

    expect("output_norm.weight", (spec.n_embd,))
    if "output.weight" in f.tensors:
        expect("output.weight", (spec.n_vocab, spec.n_embd))
    shapes = expected_shapes(spec)
    needed = ARCH_TENSORS.get(spec.arch, ())
    for layer in range(spec.n_layer):
        names = layer_tensor_names(f, layer)
        for field in needed:
            if field not in names:
                raise LeverError(f"{f.path}: missing tensor blk.{layer}.{LAYER_TENSORS[field][0]} "
                                 f"({spec.arch} needs it)")
        for field, name in names.items():
            expect(name, shapes[field])
    for name in f.tensors:
        m = _LAYER_NAME.match(name)
        if m and (len(m[1]) > 9 or int(m[1]) >= spec.n_layer):
            raise LeverError(f"{f.path}: tensor {shown(name)} is beyond the {spec.n_layer} layers of "
                             f"{spec.arch}.block_count")


def check_vocab(f: GGUFFile, spec: ModelSpec) -> None:
    """The tokenizer's token list, when the file has one, has a row for every token and no more."""
    tokens = f.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) != spec.n_vocab:
        raise LeverError(f"{f.path}: tokenizer.ggml.tokens has {len(tokens)} tokens but token_embd.weight has "
                         f"{spec.n_vocab} rows")


def weight_from(f: GGUFFile, name: str, raw: np.ndarray | None = None, tiles: bool = False) -> Weight:
    """The matrix `name`: in the row layout from `raw` (bytes already read) or the mapping, or
    with tiles=True read from the file (GGUFFile.read_rows) into the tile layout."""
    info = f.tensor(name)
    if len(info.shape) != 2:
        raise LeverError(f"{f.path}: tensor {name} has shape {info.shape}, expected a matrix")
    n_out, n_in = info.shape
    if n_in % info.type.block_elems:
        raise LeverError(f"{f.path}: tensor {name}: {n_in} columns is not a multiple of {info.type.name}'s block")
    if tiles:
        return tiled_weight(info.type.ggml_id, n_out, n_in, lambda r0, r1: f.read_rows(name, r0, r1))
    return Weight(info.type.ggml_id, n_out, n_in, f.raw(name) if raw is None else raw)


def load_layer(f: GGUFFile, spec: ModelSpec, layer: int, raws: dict[str, np.ndarray] | None = None,
               tiles: bool = False) -> LayerWeights:
    """A layer's weights: from `raws` (tensor name -> bytes already read), else read from the
    file; matrices in the row layout, or in the tile layout with tiles=True (a layer that
    stays resident: packed from raws, or read and packed chunk by chunk)."""
    shapes = expected_shapes(spec)
    fields = {}
    for field, name in layer_tensor_names(f, layer).items():
        info = f.tensor(name)
        if info.shape != shapes[field]:
            raise LeverError(f"{f.path}: tensor {name} has shape {info.shape}, expected {shapes[field]}")
        raw = None if raws is None else raws.get(name)
        if field in MATRICES:
            w = weight_from(f, name, raw, tiles=tiles and raw is None)
            fields[field] = w.tiled() if tiles else w
        elif raw is None:
            fields[field] = f.floats(name).reshape(-1)
        else:  # norms and biases from the bytes read, not from the file's mapping
            fields[field] = native.dequantize(info.type.ggml_id, raw, info.n_rows, info.n_cols).reshape(-1)
    lw = LayerWeights(**fields)
    return attrs.evolve(lw, native=native_weights(lw))


def held_bytes(a: np.ndarray | Weight | None) -> int:
    """DRAM an array (or a Weight's data) holds of its own: a view of a file's mapping holds none."""
    a = a.data if isinstance(a, Weight) else a
    return 0 if a is None or isinstance(a, np.memmap) else a.nbytes


def layer_nbytes(lw: LayerWeights) -> int:
    """The DRAM a loaded layer holds: its matrices and its float32 norms and biases."""
    return sum(held_bytes(getattr(lw, a.name)) for a in attrs.fields(LayerWeights) if a.name != "native")


def resident_layer_bytes(f: GGUFFile, spec: ModelSpec, layer: int) -> int:
    """What load_layer(..., tiles=True) holds for `layer`, from the header alone."""
    n = 0
    for field, name in layer_tensor_names(f, layer).items():
        info = f.tensor(name)
        n += tiled_bytes(f, name) if field in MATRICES else 4 * info.n_rows * info.n_cols
    return n


_DIMS: dict[tuple[ModelSpec, int], tuple] = {}  # (dims, the caller's table, its float32 copy)


def layer_dims(spec: ModelSpec, inv_freq: np.ndarray) -> native.LayerDims:
    """spec's lever_layer_dims, made once per (spec, frequency table)."""
    key = (spec, id(inv_freq))
    hit = _DIMS.get(key)
    if hit is None or hit[1] is not inv_freq:
        inv = np.ascontiguousarray(inv_freq, np.float32)
        d = native.LayerDims(n_embd=spec.n_embd, n_head=spec.n_head, n_head_kv=spec.n_head_kv,
                             head_dim=spec.head_dim, n_ff=spec.n_ff, n_rot=spec.n_rot, rms_eps=spec.rms_eps,
                             attn_scale=1.0 / float(np.sqrt(spec.head_dim)), rope_neox=int(spec.rope_neox),
                             inv_freq=native._addr(inv, np.float32))
        hit = _DIMS[key] = (d, inv_freq, inv)
    return hit[0]


def layer_forward(spec: ModelSpec, lw: LayerWeights, x: np.ndarray, *, pos: np.ndarray, mask: np.ndarray,
                  cache: KVCache, layer: int, rows: slice | np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """One transformer layer over tokens x (n_tok, n_embd); writes their k/v into cache rows
    `rows` (a slice, or one row per token) and attends over cache rows [0, mask.shape[1])
    through mask (n_tok, n_rows_seen). One native call (native/layer.c), computing what
    layer_forward_steps spells out, bit for bit."""
    n_tok = x.shape[0]
    if isinstance(rows, slice):
        rows = np.arange(rows.start or 0, (rows.start or 0) + n_tok, dtype=np.int64)
    return native.layer_forward(layer_dims(spec, inv_freq), lw.native or native_weights(lw), x,
                                pos=np.ascontiguousarray(pos, np.int32), mask=mask, k_cache=cache.k[layer],
                                v_cache=cache.v[layer], rows=np.ascontiguousarray(rows, np.int64))


# Tokens a layer runs at a time in a long pass (a prompt's): the pass still reads each layer's
# weights once, but its live arrays are one chunk's, so a 2,048-token prompt of the Qwen pair
# holds ~30 MB of them rather than ~470 MB (lever.policy.memory.activation_bytes). Rows are
# computed alone whatever their batch, so the chunks change no bit of the result; and a chunk
# attends only to the rows before it, which made a 1,024-token prefill of the 1.5B target 1.2x
# faster than one chunk of it (128 fastest of 64/128/256/512, EPYC Zen 4, 2 vCPUs, 2026-12-06).
PASS_CHUNK_TOKENS = 128


def layer_in_chunks(layer_fn, spec: ModelSpec, lw: LayerWeights, x: np.ndarray, *, pos: np.ndarray,
                    mask: np.ndarray, cache: KVCache, layer: int, rows: slice | np.ndarray, inv_freq: np.ndarray,
                    chunk: int = PASS_CHUNK_TOKENS) -> np.ndarray:
    """`layer_fn` (layer_forward's signature) over x chunk by chunk of tokens, in order. A
    chunk attends over the cache rows up to its own last one: those are written by then, and
    the pass's later rows are none of its ancestors (a pass lists a tree's nodes parents
    first). A pass that is not one run of new rows after the cache (rows as indices: a pruned
    tree) runs whole."""
    n_tok = x.shape[0]
    start = rows.start if isinstance(rows, slice) else None
    if n_tok <= chunk or start is None or mask.shape[1] != start + n_tok:
        return layer_fn(spec, lw, x, pos=pos, mask=mask, cache=cache, layer=layer, rows=rows, inv_freq=inv_freq)
    out = np.empty_like(x)  # (n_tok, n_embd)
    for a in range(0, n_tok, chunk):
        b = min(a + chunk, n_tok)
        out[a:b] = layer_fn(spec, lw, x[a:b], pos=pos[a:b], mask=np.ascontiguousarray(mask[a:b, : start + b]),
                            cache=cache, layer=layer, rows=slice(start + a, start + b), inv_freq=inv_freq)
    return out


def layer_forward_steps(spec: ModelSpec, lw: LayerWeights, x: np.ndarray, *, pos: np.ndarray, mask: np.ndarray,
                        cache: KVCache, layer: int, rows: slice, inv_freq: np.ndarray) -> np.ndarray:
    """layer_forward as the kernel calls it makes, one by one: its specification, kept
    executable (tests hold the two equal bit for bit)."""
    n_tok = x.shape[0]
    h = native.rmsnorm(x, lw.attn_norm, spec.rms_eps)
    q, k, v = lw.wq(h), lw.wk(h), lw.wv(h)
    if lw.bq is not None:
        q += lw.bq
    if lw.bk is not None:
        k += lw.bk
    if lw.bv is not None:
        v += lw.bv
    q = q.reshape(n_tok, spec.n_head, spec.head_dim)
    k = k.reshape(n_tok, spec.n_head_kv, spec.head_dim)
    if lw.q_norm is not None:
        q = native.rmsnorm(q, lw.q_norm, spec.rms_eps)
    if lw.k_norm is not None:
        k = native.rmsnorm(k, lw.k_norm, spec.rms_eps)
    native.rope(q, pos, spec.n_rot, inv_freq, spec.rope_neox)
    native.rope(k, pos, spec.n_rot, inv_freq, spec.rope_neox)
    ck, cv = cache.k[layer], cache.v[layer]
    ck[rows] = k
    cv[rows] = v.reshape(n_tok, spec.n_head_kv, spec.head_dim)
    attn = native.attention(q, ck[: mask.shape[1]], cv[: mask.shape[1]], mask, 1.0 / float(np.sqrt(spec.head_dim)))
    x = x + lw.wo(attn.reshape(n_tok, -1))
    h = native.rmsnorm(x, lw.ffn_norm, spec.rms_eps)
    return x + lw.w_down(native.swiglu(lw.w_gate(h), lw.w_up(h)))
