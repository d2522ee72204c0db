"""ONNX graphs of one transformer layer at static shapes, for the QNN backend (runner.py).

A graph computes exactly what `lever.backends.cpu.layer.layer_forward` computes for one bucket of token
rows and one bucket of past KV rows, with every weight of the layer as a graph *input*: one
compiled graph per (bucket shapes, precision, layer traits) serves every layer of a model,
whichever way its weights arrived (resident, or read from flash for this pass). The caller
(runner.py) dequantizes weights on the CPU, builds the additive mask and the rope tables, and
writes the returned K/V rows into the KVCache.

Layout of the graph (T token rows, S past rows, E n_embd, H/Hk heads, D head_dim, G = H/Hk):

    x (T,E) -> rmsnorm -> Gemm(w_qkv^T [+b_qkv]) -> q (T,H,D), k, v (T,Hk,D)
      (attn_norm and ffn_norm come folded into the columns of w_qkv and w_gu)
    [q/k rmsnorm per head] -> rope: r = x*cos + (x @ ROT)*sin   (cos/sin (T,1,D) inputs)
    k, v rounded to float16 (the cache's type, as layer_forward stores them before attending)
    scores (Hk, G, T, S+T) = q . [past_k ; k] * 1/sqrt(D) + mask (T, S+T), softmax, @ [past_v ; v]
    a = (ctx * keep) @ wo^T ;  delta = a + (silu(g) * u) @ w_down^T,  [g u] = rmsnorm(x + a) @ w_gu^T

The graph returns the layer's change `delta`, not x + delta: the caller adds it to x in
float32, so in float16 mode the residual stream between layers keeps float32 (only a layer's
own arithmetic is float16), at the cost of one add per row on the CPU.

Rope is a constant (D,D) permutation ROT swapping each rotated pair (the signs are in the sin
table), the same formula for both pairings: a Gather of constant indices failed to finalize on
HTP in float32 (QNN_COMMON_ERROR_MEM_ALLOC even at 8 elements), while a MatMul by a 0/1 matrix
is exact in any precision.
"""

from __future__ import annotations

import attrs
import numpy as np

try:
    import onnx
    from onnx import TensorProto, helper
except ImportError:  # the package still imports, so that is_available() can say why it is False
    onnx = TensorProto = helper = None

OPSET = 17
IR_VERSION = 8  # the IR of opset 17; newer IRs add nothing these graphs use

# Additive mask value for a hidden KV column. Finite, so that a row that sees nothing (a
# padded query row) stays a plain softmax over equal scores instead of 0/0 = NaN, and small
# enough that exp() underflows to exactly 0 in float32 and float16 beside any visible score.
MASK_NEG = -30000.0
# Floor of a row's max |x| in the float16 rmsnorm: keeps (sqrt(eps)/m)^2 within float16
# (sqrt(1e-6)/1e-3 = 1) and an all-zero row finite.
M_FLOOR = 1e-3


@attrs.frozen
class LayerShape:
    """Everything a compiled layer graph depends on: the buckets, the model's sizes, the layer's
    optional tensors and the arithmetic type. Hashable: the runner keys its sessions by it."""

    n_tok: int  # token rows (bucket)
    n_past: int  # past KV rows (bucket)
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    qkv_bias: bool  # qwen2
    qk_norm: bool  # qwen3
    fp16: bool  # activations and weights as float16 (HTP's native float), else float32

    @property
    def qkv_dim(self) -> int:
        return (self.n_head + 2 * self.n_head_kv) * self.head_dim

    @property
    def name(self) -> str:
        flags = ("b" if self.qkv_bias else "") + ("n" if self.qk_norm else "")
        return (f"layer_t{self.n_tok}_s{self.n_past}_e{self.n_embd}_f{self.n_ff}_h{self.n_head}x{self.n_head_kv}"
                f"x{self.head_dim}_{'fp16' if self.fp16 else 'fp32'}{'_' + flags if flags else ''}")

    def inputs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Graph input name -> (shape, numpy dtype), in the graph's order."""
        f = np.dtype(np.float16 if self.fp16 else np.float32)
        T, S, E, F, D = self.n_tok, self.n_past, self.n_embd, self.n_ff, self.head_dim
        ins = {
            "x": ((T, E), f),
            "w_qkv": ((self.qkv_dim, E), f),
        }
        if self.qkv_bias:
            ins["b_qkv"] = ((self.qkv_dim,), f)
        if self.qk_norm:
            ins["q_norm"] = ((D,), f)
            ins["k_norm"] = ((D,), f)
        ins.update({
            "wo": ((E, self.n_head * D), f),
            "w_gu": ((2 * F, E), f),
            "w_down": ((E, F), f),
            "cos": ((T, 1, D), f),
            "sin": ((T, 1, D), f),
            "past_k": ((S, self.n_head_kv, D), np.dtype(np.float16)),
            "past_v": ((S, self.n_head_kv, D), np.dtype(np.float16)),
            "mask": ((T, S + T), f),
            "keep": ((T, 1), f),
        })
        return ins

    def outputs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        f = np.dtype(np.float16 if self.fp16 else np.float32)
        kv = ((self.n_tok, self.n_head_kv, self.head_dim), np.dtype(np.float16))
        return {"delta": ((self.n_tok, self.n_embd), f), "k_new": kv, "v_new": kv}


