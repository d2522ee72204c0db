"""The online corrections to the cost model (lever.policy.online)."""

from __future__ import annotations

import math

import pytest

from lever.dataflow.messages import PassTiming
from lever.errors import LeverError
from lever.policy.online import RATIO_BOUNDS, OnlineCost
from tests.policy.test_cost_model import best_tree, model


def timing_as(cm, n_tokens: int, *, read: float = 1.0, compute: float = 1.0, accept: float = 1.0,
              rows: int = 4) -> PassTiming:
    """A pass that took `read` / `compute` / `accept` times what `cm` predicts."""
    read_bytes = sum(cm.layer_read_bytes)
    return PassTiming(n_tokens, compute * cm.compute_s(n_tokens), 0.0, read * read_bytes / cm.read_bytes_per_s,
                      read_bytes, accept * cm.accept_s(rows))


def test_the_profile_stands_while_the_run_agrees_with_it():
    cm = model(bw=1e9)
    on = OnlineCost(cm)
    for _ in range(5):
        on.observe_pass(timing_as(cm, 16), accepted_rows=4)
        on.observe_draft(cm.expand_s(8), 8)
    s = on.scales
    assert (s.read, s.compute, s.draft, s.head) == pytest.approx((1.0, 1.0, 1.0, 1.0))
    assert on.model.verify_s(16) == pytest.approx(cm.verify_s(16))


def test_a_slower_flash_shows_within_a_few_cycles_and_grows_trees():
    cm = model(bw=2e9)
    on = OnlineCost(cm)
    before = best_tree(on.model)
    for _ in range(4):
        on.observe_pass(timing_as(cm, 16, read=4.0), accepted_rows=4)
    assert on.scales.read == pytest.approx(4.0, rel=0.1)
    assert on.model.read_s == pytest.approx(4 * cm.read_s, rel=0.1)
    assert on.scales.compute == pytest.approx(1.0)
    assert best_tree(on.model) > before
    assert len(on.history) == 4 and on.history[0].read < on.history[-1].read


def test_a_busier_cpu_makes_nodes_dearer_and_trees_smaller():
    cm = model(bw=20e9)  # compute matters
    on = OnlineCost(cm)
    before = best_tree(on.model)
    for _ in range(4):
        on.observe_pass(timing_as(cm, 16, compute=3.0, accept=2.0), accepted_rows=4)
        on.observe_draft(3.0 * cm.expand_s(4), 4)
    assert on.scales.compute == pytest.approx(3.0, rel=0.1) and on.scales.head == pytest.approx(2.0, rel=0.1)
    assert on.scales.draft == pytest.approx(3.0, rel=0.1)
    assert best_tree(on.model) < before


def test_measurements_gone_wrong_are_bounded_or_ignored():
    cm = model()
    on = OnlineCost(cm, weight=1.0)
    on.observe_pass(timing_as(cm, 8, read=1e6, rows=2), accepted_rows=2)
    assert on.scales.read == RATIO_BOUNDS[1]
    bad = PassTiming(8, math.nan, 0.0, 0.0, 0, math.inf)
    on.observe_pass(bad, accepted_rows=2)  # no reads, a NaN and an infinity: nothing learnt
    assert on.scales.compute == 1.0 and on.scales.head == 1.0 and on.scales.read == RATIO_BOUNDS[1]
    on.observe_draft(0.0, 4)
    assert on.scales.draft == 1.0


def test_weight_must_be_a_share():
    with pytest.raises(LeverError, match="weight"):
        OnlineCost(model(), weight=0.0)


def test_waits_for_cores_held_by_drafting_ahead_lengthen_the_pass_where_compute_is_exposed():
    waits = []
    for bw in (1e12, 1e8):  # compute-bound: the waits are on the critical path; read-bound: under the reads
        cm = model(bw=bw)
        on = OnlineCost(cm, weight=1.0)
        t = timing_as(cm, 16)
        on.observe_pass(PassTiming(t.n_tokens, t.compute_s, 0.0, t.read_s, t.read_bytes, t.accept_s,
                                   slot_wait_s=0.04), accepted_rows=4)
        assert on.scales.pass_delay_s == pytest.approx(0.04)
        waits.append(on.model.cycle_s(16, 0.01, 4) - cm.cycle_s(16, 0.01, 4))
    assert waits[0] == pytest.approx(0.04)
    assert 0 <= waits[1] < 0.04 / 2


def test_what_no_part_explains_is_a_fixed_cost_per_cycle_never_negative():
    from lever.policy.online import OVERHEAD_WEIGHT
    cm = model(bw=1e9)
    on = OnlineCost(cm)
    for _ in range(30):  # every cycle takes 30 ms more than its parts
        on.observe_cycle(cm.cycle_s(16, 0.01, 4) + 0.03, on.model.cycle_s(16, 0.01, 4))
    assert on.scales.overhead_s == pytest.approx(0.03, rel=0.05)
    assert on.model.cycle_s(16, 0.01, 4) == pytest.approx(cm.cycle_s(16, 0.01, 4) + 0.03, rel=0.01)
    before = best_tree(cm)
    assert best_tree(on.model) >= before  # a fixed cost per cycle: more tokens per cycle pay
    for _ in range(60):  # cycles faster than their parts: a part's error, not a negative cost
        on.observe_cycle(0.5 * cm.cycle_s(16, 0.01, 4), on.model.cycle_s(16, 0.01, 4))
    assert 0 <= on.scales.overhead_s < 1e-6
    on.observe_cycle(float("nan"), 0.1)
    assert math.isfinite(on.scales.overhead_s) and 0 < OVERHEAD_WEIGHT < 1


@pytest.mark.parametrize("read", [0.25, 1.0, 4.0])
def test_a_what_if_read_speed_holds_whatever_the_reads_measure(read):
    """[runtime] what_if_read_bytes_per_s: trees are priced at the what-if's reads (a phone's UFS
    behind this machine's cores), so neither the read scale nor the cycle's rest learns from
    this disk's reads; the compute still does."""
    cm = model(bw=1e9)
    on = OnlineCost(cm.with_read_bytes_per_s(4e9, what_if=True))
    for _ in range(4):
        on.observe_pass(timing_as(cm, 16, read=read, compute=2.0), accepted_rows=4)
        on.observe_cycle(measured_s=5.0 * cm.cycle_s(16, 0.0, 4), predicted_s=on.model.cycle_s(16, 0.0, 4))
    assert on.scales.read == 1.0 and on.scales.overhead_s == 0.0
    assert on.scales.compute == pytest.approx(2.0, rel=0.1)
    assert on.model.read_s == pytest.approx(cm.read_s / 4)
    assert best_tree(on.model) == best_tree(cm.with_read_bytes_per_s(4e9).scaled(compute=on.scales.compute))
