"""The memory plan counts the QNN runtime's own allocations, and a run over the plan's bound gets
one line saying so."""

from lever.policy.memory import QNN_RUNTIME_BYTES, MemoryPlan, runtime_bytes_for
from lever.policy.placement import PlacementConfig

MIB = 2**20


def _plan(runtime: int = 0) -> MemoryPlan:
    return MemoryPlan(1 * MIB, 2 * MIB, 3 * MIB, 2 * MIB, 2 * MIB, 2 * MIB, 71 * MIB, runtime_bytes=runtime)


def test_a_qnn_placement_counts_the_runtime():
    assert runtime_bytes_for(PlacementConfig()) == 0
    assert runtime_bytes_for(PlacementConfig(verify="qnn", fallback="cpu")) == QNN_RUNTIME_BYTES
    plan, qnn = _plan(), _plan(QNN_RUNTIME_BYTES)
    assert qnn.total_bytes == plan.total_bytes + QNN_RUNTIME_BYTES
    assert "QNN runtime 224 MiB" in qnn.describe() and "QNN" not in plan.describe()
    # the shipped pair's measured QNN peak (295 MiB) is inside the bound once the runtime is counted
    assert plan.over_bound_warning(295 * MIB) is not None and qnn.over_bound_warning(295 * MIB) is None


def test_over_the_bound_is_one_line_with_figures():
    plan = _plan()
    assert plan.over_bound_warning(plan.rss_bound_bytes) is None
    w = plan.over_bound_warning(plan.rss_bound_bytes + 71 * MIB)
    assert w.startswith("peak RSS ") and "passed the memory plan's bound with margin (226 MiB) by 71 MiB" in w
    assert "\n" not in w