def rotation_matrix(head_dim: int, n_rot: int, neox: bool) -> np.ndarray:
    """ROT (D, D) with (x @ ROT)[a] = x[b] for each rotated pair (a, b), so that
    x*cos + (x @ ROT)*sin is lever.backends.cpu.native.rope given sin signed per element (rope_tables):
    pairs mode rotates (2i, 2i+1), neox mode (i, i + n_rot/2); columns past n_rot stay 0."""
    rot = np.zeros((head_dim, head_dim), np.float32)
    half = n_rot // 2
    for i in range(half):
        a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
        rot[b, a] = 1.0  # out[a] picks x[b] (its sin is negated: a' = x_a c - x_b s)
        rot[a, b] = 1.0  # out[b] picks x[a]                      (b' = x_a s + x_b c)
    return rot


def rope_tables(pos: np.ndarray, inv_freq: np.ndarray, head_dim: int, n_rot: int, neox: bool,
                n_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, signed sin (n_rows, 1, head_dim) float32 for the graph's rope, from the same float32
    theta = pos * inv_freq as native/ops.c (lever_rope); rows past len(pos) are the identity
    (cos 1, sin 0), and so are dimensions past n_rot."""
    pos = np.asarray(pos)
    n_rows = len(pos) if n_rows is None else n_rows
    half = n_rot // 2
    theta = pos.astype(np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None, :half]
    # cos/sin of the float32 theta in double, rounded once: correctly rounded like glibc's cosf
    c = np.cos(theta.astype(np.float64)).astype(np.float32)
    s = np.sin(theta.astype(np.float64)).astype(np.float32)
    cos = np.ones((n_rows, 1, head_dim), np.float32)
    sin = np.zeros((n_rows, 1, head_dim), np.float32)
    n = len(pos)
    first = np.arange(half) if neox else 2 * np.arange(half)
    second = first + half if neox else first + 1
    cos[:n, 0, first], cos[:n, 0, second] = c, c
    sin[:n, 0, first], sin[:n, 0, second] = -s, s
    return cos, sin


class _Builder:
    """Nodes with generated names; each op returns its output's name."""

    def __init__(self, dtype: int, eps: float):
        self.dtype = dtype
        self._eps = eps
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def op(self, op_type: str, *inputs: str, n_out: int = 1, **attrs):
        self._n += 1
        outs = [f"{op_type.lower()}{self._n}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=f"{op_type}{self._n}", **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(onnx.numpy_helper.from_array(value, name))
        return name

    def scalar(self, name: str, value: float) -> str:
        if any(t.name == name for t in self.inits):
            return name
        return self.const(name, np.array(value, np.float16 if self.dtype == TensorProto.FLOAT16 else np.float32))

    def shape(self, name: str, dims) -> str:
        return self.const(name, np.array(dims, np.int64))

    def rmsnorm(self, x: str, eps: str, w: str | None = None) -> str:
        """x / sqrt(mean(x^2) + eps) [* w]. In float32 HTP fails to finalize (QNN_COMMON_ERROR_
        MEM_ALLOC) an elementwise Mul fed by Sqrt, Reciprocal or Div at some sizes (from 48 rows
        of 64 on the simulator): hence a Div, not ops.c's 1/sqrt() factor, and the layer norms'
        weights folded into the next matmul's columns on the CPU (runner._dequantize_layer)."""
        if self.dtype == TensorProto.FLOAT16:
            y = self._rmsnorm_scaled(x, eps)
        else:
            ms = self.op("ReduceMean", self.op("Mul", x, x), axes=[-1], keepdims=1)
            y = self.op("Div", x, self.op("Sqrt", self.op("Add", ms, eps)))
        return y if w is None else self.op("Mul", y, w)

    def _rmsnorm_scaled(self, x: str, eps: str) -> str:
        """rmsnorm for float16, where x^2 overflows from |x| = 256 on, which Qwen2.5's residual
        stream passes within its first layers (docs/measurements.md, 'QNN HTP on the simulator'):
        x is divided by its row's max |x| m first, and
        x / sqrt(mean(x^2) + eps) = y / sqrt(mean(y^2) + (sqrt(eps)/m)^2) with y = x/m, |y| <= 1.
        m is floored (M_FLOOR) so that an all-zero padded row gives zeros, not 0/0."""
        top = self.op("ReduceMax", self.op("Abs", x), axes=[-1], keepdims=1)
        m = self.op("Max", top, self.scalar("m_floor", M_FLOOR))
        y = self.op("Div", x, m)
        e = self.op("Div", self.scalar("sqrt_eps", float(np.sqrt(self._eps))), m)
        ms = self.op("Add", self.op("ReduceMean", self.op("Mul", y, y), axes=[-1], keepdims=1), self.op("Mul", e, e))
        return self.op("Div", y, self.op("Sqrt", ms))

    def rope(self, x: str) -> str:
        return self.op("Add", self.op("Mul", x, "cos"), self.op("Mul", self.op("MatMul", x, "rot"), "sin"))


def build_layer(shape: LayerShape, n_rot: int, rope_neox: bool) -> onnx.ModelProto:
    """The layer graph for `shape` (see the module docstring for its inputs and outputs)."""
    s = shape
    T, S, H, Hk, D = s.n_tok, s.n_past, s.n_head, s.n_head_kv, s.head_dim
    G, q_dim, kv_dim = H // Hk, H * D, Hk * D
    ft = TensorProto.FLOAT16 if s.fp16 else TensorProto.FLOAT
    b = _Builder(ft, s.rms_eps)
    fnp = np.float16 if s.fp16 else np.float32
    b.const("rot", rotation_matrix(D, n_rot, rope_neox).astype(fnp))
    eps = b.scalar("eps", s.rms_eps)

    h = b.rmsnorm("x", eps)  # attn_norm is folded into w_qkv
    qkv = b.op("Gemm", h, "w_qkv", *(["b_qkv"] if s.qkv_bias else []), transB=1)
    q, k, v = b.op("Split", qkv, b.shape("qkv_split", [q_dim, kv_dim, kv_dim]), axis=1, n_out=3)
    q = b.op("Reshape", q, b.shape("q_heads", [T, H, D]))
    k = b.op("Reshape", k, b.shape("kv_heads", [T, Hk, D]))
    v = b.op("Reshape", v, "kv_heads")
    if s.qk_norm:
        q, k = b.rmsnorm(q, eps, "q_norm"), b.rmsnorm(k, eps, "k_norm")
    q, k = b.rope(q), b.rope(k)

    # The new rows as the cache will hold them; attention reads these, as it reads the cache.
    if s.fp16:
        k_new, v_new = b.op("Identity", k), b.op("Identity", v)
        k_all = b.op("Concat", "past_k", k_new, axis=0)
        v_all = b.op("Concat", "past_v", v_new, axis=0)
    else:
        k_new, v_new = b.op("Cast", k, to=TensorProto.FLOAT16), b.op("Cast", v, to=TensorProto.FLOAT16)
        k_all = b.op("Cast", b.op("Concat", "past_k", k_new, axis=0), to=ft)
        v_all = b.op("Cast", b.op("Concat", "past_v", v_new, axis=0), to=ft)

    # GQA: the G query heads sharing a KV head are stacked as extra rows of one matmul.
    qg = b.op("Reshape", b.op("Transpose", b.op("Reshape", q, b.shape("q_groups", [T, Hk, G, D])), perm=[1, 2, 0, 3]),
              b.shape("q_stack", [Hk, G * T, D]))
    kt = b.op("Transpose", k_all, perm=[1, 2, 0])  # (Hk, D, S+T)
    vt = b.op("Transpose", v_all, perm=[1, 0, 2])  # (Hk, S+T, D)
    scores = b.op("Mul", b.op("MatMul", qg, kt), b.scalar("scale", 1.0 / float(np.sqrt(D))))
    scores = b.op("Add", b.op("Reshape", scores, b.shape("score_groups", [Hk, G, T, S + T])), "mask")
    p = b.op("Reshape", b.op("Softmax", scores, axis=-1), b.shape("p_stack", [Hk, G * T, S + T]))
    ctx = b.op("Reshape", b.op("MatMul", p, vt), b.shape("ctx_groups", [Hk, G, T, D]))
    ctx = b.op("Reshape", b.op("Transpose", ctx, perm=[2, 0, 1, 3]), b.shape("ctx_rows", [T, q_dim]))
    ctx = b.op("Mul", ctx, "keep")  # a row that sees nothing attends to nothing (native: zeros)

    attn = b.op("Gemm", ctx, "wo", transB=1)
    h = b.rmsnorm(b.op("Add", "x", attn), eps)  # ffn_norm is folded into w_gu
    g, u = b.op("Split", b.op("Gemm", h, "w_gu", transB=1), b.shape("gu_split", [s.n_ff, s.n_ff]), axis=1, n_out=2)
    act = b.op("Mul", b.op("Mul", g, b.op("Sigmoid", g)), u)
    delta = b.op("Add", attn, b.op("Gemm", act, "w_down", transB=1))

    return _model(b, s, {"delta": delta, "k_new": k_new, "v_new": v_new})


def _model(b: _Builder, s: LayerShape, outputs: dict[str, str]) -> onnx.ModelProto:
    """The graph `b` built, its named outputs bound, as a checked ONNX model."""
    for name, node in outputs.items():
        b.nodes.append(helper.make_node("Identity", [node], [name]))
    info = lambda specs: [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(dt), list(sh))  # noqa: E731
                          for n, (sh, dt) in specs.items()]
    graph = helper.make_graph(b.nodes, s.name, info(s.inputs()), info(s.outputs()), initializer=b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="lever")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model
