"""Online estimates: the cost model corrected, cycle by cycle, by what the run measures.

The profile (lever.policy.profile) is measured once, on a quiet machine; a run is not quiet.
Flash slows down when it heats or another app reads, the cores are shared with the reader
threads, the draft and the rest of the phone, and a kernel is slower at a long context than
the profile's. So TreeExpand keeps an `OnlineCost` beside its cost model: after every cycle
it compares what the pass, Accept and the in-turn draft forwards measured (`PassTiming`, its
own clocks) with what the model predicted for the same sizes, and keeps a short moving
estimate of each ratio. The trees of the next cycle are priced with the model scaled by them
(`CostModel.scaled`): a slower flash makes nodes cheaper against the pass and trees grow, a
busier CPU makes them dearer and trees shrink, within a few cycles.
"""

from __future__ import annotations

import math

import attrs

from lever.dataflow.messages import PassTiming
from lever.errors import LeverError
from lever.policy.cost_model import CostModel

# of the newest cycle: a change of speed shows within 2-4 cycles, one noisy cycle moves it half way
DEFAULT_WEIGHT = 0.5
OVERHEAD_WEIGHT = 0.25  # of the newest cycle's unexplained rest: a fixed cost, so a longer memory
RATIO_BOUNDS = (0.1, 10.0)  # a ratio outside is a measurement gone wrong (a stall, a clock), not a machine


@attrs.frozen
class Scales:
    """Measured over predicted time of each part of a cycle (1.0: the profile holds)."""

    read: float = 1.0
    compute: float = 1.0
    draft: float = 1.0
    head: float = 1.0
    pass_delay_s: float = 0.0  # not a ratio: seconds a pass waited for cores held by drafting ahead
    overhead_s: float = 0.0  # not a ratio: seconds a cycle took beyond what its parts predict


def _ema(old: float, measured_s: float, predicted_s: float, weight: float) -> float:
    if not (predicted_s > 0 and math.isfinite(measured_s) and measured_s > 0):
        return old
    ratio = min(max(measured_s / predicted_s, RATIO_BOUNDS[0]), RATIO_BOUNDS[1])
    return (1 - weight) * old + weight * ratio


@attrs.define
class OnlineCost:
    """A cost model and the measured corrections to it; `model` is the corrected one."""

    base: CostModel
    weight: float = DEFAULT_WEIGHT
    scales: Scales = attrs.field(factory=Scales)
    history: list[Scales] = attrs.field(factory=list)  # the scales after each cycle, for the summary
    _model: CostModel | None = None

    def __attrs_post_init__(self):
        if not 0 < self.weight <= 1:
            raise LeverError(f"online cost: weight must be in (0, 1], got {self.weight}")

    @property
    def model(self) -> CostModel:
        if self._model is None:
            s = self.scales
            self._model = self.base.scaled(read=s.read, compute=s.compute, draft=s.draft, head=s.head,
                                           pass_delay_s=s.pass_delay_s, overhead_s=s.overhead_s)
        return self._model

    def observe_pass(self, t: PassTiming, accepted_rows: int) -> None:
        """A pass and Accept: reads against the bytes at the profiled rate, compute against
        the model's for its node count, Accept against the head over the accepted rows, and
        the pass's waits for cores that drafting ahead held (added to the cycle as measured)."""
        s, b, w = self.scales, self.base, self.weight
        read = _ema(s.read, t.read_s, t.read_bytes / b.read_bytes_per_s, w) \
            if t.read_bytes and not b.read_what_if else s.read
        delay = (1 - w) * s.pass_delay_s + w * t.slot_wait_s if math.isfinite(t.slot_wait_s) else s.pass_delay_s
        self.scales = attrs.evolve(s, read=read, compute=_ema(s.compute, t.compute_s, b.compute_s(t.n_tokens), w),
                                   head=_ema(s.head, t.accept_s, b.accept_s(accepted_rows), w), pass_delay_s=delay)
        self.history.append(self.scales)
        self._model = None

    def observe_cycle(self, measured_s: float, predicted_s: float) -> None:
        """A whole cycle, tree sent to tree sent, against what the model (overhead included)
        predicted for it: the rest, which no part measures (the hand-offs between stages,
        building the tree, a pass started late), is a fixed cost per cycle, and a fixed cost
        makes a cycle worth more tokens: it is what lets a deep tree pay where the parts alone
        say it does not. Never below zero (a cycle faster than its parts is a part's error,
        which its own scale corrects) and averaged longer than the parts (OVERHEAD_WEIGHT):
        one cycle's rest is noisy, and it prices every node of the next tree."""
        if not (math.isfinite(measured_s) and math.isfinite(predicted_s) and measured_s > 0 and predicted_s > 0):
            return
        if self.base.read_what_if:  # the cycle's reads are not the what-if's: its rest would be theirs
            return
        s = self.scales
        rest = max(measured_s - (predicted_s - s.overhead_s), 0.0)
        self.scales = attrs.evolve(s, overhead_s=(1 - OVERHEAD_WEIGHT) * s.overhead_s + OVERHEAD_WEIGHT * rest)
        self._model = None

    def observe_draft(self, measured_s: float, batch: int) -> None:
        """One draft expansion drafted in turns (nothing else on the cores), of `batch` tokens."""
        if batch < 1 or not self.base.draft_batch:
            return
        self.scales = attrs.evolve(self.scales, draft=_ema(self.scales.draft, measured_s, self.base.expand_s(batch),
                                                           self.weight))
        self._model = None
