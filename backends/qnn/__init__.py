"""The QNN backend: transformer layers on a Qualcomm HTP (NPU) through onnxruntime-qnn.

`QnnLayerRunner` (runner.py) runs `lever.backends.cpu.layer.layer_forward` with the same arguments and
effects on HTP, from per-bucket static ONNX graphs of one layer (graphs.py) whose weights are
inputs. `is_available()` says whether this machine can run it (onnxruntime-qnn's x86_64 wheel
carries Qualcomm's HTP simulator, so it can here, slowly).
"""

from .graphs import MASK_NEG, LayerShape, build_layer, rope_tables, rotation_matrix
from .runner import (
                     DEFAULT_HTP_ARCH,
                     DEFAULT_SOC_MODEL,
                     TOKEN_BUCKETS,
                     PaddingStats,
                     QnnLayerRunner,
                     SessionStats,
                     bench,
                     is_available,
                     kv_buckets_for,
                     provider_options,
                     session_options,
                     unavailable_reason,
)

__all__ = [
    "DEFAULT_HTP_ARCH", "DEFAULT_SOC_MODEL", "MASK_NEG", "TOKEN_BUCKETS", "LayerShape", "PaddingStats",
    "QnnLayerRunner", "SessionStats", "bench", "build_layer", "is_available", "kv_buckets_for", "provider_options",
    "rope_tables", "rotation_matrix", "session_options", "unavailable_reason",
]
