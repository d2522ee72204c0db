"""The lanes an LLM's generations run in: `[pipeline] parallel` of them at once.

Under lever.api.llm: each call takes a lane before it touches the model. With one lane a call
has the engine to itself (a phone's whole compute); with N, up to N calls run from their own
threads and their trees share the target's streamed passes (lever.pipelines.batcher), each
giving the tokens it gives alone. A session runs one call at a time, whichever lane it is in.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import attrs

from lever.api.conversation import Session
from lever.pipelines.batcher import Batcher


@attrs.define
class Lanes:
    n: int  # generations at once
    batcher: Batcher | None = None  # their shared passes (n > 1)
    running: int = attrs.field(init=False, default=0)  # generations under way now
    _free: threading.BoundedSemaphore = attrs.field(init=False)
    _count: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    def __attrs_post_init__(self):
        self._free = threading.BoundedSemaphore(self.n)

    @property
    def busy(self) -> bool:
        """Every lane runs a generation (the next waits for one to end)."""
        return self.running >= self.n

    @contextlib.contextmanager
    def hold(self, session: Session | None) -> Iterator[Batcher | None]:
        """A lane for one generation (in `session`'s caches, when given); yields the passes it
        shares, None when it runs alone."""
        # the session first: a call waiting for its session's other call holds no lane meanwhile
        with session.lock if session is not None else contextlib.nullcontext(), self._free:
            with self._count:
                self.running += 1
            if self.batcher is not None:
                self.batcher.join()
            try:
                yield self.batcher
            finally:
                if self.batcher is not None:
                    self.batcher.leave()
                with self._count:
                    self.running -= 1

    @contextlib.contextmanager
    def all(self) -> Iterator[None]:
        """Every lane: no generation runs while this is held (closing the engine)."""
        with contextlib.ExitStack() as held:
            for _ in range(self.n):
                held.enter_context(self._free)
            yield
