"""Draft: the first stage of a cycle, proposing what the target verifies next.

It holds the prompt and starts the loop with the prefill chain; after each `Accepted` it sends
the next `TokenTree`, rooted at the newest accepted token and carrying the rows to commit. The
proposal policy is swappable: `NoDraft` proposes nothing (autoregressive decoding: Flash-AR is
this composition); the token-tree policies of speculative decoding plug in the same way.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from lever.graph import Stage
from lever.messages import Accepted, TokenTree
from lever.trace import Tracer


class DraftPolicy(Protocol):
    def start(self, prompt: list[int]) -> None: ...

    def propose(self, pass_id: int, root: int, commit: tuple[int, ...]) -> TokenTree: ...


@attrs.define
class NoDraft:
    """Proposes no guesses: each tree is the root token alone."""

    def start(self, prompt: list[int]) -> None:
        pass

    def propose(self, pass_id: int, root: int, commit: tuple[int, ...]) -> TokenTree:
        return TokenTree.chain(pass_id, [root], n_given=1, commit=commit)


def prefill_tree(prompt: list[int]) -> TokenTree:
    return TokenTree.chain(0, prompt, n_given=len(prompt), commit=())


@attrs.define
class Draft(Stage):
    """Accepted -> TokenTree, starting with the prompt."""

    name: str
    prompt: list[int]
    policy: DraftPolicy = attrs.field(factory=NoDraft)
    tracer: Tracer = attrs.field(factory=lambda: Tracer(enabled=False))
    INPUTS = {"accepted": Accepted}
    OUTPUTS = {"tree": TokenTree}

    def first(self) -> TokenTree:
        self.policy.start(self.prompt)
        return prefill_tree(self.prompt)

    def step(self, acc: Accepted) -> TokenTree:
        return self.policy.propose(acc.pass_id + 1, acc.tokens[-1], acc.keep)

    async def run(self, inputs, outputs):
        await outputs["tree"].send(self.first())
        async for acc in inputs["accepted"]:
            if acc.done:
                return
            with self.tracer.span(self.name, f"draft {acc.pass_id + 1}"):
                tree = self.step(acc)
            await outputs["tree"].send(tree)
