"""The flash backend: the target model's layers streamed from its GGUF file on every pass.

The pipeline's read stage drives a `FlashStore` (store.py): residency planned from a DRAM
budget (config.py), reads planned per layer (layout.py) into a fixed staging window
(pool.py), with optional emulation of a phone's flash and read counters (device.py), and
faults injected for the tests (faults.py).
"""

from .config import Budget, FlashConfig, parse_budget, plan_residency
from .device import FlashStats
from .faults import Faults, inject
from .layout import LayerExtent, Read
from .pool import BufferPool, StagingBuffer
from .store import FlashStore

__all__ = [
    "Budget", "BufferPool", "Faults", "FlashConfig", "FlashStats", "FlashStore", "LayerExtent", "Read",
    "StagingBuffer", "inject", "parse_budget", "plan_residency",
]
