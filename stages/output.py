"""Output: the sink of a pipeline, collecting the emitted tokens and streaming them to a callback."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from lever.dataflow.graph import Stage
from lever.dataflow.messages import Accepted
from lever.model.stop import StopReason


@attrs.frozen
class OutputStats:
    """What a run emitted."""

    tokens: tuple[int, ...]
    accepted_per_pass: tuple[int, ...]  # tokens emitted by each pass, the prefill's first
    stop_reason: StopReason | None  # None: the run was cut before its end
    drafted_kept: int = 0  # emitted tokens that were tree nodes: drafts the target accepted

    @property
    def tokens_per_pass(self) -> float:
        """Tokens emitted per decoding pass (the prefill's pass is not one; 0 without any)."""
        n = len(self.accepted_per_pass) - 1
        return sum(self.accepted_per_pass[1:]) / n if n > 0 else 0.0


@attrs.define
class Output(Stage):
    name: str
    on_tokens: Callable[[tuple[int, ...]], None] | None = None
    INPUTS = {"emitted": Accepted}

    tokens: list[int] = attrs.field(factory=list)
    accepted_per_pass: list[int] = attrs.field(factory=list)  # tokens emitted by each pass
    stop_reason: StopReason | None = None
    drafted_kept: int = 0

    def step(self, acc: Accepted) -> None:
        self.tokens.extend(acc.tokens)
        self.accepted_per_pass.append(len(acc.tokens))
        self.drafted_kept += acc.drafted_kept
        if self.on_tokens:
            self.on_tokens(acc.tokens)
        if acc.done:
            self.stop_reason = acc.stop_reason

    def stats(self) -> OutputStats:
        return OutputStats(tuple(self.tokens), tuple(self.accepted_per_pass), self.stop_reason, self.drafted_kept)

    async def run(self, inputs, outputs):
        async for acc in inputs["emitted"]:
            self.step(acc)
