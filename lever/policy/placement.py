"""Placement: which backend runs each stage's work, from `[placement]` and `[qnn]`.

Lever's placement on a phone is the verification layers and the batched draft expansions on the
NPU (big matmuls at static shapes), single-node drafting and the output projection on the CPU.
Here that is a choice between this project's CPU kernels (`lever.backends.cpu.layer.layer_forward`) and the
QNN HTP backend (`lever.backends.qnn`, on the simulator the x86_64 wheel carries): both offer a
layer function with the same signature, which PrunedVerify and the Draft stage call. The output
projection always runs on the CPU, along the accepted path only. A config that asks for qnn
where it is not available fails with the reason, unless it names `fallback = "cpu"`.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from pathlib import Path

import attrs

from lever.backends import qnn
from lever.backends.cpu.layer import layer_forward
from lever.errors import LeverError

BACKENDS = ("cpu", "qnn")


def _backend(name: str, key: str) -> None:
    if name not in BACKENDS:
        raise LeverError(f"[placement] {key}: unknown backend {name!r} (known: {', '.join(BACKENDS)})")


@attrs.frozen
class PlacementConfig:
    """[placement]: where each stage's work runs."""

    verify: str = "cpu"  # the target's layers (PrunedVerify)
    draft_batch: str = "cpu"  # draft forwards over several tokens (tree expansion rounds, the prompt)
    draft_single: str = "cpu"  # draft forwards over one token: latency-bound, the CPU's
    fallback: str = ""  # "cpu": run what asked for qnn on the CPU when qnn is unavailable; "": fail

    def __attrs_post_init__(self):
        for key in ("verify", "draft_batch", "draft_single"):
            _backend(getattr(self, key), key)
        if self.draft_single != "cpu":
            raise LeverError("[placement] draft_single: one-token drafting is latency-bound and runs on the CPU "
                             f"in this version, got {self.draft_single!r}")
        if self.fallback not in ("", "cpu"):
            raise LeverError(f"[placement] fallback: {self.fallback!r} is not \"cpu\" or \"\"")


@attrs.frozen
class QnnConfig:
    """[qnn]: the HTP backend's settings."""

    precision: str = "fp16"  # HTP's native float; "fp32" builds only small graphs
    soc_model: int = 57  # Qualcomm's SoC id: 57 = Snapdragon 8 Gen 3, 69 = 8 Elite
    htp_arch: int = 75  # HTP version: 75 = V75 (8 Gen 3), 79 = V79 (8 Elite)
    cache_dir: str = "~/.cache/lever/qnn"  # compiled context binaries, so a second start is fast
    # Token-count buckets the graphs are compiled for. Starting at 2: HTP's one-row fp16 graph
    # rounds differently from the padded ones, and a pipeline's outputs must not depend on how
    # many tokens a pass happens to carry (speculative = autoregressive, token for token).
    token_buckets: tuple[int, ...] = attrs.field(default=(2, 4, 8, 16, 32, 64), converter=tuple)

    def __attrs_post_init__(self):
        if self.precision not in ("fp16", "fp32"):
            raise LeverError(f"[qnn] precision: {self.precision!r} is not \"fp16\" or \"fp32\"")
        if not self.token_buckets or any(b < 1 for b in self.token_buckets):
            raise LeverError(f"[qnn] token_buckets: need positive sizes, got {list(self.token_buckets)}")


@attrs.define
class Placement:
    """The layer functions a run uses, and where each stage ran (for the run summary)."""

    verify_fn: Callable = layer_forward
    draft_batch_fn: Callable | None = None  # None: the CPU
    where: dict[str, str] = attrs.field(factory=dict)
    runners: list = attrs.field(factory=list)  # QNN runners, for their padding and session figures


def qnn_runner(q: QnnConfig, spec, n_ctx: int):
    return qnn.QnnLayerRunner(spec, precision=q.precision, soc_model=q.soc_model, htp_arch=q.htp_arch,
                              cache_dir=Path(q.cache_dir).expanduser() if q.cache_dir else None,
                              token_buckets=tuple(q.token_buckets), n_ctx=n_ctx)


def placement_for(pc: PlacementConfig, q: QnnConfig, *, flash_mode: str, target_spec, draft_spec,
                  n_ctx: int) -> Placement:
    wants = [k for k in ("verify", "draft_batch") if getattr(pc, k) == "qnn"]
    use_qnn = bool(wants)
    reason = ""
    if use_qnn:

        if not qnn.is_available():
            reason = qnn.unavailable_reason()
            if pc.fallback != "cpu":
                raise LeverError(f"[placement] {wants[0]} = \"qnn\": the QNN backend is unavailable here ({reason}); "
                                 "install onnxruntime-qnn or set [placement] fallback = \"cpu\"")
            use_qnn = False
    label = f"qnn HTP {q.precision}" + (" (simulator)" if use_qnn and _simulated() else "")
    p = Placement(where={"flash": flash_mode, "lm_head": "cpu (accepted path only)"})
    for key in ("verify", "draft_batch", "draft_single"):
        on_qnn = getattr(pc, key) == "qnn" and use_qnn
        p.where[key] = label if on_qnn else ("cpu" if getattr(pc, key) == "cpu" else f"cpu (fallback: {reason})")
    if use_qnn and pc.verify == "qnn":
        r = qnn_runner(q, target_spec, n_ctx)
        p.verify_fn, p.runners = r.forward, p.runners + [r]
    if use_qnn and pc.draft_batch == "qnn" and draft_spec is not None:
        r = qnn_runner(q, draft_spec, n_ctx)
        p.draft_batch_fn, p.runners = r.forward, p.runners + [r]
    return p


def _simulated() -> bool:
    """This machine is not a Snapdragon: the HTP backend runs Qualcomm's simulator."""

    return platform.machine() in ("x86_64", "AMD64")
