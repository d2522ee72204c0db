"""QnnLayerRunner: `lever.backends.cpu.layer.layer_forward` on a Qualcomm HTP (NPU) through onnxruntime-qnn.

It sits beside the CPU kernels as a drop-in for one layer: `forward` takes layer_forward's
arguments and keeps its semantics (writes the tokens' K/V rows into the KVCache, attends over
cache rows [0, mask.shape[1]) through the mask), so a pipeline stage can hand a layer to the
NPU instead of the CPU. Shapes are static on HTP, so token rows and past KV rows are padded up
to buckets; one compiled session per (buckets, precision, layer traits) serves every layer,
the weights being graph inputs. The graph is graphs.py's.

Weight form: float16 (or float32) graph *inputs*, dequantized from the GGUF blocks on the CPU
(norm weights folded in), because that is the only form that keeps the target streamable: one
session per bucket serves all layers, whether a layer is resident or was just read from flash.
The alternatives measured worse or impossible here: QDQ int8/int4 weights need the weights as
initializers (the QNN EP leaves DequantizeLinear of a graph input unsupported, so the session
fails with CPU fallback disabled), i.e. compiled into a per-layer context binary that flash
streaming cannot feed; compiled-in float16 weights ran no faster on the simulator. The
simulator emulates the NPU on x86, where float16 is the slower precision: a layer call there is
far slower than the CPU's layer_forward, and dequantizing a layer to float16 when it is not
cached (numpy's float16 cast is most of it) adds a large cost of its own, so the figures say what
works, not a phone's speed. Compiled sessions load from `cache_dir` much faster than they
compile. Buckets: float32 results are bit-identical whatever the token or KV bucket; float16
ones too from 2 token rows up, but the 1-row graph rounds differently (one float16 ulp,
tests/backends/qnn/test_runner.py shows it), which flipped no argmax in a stories260K check
against the CPU. float32 graphs finalize only when small (larger ones fail with
QNN_COMMON_ERROR_MEM_ALLOC): fp16 is the working mode. The figures, from
`bench(MODEL.gguf, precision)` below, are in docs/measurements.md, 'QNN HTP on the simulator'.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
import time
import weakref
from pathlib import Path

import attrs
import numpy as np

from lever.backends.cpu.kv_cache import KVCache, causal_mask
from lever.backends.cpu.layer import LayerWeights, Weight, layer_forward
from lever.errors import LeverError
from lever.gguf.spec import ModelSpec
from lever.model.finite import NonFiniteError, finite, first_bad_row
from lever.model.transformer import Model

from .graphs import MASK_NEG, LayerShape, build_layer, rope_tables

EP_NAME = "QNNExecutionProvider"
TOKEN_BUCKETS = (1, 4, 8, 16, 32, 64)
MIN_KV_BUCKET = 64
# Snapdragon 8 Gen 3 (SM8650): QNN soc_model 57, HTP v75. (SM8550 / 8 Gen 2 is 43 / v73,
# SM8750 / 8 Elite 69 / v79, SM8850 87 / v81: the QcomChipset table of Qualcomm's SDK.) The
# simulator accepts any pair, so it cannot check them.
DEFAULT_SOC_MODEL = 57
DEFAULT_HTP_ARCH = 75
DEFAULT_WEIGHT_CACHE_BYTES = 256 << 20

_lock = threading.Lock()
_availability: list[tuple[bool, str]] = []  # cached (ok, reason), filled once


def _ort():
    import onnxruntime as ort
    import onnxruntime_qnn

    return ort, onnxruntime_qnn


def _ensure_registered() -> list:
    """The QNN EP devices, registering the plugin library once per process (a second
    registration under the same name is an error in onnxruntime)."""
    ort, qnn = _ort()
    devices = [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]
    if not devices:
        ort.register_execution_provider_library(EP_NAME, qnn.get_library_path())
        devices = [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]
    if not devices:
        raise LeverError(f"onnxruntime-qnn registered no {EP_NAME} device")
    return devices


def provider_options(precision: str, soc_model: int | None = DEFAULT_SOC_MODEL,
                     htp_arch: int | None = DEFAULT_HTP_ARCH) -> dict[str, str]:
    """QNN EP options for the HTP backend.

    fp16: the graph is float16 throughout, so HTP computes in float16 whatever the options;
    enable_htp_fp16_precision (which the EP accepts only with a soc_model) is set when a
    soc_model is given. fp32: float32 graph, enable_htp_fp16_precision=0 and never a soc_model:
    on this QNN (2.40 / onnxruntime-qnn 2.7) any soc_model makes HTP compute in float16, and
    does so for every session created later in the process (see _note_soc_model)."""
    _, qnn = _ort()
    # Keys starting with "_" are the runner's own, not passed to the EP.
    opts = {"backend_path": qnn.get_qnn_htp_path(), "htp_performance_mode": "burst", "_precision": precision}
    if precision == "fp16":
        opts["enable_htp_fp16_precision"] = "1" if soc_model is not None else "0"
        if soc_model is not None:
            opts["soc_model"] = str(soc_model)
        if htp_arch is not None:
            opts["htp_arch"] = str(htp_arch)
    elif precision == "fp32":
        opts["enable_htp_fp16_precision"] = "0"
    else:
        raise LeverError(f"QNN precision must be 'fp16' or 'fp32', not {precision!r}")
    return opts


_soc_model_sessions: list[str] = []  # soc_model of any session made in this process


def _note_soc_model(opts: dict[str, str]) -> None:
    """Refuse a float32 session once any session of this process set a soc_model: the HTP
    backend keeps that setting process-wide, and a float32 session created afterwards silently
    computes in float16 (measured: docs/measurements.md, 'QNN HTP on the simulator'; sessions
    created before keep float32). tests/backends/qnn/test_runner.py checks that it still does."""
    if "soc_model" in opts:
        _soc_model_sessions.append(opts["soc_model"])
    elif opts.get("_precision") == "fp32" and _soc_model_sessions and not opts.get("_allow_fp16_leak"):
        raise LeverError(f"a float32 QNN session after a session with soc_model {_soc_model_sessions[0]} in the "
                         "same process would compute in float16; use precision='fp32' in a process of its own, "
                         "or fp16 with soc_model=None")


def session_options(provider_opts: dict[str, str], *, context_file: Path | None = None,
                    profile_prefix: str | None = None):
    """SessionOptions that put the whole graph on QNN or fail: with CPU fallback disabled, a
    node HTP cannot run makes session creation raise instead of running on the CPU EP."""
    ort, _ = _ort()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if context_file is not None:
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_embed_mode", "1")
        so.add_session_config_entry("ep.context_file_path", str(context_file))
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    _note_soc_model(provider_opts)
    so.add_provider_for_devices(_ensure_registered(), {k: v for k, v in provider_opts.items() if not k.startswith("_")})
    return so


def _probe() -> tuple[bool, str]:
    try:
        ort, qnn = _ort()
    except ImportError as e:
        return False, f"onnxruntime-qnn not importable ({e}); pip install -e '.[qnn]'"
    try:
        from onnx import TensorProto, helper
    except ImportError as e:
        return False, f"onnx not importable ({e}); pip install -e '.[qnn]'"
    try:
        g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["c"])], "probe",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4]) for n in "ab"],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 4])])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        sess = ort.InferenceSession(m.SerializeToString(), session_options(provider_options("fp32")))
        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        c = sess.run(None, {"a": a, "b": a})[0]
        if not np.array_equal(c, 2 * a):
            return False, f"a 1-node HTP session ran but returned {c.tolist()} for 2*{a.tolist()}"
    except Exception as e:  # noqa: BLE001 (registration, backend load, finalize: any of them means "not here")
        return False, f"QNN HTP backend not usable ({type(e).__name__}: {e})"
    return True, f"onnxruntime {ort.__version__}, onnxruntime-qnn {qnn.__version__}, HTP backend runs"


def _availability_once() -> tuple[bool, str]:
    with _lock:
        if not _availability:
            _availability.append(_probe())
        return _availability[0]


def is_available() -> bool:
    """onnxruntime-qnn imports, its plugin registers and a 1-node HTP session runs (cached)."""
    return _availability_once()[0]


def unavailable_reason() -> str:
    """Why is_available() is False ('' when it is True)."""
    ok, reason = _availability_once()
    return "" if ok else reason


@attrs.define
class PaddingStats:
    """Rows computed against rows needed, summed over layer calls: token rows (queries) and
    past KV rows (keys/values attended, before the new tokens' own)."""

    calls: int = 0
    tok_rows_real: int = 0
    tok_rows_computed: int = 0
    kv_rows_real: int = 0
    kv_rows_computed: int = 0

    @property
    def tok_waste(self) -> float:
        return 1.0 - self.tok_rows_real / self.tok_rows_computed if self.tok_rows_computed else 0.0

    @property
    def kv_waste(self) -> float:
        return 1.0 - self.kv_rows_real / self.kv_rows_computed if self.kv_rows_computed else 0.0


@attrs.define
class SessionStats:
    created: int = 0  # sessions compiled from a layer graph
    loaded: int = 0  # sessions loaded from a context binary in cache_dir
    create_s: float = 0.0  # total time spent creating or loading sessions
    run_s: float = 0.0  # total time inside session.run
    runs: int = 0


def kv_buckets_for(n_ctx: int) -> tuple[int, ...]:
    """Powers of two from MIN_KV_BUCKET up to n_ctx, and n_ctx itself."""
    out, b = [], MIN_KV_BUCKET
    while b < n_ctx:
        out.append(b)
        b *= 2
    out.append(max(n_ctx, MIN_KV_BUCKET) if not out else n_ctx)
    return tuple(sorted(set(out)))


def _bucket(n: int, buckets: tuple[int, ...], what: str) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise LeverError(f"{what} of {n} exceed the largest bucket {buckets[-1]}")


class _Dequantized:
    """A layer's weights as the graph takes them: fused QKV and gate/up with the norms folded
    in, float16 or float32."""

    def __init__(self, lw: LayerWeights, dtype):
        self.lw = lw  # keeps the layer alive, so that its id() is not reused while cached
        self.arrays = _dequantize_layer(lw, dtype)
        self.nbytes = sum(a.nbytes for a in self.arrays.values())


def _dequantize_stack(mats: list[Weight], dtype, col_scale: np.ndarray | None = None) -> np.ndarray:
    """Matrices stacked by rows, dequantized, optionally times a per-column scale (a norm's
    weight folded in: (x/rms * w) @ W^T == (x/rms) @ (W * w)^T), then cast to dtype."""
    out = np.empty((sum(m.n_out for m in mats), mats[0].n_in), dtype)
    r = 0
    for m in mats:
        rows = m.dequantize()
        if col_scale is not None:
            rows *= col_scale
        out[r : r + m.n_out] = rows
        r += m.n_out
    return out


def _dequantize_layer(lw: LayerWeights, dtype) -> dict[str, np.ndarray]:
    vec = lambda a: np.ascontiguousarray(a, dtype)
    attn_norm = np.asarray(lw.attn_norm, np.float32)
    ffn_norm = np.asarray(lw.ffn_norm, np.float32)
    arrays = {
        "w_qkv": _dequantize_stack([lw.wq, lw.wk, lw.wv], dtype, attn_norm),
        "wo": _dequantize_stack([lw.wo], dtype),
        "w_gu": _dequantize_stack([lw.w_gate, lw.w_up], dtype, ffn_norm),
        "w_down": _dequantize_stack([lw.w_down], dtype),
    }
    if lw.bq is not None or lw.bk is not None or lw.bv is not None:
        zeros = lambda w: np.zeros(w.n_out, np.float32)
        parts = [lw.bq if lw.bq is not None else zeros(lw.wq), lw.bk if lw.bk is not None else zeros(lw.wk),
                 lw.bv if lw.bv is not None else zeros(lw.wv)]
        arrays["b_qkv"] = vec(np.concatenate(parts))
    if lw.q_norm is not None or lw.k_norm is not None:
        arrays["q_norm"] = vec(lw.q_norm if lw.q_norm is not None else np.ones_like(lw.k_norm))
        arrays["k_norm"] = vec(lw.k_norm if lw.k_norm is not None else np.ones_like(lw.q_norm))
    return arrays


def _rows_array(rows, n_ctx: int) -> np.ndarray:
    if isinstance(rows, slice):
        return np.arange(*rows.indices(n_ctx), dtype=np.int64)
    return np.asarray(rows, np.int64).reshape(-1)


class QnnLayerRunner:
    """Runs transformer layers of one model on HTP; see the module docstring.

    precision: "fp16" (HTP's native float; weights and activations float16, residual stream
    float32 on the CPU) or "fp32" (float32 graph, enable_htp_fp16_precision=0).
    cache_dir: where compiled sessions are kept as QNN context binaries (EPContext models),
    so that a later process loads them instead of compiling.
    weight_cache_bytes: bound of the dequantized weights kept per LayerWeights object (LRU),
    from the second call with the same object on (see `weights`); 0 dequantizes on every call.
    soc_model/htp_arch: the HTP target of fp16 sessions (None: the backend's default); never
    used by fp32 sessions (see provider_options).
    """

    def __init__(self, spec: ModelSpec, precision: str = "fp16", soc_model: int | None = DEFAULT_SOC_MODEL,
                 htp_arch: int | None = DEFAULT_HTP_ARCH, cache_dir: str | os.PathLike | None = None,
                 token_buckets: tuple[int, ...] = TOKEN_BUCKETS, kv_buckets: tuple[int, ...] | None = None,
                 n_ctx: int | None = None, weight_cache_bytes: int = DEFAULT_WEIGHT_CACHE_BYTES):
        if not is_available():
            raise LeverError(f"QNN backend unavailable: {unavailable_reason()}")
        self.spec = spec
        self.precision = precision
        self.provider_opts = provider_options(precision, soc_model, htp_arch)
        self.fp16 = precision == "fp16"
        self.dtype = np.float16 if self.fp16 else np.float32
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.token_buckets = tuple(sorted(token_buckets))
        self.kv_buckets = tuple(sorted(kv_buckets)) if kv_buckets else kv_buckets_for(n_ctx or spec.n_ctx_train)
        self.weight_cache_bytes = weight_cache_bytes
        self.padding = PaddingStats()
        self.sessions_stats = SessionStats()
        self._sessions: dict[LayerShape, object] = {}
        self._weights: collections.OrderedDict[int, _Dequantized] = collections.OrderedDict()
        self._weights_bytes = 0
        self._seen: dict[int, weakref.ref] = {}  # layers met once: cached if met again

    # -- sessions

    def shape(self, lw: LayerWeights, n_tok: int, n_past: int) -> LayerShape:
        s = self.spec
        return LayerShape(n_tok=n_tok, n_past=n_past, n_embd=s.n_embd, n_ff=s.n_ff, n_head=s.n_head,
                          n_head_kv=s.n_head_kv, head_dim=s.head_dim, rms_eps=float(s.rms_eps),
                          qkv_bias=lw.bq is not None or lw.bk is not None or lw.bv is not None,
                          qk_norm=lw.q_norm is not None or lw.k_norm is not None, fp16=self.fp16)

    def _context_path(self, shape: LayerShape, model_bytes: bytes) -> Path:
        ort, qnn = _ort()
        key = hashlib.sha256(model_bytes + repr(sorted(self.provider_opts.items())).encode()
                             + f"{ort.__version__}/{qnn.__version__}".encode()).hexdigest()[:16]
        return self.cache_dir / f"{shape.name}_{key}_ctx.onnx"

    def session(self, shape: LayerShape):
        sess = self._sessions.get(shape)
        if sess is None:
            sess = self._sessions[shape] = self._create(shape)
        return sess

    def _create(self, shape: LayerShape):
        try:
            return self._create_session(shape)
        except LeverError:
            raise
        except Exception as e:
            hint = ("float32 layer graphs finalize on HTP only when small (on the simulator: stories260K up "
                    "to 48 token rows, not one row of Qwen2.5-0.5B); use precision='fp16' or smaller buckets"
                    if not self.fp16 else "")
            raise LeverError(f"QNN could not create the session for {shape.name}: {e}. {hint}".strip()) from e

    def _create_session(self, shape: LayerShape):
        ort, _ = _ort()
        t0 = time.perf_counter()
        model = build_layer(shape, self.spec.n_rot, self.spec.rope_neox).SerializeToString()
        if self.cache_dir is None:
            sess = ort.InferenceSession(model, session_options(self.provider_opts))
            self.sessions_stats.created += 1
        else:
            ctx = self._context_path(shape, model)
            if ctx.exists():
                sess = ort.InferenceSession(str(ctx), session_options(self.provider_opts))
                self.sessions_stats.loaded += 1
            else:
                # Written under a temporary name and renamed, so that a process that dies while
                # compiling, or another one racing it, never leaves a half-written cache file.
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                tmp = ctx.with_name(f".{ctx.stem}.{os.getpid()}.onnx")
                sess = ort.InferenceSession(model, session_options(self.provider_opts, context_file=tmp))
                os.replace(tmp, ctx)
                self.sessions_stats.created += 1
        self.sessions_stats.create_s += time.perf_counter() - t0
        return sess

    def placement(self, shape: LayerShape, profile_dir: str | os.PathLike) -> dict[str, str]:
        """Which execution provider ran each node of `shape`'s graph: a fresh profiled session
        runs it once on zeros and onnxruntime's profile names the provider of every node it
        ran. A graph wholly on HTP is one fused node whose provider is QNNExecutionProvider."""
        import json

        ort, _ = _ort()
        model = build_layer(shape, self.spec.n_rot, self.spec.rope_neox).SerializeToString()
        so = session_options(self.provider_opts, profile_prefix=str(Path(profile_dir) / "qnn_placement"))
        sess = ort.InferenceSession(model, so)
        sess.run(None, {n: np.zeros(sh, dt) for n, (sh, dt) in shape.inputs().items()})
        with open(sess.end_profiling()) as f:
            events = json.load(f)
        return {e["name"]: e["args"].get("provider", "") for e in events if e.get("cat") == "Node"}

    # -- weights

    def weights(self, lw: LayerWeights) -> dict[str, np.ndarray]:
        """The graph's weight inputs for `lw`. Kept (LRU, weight_cache_bytes) from the second
        call with the same object on: resident layers come back as the same object every pass,
        while a layer read from flash is a new object each time, so it is dequantized and dropped
        and never pushes a resident layer out."""
        key = id(lw)
        entry = self._weights.get(key)
        if entry is not None and entry.lw is lw:
            self._weights.move_to_end(key)
            return entry.arrays
        entry = _Dequantized(lw, self.dtype)
        seen = self._seen.get(key)
        if seen is not None and seen() is lw and entry.nbytes <= self.weight_cache_bytes:
            self._weights[key] = entry
            self._weights_bytes += entry.nbytes
            while self._weights_bytes > self.weight_cache_bytes:
                _, old = self._weights.popitem(last=False)
                self._weights_bytes -= old.nbytes
        elif seen is None or seen() is not lw:
            # the callback forgets the id when lw dies, before anything can reuse it
            self._seen[key] = weakref.ref(lw, lambda _, k=key: self._seen.pop(k, None))
        return entry.arrays

    # -- forward

    def forward(self, spec: ModelSpec, lw: LayerWeights, x: np.ndarray, *, pos: np.ndarray, mask: np.ndarray,
                cache: KVCache, layer: int, rows, inv_freq: np.ndarray) -> np.ndarray:
        """lever.backends.cpu.layer.layer_forward on HTP: the new hidden state (n_tok, n_embd) float32; the
        tokens' K/V are written into cache rows `rows`. More tokens than the largest token
        bucket run in chunks, in order, so a token may see rows of its own or earlier chunks.
        The new K/V rows are rounded to float16 before attention, as a float16 KVCache (the
        default) stores them; with a float32 cache this differs from layer_forward by that
        rounding."""
        if spec is not self.spec and spec != self.spec:
            raise LeverError("QnnLayerRunner.forward: spec differs from the runner's")
        x = np.asarray(x, np.float32)
        pos = np.asarray(pos)
        mask = np.asarray(mask, bool)
        n_tok, n_seen = x.shape[0], mask.shape[1]
        if mask.shape[0] != n_tok or len(pos) != n_tok:
            raise LeverError(f"forward: {n_tok} tokens with mask {mask.shape} and {len(pos)} positions")
        new_rows = _rows_array(rows, cache.n_ctx)
        if len(new_rows) != n_tok:
            raise LeverError(f"forward: {n_tok} tokens but {len(new_rows)} cache rows")
        out = np.empty_like(x)
        step = self.token_buckets[-1]
        for a in range(0, n_tok, step):
            b = min(a + step, n_tok)
            later = new_rows[b:]
            later = later[later < n_seen]
            if later.size and mask[a:b][:, later].any():
                raise LeverError("forward: a token sees a row of a later chunk; order tokens so that each "
                                 f"sees only earlier ones, or raise the largest token bucket ({step})")
            out[a:b] = self._forward_chunk(lw, x[a:b], pos=pos[a:b], mask=mask[a:b], cache=cache, layer=layer,
                                            new_rows=new_rows[a:b], inv_freq=inv_freq)
        if not finite(out) and finite(x):  # a max and a min; float16 on HTP overflows past 65504 where float32 does not
            bad = first_bad_row(out)
            raise NonFiniteError("hidden state", position=int(pos[bad]),
                                 layer=f"first in the output of layer {layer} on QNN",
                                 cause=f"the {self.precision} graph returned NaN or Inf from finite input "
                                       f"(an activation past float16's 65504?); [placement] on the CPU avoids it")
        return out

    def _forward_chunk(self, lw, x, *, pos, mask, cache, layer, new_rows, inv_freq) -> np.ndarray:
        spec = self.spec
        n_tok, n_seen = mask.shape
        is_new = np.zeros(n_seen, bool)
        is_new[new_rows[new_rows < n_seen]] = True
        past_visible = mask & ~is_new
        cols = np.flatnonzero(past_visible.any(axis=0))
        n_past = int(cols[-1]) + 1 if cols.size else 0
        T = _bucket(n_tok, self.token_buckets, "tokens")
        S = _bucket(max(n_past, 1), self.kv_buckets, "past KV rows")
        shape = self.shape(lw, T, S)

        feed = dict(self.weights(lw))
        f = self.dtype
        xp = np.zeros((T, spec.n_embd), f)
        xp[:n_tok] = x
        add = np.full((T, S + T), MASK_NEG, np.float32)
        add[:n_tok, :n_past] = np.where(past_visible[:, :n_past], 0.0, MASK_NEG)
        seen_new = new_rows < n_seen
        own = np.zeros((n_tok, n_tok), bool)
        own[:, seen_new] = mask[:, new_rows[seen_new]]
        add[:n_tok, S : S + n_tok] = np.where(own, 0.0, MASK_NEG)
        keep = np.zeros((T, 1), f)
        keep[:n_tok, 0] = (past_visible.any(axis=1) | own.any(axis=1))
        cos, sin = rope_tables(pos, inv_freq, spec.head_dim, spec.n_rot, spec.rope_neox, T)
        feed.update(x=xp, mask=add.astype(f), keep=keep, cos=cos.astype(f), sin=sin.astype(f),
                    past_k=self._past(cache.k[layer], S), past_v=self._past(cache.v[layer], S))

        sess = self.session(shape)
        t0 = time.perf_counter()
        delta, k_new, v_new = sess.run(None, feed)
        self.sessions_stats.run_s += time.perf_counter() - t0
        self.sessions_stats.runs += 1
        p = self.padding
        p.calls += 1
        p.tok_rows_real += n_tok
        p.tok_rows_computed += T
        p.kv_rows_real += n_past
        p.kv_rows_computed += S

        cache.k[layer][new_rows] = k_new[:n_tok]
        cache.v[layer][new_rows] = v_new[:n_tok]
        return x + delta[:n_tok].astype(np.float32)

    @staticmethod
    def _past(rows: np.ndarray, S: int) -> np.ndarray:
        """Cache rows [0, S) as float16, without a copy when the cache has them in float16 (rows
        past the real ones are masked, whatever they hold); zero-padded when the bucket outgrows
        the cache."""
        if S <= rows.shape[0]:
            return rows[:S] if rows.dtype == np.float16 else rows[:S].astype(np.float16)
        out = np.zeros((S,) + rows.shape[1:], np.float16)
        out[: rows.shape[0]] = rows
        return out

    def model_forward(self, model, tokens: np.ndarray, pos: np.ndarray, mask: np.ndarray, cache: KVCache) -> np.ndarray:
        """lever.model.transformer.Model.forward with every layer on HTP: hidden states after the last
        layer; the cache gains len(tokens) pending rows."""
        rows = cache.reserve(len(tokens))
        x = model.embed(tokens)
        for i, lw in enumerate(model.layers):
            x = self.forward(model.spec, lw, x, pos=pos, mask=mask, cache=cache, layer=i, rows=rows,
                             inv_freq=model.inv_freq)
        return x


def bench(model_path: str, precision: str = "fp16", n_toks=(1, 8, 32), n_past: int = 40, reps: int = 15) -> dict:
    """Median ms per call of layer 0, QNN (weights cached) against the CPU layer_forward, at
    each token count after n_past committed rows (KV bucket 64)."""
    model = Model(model_path)
    spec, lw = model.spec, model.layers[0]

    def median_ms(f) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return float(np.median(times)) * 1e3

    def one(n: int) -> dict:
        cache = model.new_cache(n_past + n)
        model.forward(np.arange(n_past) % spec.n_vocab, np.arange(n_past), causal_mask(0, n_past), cache)
        x, pos, mask = model.embed(np.arange(n) % spec.n_vocab), np.arange(n_past, n_past + n), causal_mask(n_past, n)
        rows = cache.reserve(n)
        runner = QnnLayerRunner(spec, precision, soc_model=DEFAULT_SOC_MODEL if precision == "fp16" else None,
                                token_buckets=(n,), kv_buckets=(64,))

        def qnn_call():
            runner.forward(spec, lw, x, pos=pos, mask=mask, cache=cache, layer=0, rows=rows, inv_freq=model.inv_freq)

        qnn_call()
        qnn_call()  # compiled, weights cached (met twice)
        return {"cpu_ms": median_ms(lambda: layer_forward(spec, lw, x, pos=pos, mask=mask, cache=cache, layer=0,
                                                          rows=rows, inv_freq=model.inv_freq)),
                "qnn_ms": median_ms(qnn_call), "compile_s": runner.sessions_stats.create_s}

    out = {n: one(n) for n in n_toks}
    return out

