"""The bytes `lever serve`'s requests hold, from their first byte to their end, in one bounded pool.

Below request preparation (lever.serve.prepare) and the server's routes (lever.serve.server),
which give each request a `Hold`: a request holds what it has, when it has it. Its body's bytes
as they arrive (not what it declares: a client that declares 4 MiB and sends 12 bytes holds 24),
then what parsing them may allocate (lever.serve.request.parse_bytes), then what its prepared
call keeps while it waits in the queue and runs (lever.api.Call, `call_bytes`). Every hold is
counted against the pool (the server's memory plan counts its capacity once) and against its
client's share of it: a client is an API key (on a server without keys, a peer address), and no
client may hold more than `share` of the pool, so one key's requests cannot take the room
another's need. A hold that cannot grow is refused with 503 at once, never waits.
"""

from __future__ import annotations

import collections
import threading

import attrs

from lever.serve.request import BadRequest

POOL_BYTES = 64 << 20  # requests' bodies, their parsing and their queued calls, together
SHARE = 0.5  # of the pool, one client's at most: another client always finds half


def server_parts(*, cache_bytes: int, live_bytes: int) -> dict[str, int]:
    """What a server holds beside its run, by part (bytes), as lever.serve.app builds it: the
    pool of requests, the kept conversations, the live page (0: none). `lever serve --mem`
    plans the run within what these leave (lever.cli.serve); Server.memory_plan reads the same
    parts off the server it built."""
    return {"requests": POOL_BYTES, "kept conversations": cache_bytes, "live page": live_bytes}


@attrs.define
class RequestPool:
    """The pool's count, in total and per client; safe from any thread."""

    capacity_bytes: int = POOL_BYTES
    share: float = SHARE
    used_bytes: int = 0
    peak_bytes: int = 0
    refused: int = 0
    _by_client: collections.Counter = attrs.field(factory=collections.Counter)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    @property
    def client_bytes(self) -> int:
        """What one client may hold at most."""
        return int(self.capacity_bytes * self.share)

    def hold(self, client: object) -> Hold:
        return Hold(self, client)

    def held(self, client: object) -> int:
        with self._lock:
            return self._by_client[client]

    def _change(self, client: object, delta: int, why: str, total: int = 0) -> None:
        if total > self.client_bytes:  # never fits, whatever else runs: the request's own fault
            raise BadRequest(f"the request is too large for this server: {why} needs {_mib(total)} MiB, over the "
                             f"{_mib(self.client_bytes)} MiB one client's requests may hold", status=413)
        with self._lock:
            if delta > 0:
                if self._by_client[client] + delta > self.client_bytes:
                    self.refused += 1
                    raise BadRequest(f"this client's requests already hold {self._by_client[client] >> 10} KiB of "
                                     f"the server's memory for requests, its share is {self.client_bytes >> 10} KiB; "
                                     f"{why} needs {delta >> 10} KiB more: try again when they finish", status=503,
                                     kind="server_busy")
                if self.used_bytes + delta > self.capacity_bytes:
                    self.refused += 1
                    raise BadRequest(f"the server's memory for requests is in use ({self.used_bytes >> 20} of "
                                     f"{self.capacity_bytes >> 20} MiB); try again", status=503, kind="server_busy")
            self._by_client[client] += delta
            if not self._by_client[client]:
                del self._by_client[client]
            self.used_bytes += delta
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)


@attrs.define
class Hold:
    """One request's bytes in the pool; `release` (or leaving its `with`) gives them all back."""

    pool: RequestPool
    client: object
    nbytes: int = 0

    def add(self, nbytes: int, why: str = "its body") -> None:
        self.pool._change(self.client, nbytes, why, self.nbytes + nbytes)
        self.nbytes += nbytes

    def set(self, nbytes: int, why: str) -> None:
        """What the request holds from now: more (refused when the pool or the share cannot
        give it) or less."""
        if nbytes != self.nbytes:
            self.pool._change(self.client, nbytes - self.nbytes, why, nbytes)
            self.nbytes = nbytes

    def release(self) -> None:
        if self.nbytes:
            self.pool._change(self.client, -self.nbytes, "")
            self.nbytes = 0

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def client_of(request) -> object:
    """Whose a request is, for the shares of what requests hold: its API key, or on a server
    without keys its peer's address (one host's clients share one share)."""
    key = request.scope.get("state", {}).get("client")
    if key is not None:
        return ("key", key)
    return ("host", request.client.host if request.client is not None else None)
