"""Admission: how many requests `lever serve` holds, and how they end on shutdown.

Below the server's routes (lever.serve.server), beside request preparation: one generation runs
and `queue` wait beside it; past them a request gets 429. Each admitted request's cancel event is
tracked, so shutdown can refuse new requests at once and cancel the admitted ones after a grace.
"""

from __future__ import annotations

import threading

import attrs

from lever.serve.request import BadRequest

SHUTTING_DOWN = ("the server is shutting down", 503, "server_shutting_down")


@attrs.define
class Admission:
    """The queue's count and the admitted requests' cancel events; safe from any thread."""

    queue: int = 8  # requests that may wait beside the one running
    admitted: int = 0  # running + waiting
    closing: bool = False
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _cancels: set = attrs.field(factory=set)  # the admitted requests' cancel events

    def admit(self) -> None:
        """A request joins: 503 when the server is stopping, 429 past the queue."""
        with self._lock:
            if self.closing:
                raise BadRequest(SHUTTING_DOWN[0], status=503, kind=SHUTTING_DOWN[2])
            if self.admitted > self.queue:  # one running and `queue` waiting
                raise BadRequest(f"the server is busy: {self.queue} requests already wait", status=429,
                                 kind="rate_limit_exceeded")
            self.admitted += 1

    def release(self) -> None:
        with self._lock:
            self.admitted -= 1

    def track(self, cancel: threading.Event) -> None:
        """An admitted request's cancel event: set at once when the server is stopping already."""
        with self._lock:
            self._cancels.add(cancel)
            if self.closing:
                cancel.set()

    def untrack(self, cancel: threading.Event) -> None:
        with self._lock:
            self._cancels.discard(cancel)

    def shutdown(self, grace_s: float) -> None:
        """Refuse new requests; cancel the admitted ones after `grace_s`. Safe from a signal
        handler: it sets a flag and starts a timer."""
        with self._lock:
            self.closing = True
        timer = threading.Timer(grace_s, self._cancel_all)
        timer.daemon = True
        timer.start()

    def _cancel_all(self) -> None:
        with self._lock:
            for c in self._cancels:
                c.set()
