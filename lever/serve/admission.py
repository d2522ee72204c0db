"""Admission: how many requests `lever serve` holds, whose turn the model is, which slot shows
it, and how they end on shutdown.

Below the server's routes (lever.serve.server), beside request preparation: one generation runs
and `queue` wait beside it; past them a request gets 429, and so does one of a client (an API
key, on a server of several) already holding its share of the queue. Whose generation runs
next goes round the clients waiting (`Turns`), first come first served within one client's: a
client that queues ten requests gets one turn in each round, as another that queues one does, so
it cannot make the others wait behind all of its own. Each admitted request's cancel event is
tracked, so shutdown can refuse new requests at once and cancel the admitted ones after a grace.
llama-server's slots (`Slots`, `lever serve --parallel N`) are N conversations' caches of n_ctx
each: N generations run at once (their trees share the target's passes: lever.pipelines.batcher),
each in the slot that holds the most of its prompt, and the rest wait their turn in the queue.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading

import attrs

from lever.api import Cancelled
from lever.serve.request import BadRequest, shutting_down

WAIT_POLL_S = 0.1  # how often a waiting request looks at its cancel event


@attrs.define
class Admission:
    """The queue's count and the admitted requests' cancel events; safe from any thread."""

    queue: int = 8  # requests that may wait beside the running ones
    shared: bool = False  # several clients (API keys) to keep apart: each holds at most half the places
    admitted: int = 0  # running + waiting
    closing: bool = False
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _cancels: set = attrs.field(factory=set)  # the admitted requests' cancel events
    _by_client: collections.Counter = attrs.field(factory=collections.Counter)
    running: int = 1  # generations that run at once (the slots)

    @property
    def places(self) -> int:
        """Requests admitted at most: the running ones and the queue."""
        return self.queue + self.running

    @property
    def client_share(self) -> int:
        """Requests one client may have admitted: half the places (one at least) on a server of
        several keys; all of them where there is no other key to keep room for."""
        return max(self.places // 2, 1) if self.shared else self.places

    def admit(self, client: object = None) -> None:
        """A request of `client` joins: 503 when the server is stopping, 429 past the queue or
        past the client's share of it."""
        with self._lock:
            if self.closing:
                raise shutting_down()
            if self.admitted >= self.places:  # `running` running and `queue` waiting
                raise BadRequest(f"the server is busy: {self.queue} requests already wait", status=429,
                                 kind="rate_limit_exceeded")
            if self._by_client[client] >= self.client_share:
                raise BadRequest(f"this client already has {self._by_client[client]} requests running or waiting, "
                                 f"its share of the server's {self.places} places", status=429,
                                 kind="rate_limit_exceeded")
            self.admitted += 1
            self._by_client[client] += 1

    def release(self, client: object = None) -> None:
        with self._lock:
            self.admitted -= 1
            self._by_client[client] -= 1
            if not self._by_client[client]:
                del self._by_client[client]

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


@attrs.define
class Turns:
    """Whose generation runs: `n` at a time (the slots), the next round the clients waiting.
    Safe from any thread (a generation waits for its turn in its worker thread)."""

    n: int = 1
    _cond: threading.Condition = attrs.field(factory=threading.Condition)
    _waiting: dict = attrs.field(factory=dict)  # client -> deque of its tickets, first come first
    _round: collections.deque = attrs.field(factory=collections.deque)  # clients waiting, next first
    _running: int = 0
    served: collections.Counter = attrs.field(factory=collections.Counter)  # turns by client

    @contextlib.contextmanager
    def turn(self, client: object, cancel: threading.Event):
        """Waits for `client`'s turn (Cancelled when `cancel` is set first), holds it inside."""
        ticket = object()
        with self._cond:
            if client not in self._waiting:
                self._waiting[client] = collections.deque()
                self._round.append(client)
            self._waiting[client].append(ticket)
            while self._running >= self.n or self._waiting[self._round[0]][0] is not ticket:
                if cancel.is_set():
                    self._leave(client, ticket)
                    raise Cancelled("the generation was cancelled before it started")
                self._cond.wait(WAIT_POLL_S)
            self._leave(client, ticket)
            if client in self._waiting:  # its next request waits a round
                self._round.remove(client)
                self._round.append(client)
            self._running += 1
            self.served[client] += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def _leave(self, client: object, ticket: object) -> None:
        q = self._waiting[client]
        q.remove(ticket)
        if not q:
            del self._waiting[client]
            self._round.remove(client)
        self._cond.notify_all()


@attrs.define
class Slots:
    """llama-server's slots as Lever has them (GET /slots, /props' total_slots): `n` of them,
    each a context of `n_ctx` tokens (`lever serve --parallel`) and the caches of the
    conversation it last held. A generation that has its turn (Turns: at most `n` at once) takes
    the free slot holding the most of its prompt (`hold`), shown processing its task (its id,
    prompt tokens and settings) while it runs. Safe from any thread."""

    n: int = 1
    n_ctx: int = 0
    speculative: bool = True  # the pipeline drafts (llama-server's "speculative")
    _running: dict = attrs.field(factory=dict)  # slot -> its task
    _tasks: itertools.count = attrs.field(factory=itertools.count)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    @contextlib.contextmanager
    def hold(self, task: dict, score=None):
        """A free slot for `task` inside (its index): the one `score(slot)` ranks highest (how
        much of the prompt its caches hold), else the lowest free one."""
        with self._lock:
            free = [i for i in range(self.n) if i not in self._running]
            if not free:  # Turns lets at most n run: a slot is always free
                raise RuntimeError("no free slot: more generations running than slots")
            slot = max(free, key=lambda i: (score(i) if score is not None else 0, -i))
            self._running[slot] = {"id_task": next(self._tasks), **task}
        try:
            yield slot
        finally:
            with self._lock:
                del self._running[slot]

    @property
    def processing(self) -> int:
        with self._lock:
            return len(self._running)

    def view(self) -> list[dict]:
        """llama-server's /slots: each slot's id, context, whether it processes, its task's fields."""
        with self._lock:
            running = dict(self._running)
        return [{"id": i, "n_ctx": self.n_ctx, "speculative": self.speculative, "is_processing": i in running,
                 **running.get(i, {})} for i in range(self.n)]
