"""How fast `lever serve` reads one client's request bodies: a byte rate per client.

Below request preparation (lever.serve.prepare), beside the pool of what requests hold
(lever.serve.pool), used by the body's reader (lever.serve.request.read_body). The pool bounds
what bodies hold; this bounds what reading them costs. Every byte a body sends is work for the
server's one event loop and for the machine's cores (the kernel's copy, the HTTP parser, the
pool's count, the parse bound's scan): a key sending twenty 4 MiB bodies at once (80 MB/s on
loopback) took the cores a generation of another key needed, and its completions took 6-8x as
long. Here a client's bodies draw on one bucket of `rate_bytes_per_s`, `burst_bytes` at once:
past it, the next chunk is read only once the client's bytes are paid for, so its sockets fill
and its sends block (TCP's flow control: the server never buffers more than a chunk a body);
a body that cannot be read within its deadline at that rate gets 408 at once. Prompts within a
context are far below the burst (a 32k-token context is ~128 KiB of text): only bodies of
megabytes wait, and they are the ones that cost.
"""

from __future__ import annotations

import anyio
import attrs

from lever.serve.request import BadRequest

RATE_BYTES_PER_S = 8 << 20  # one client's bodies, read at most this fast past the burst
BURST_BYTES = 1 << 20  # read at once, whatever came before (a body within a context is far smaller)


@attrs.define
class _Bucket:
    paid_s: float  # when the client's bytes so far are paid for (the clock's time)


@attrs.define
class BodyRate:
    """The clients' buckets; used from the event loop only (no lock)."""

    rate_bytes_per_s: float = RATE_BYTES_PER_S
    burst_bytes: int = BURST_BYTES
    _buckets: dict = attrs.field(factory=dict)

    def due(self, client: object, nbytes: int, now: float) -> float:
        """When `nbytes` more of `client`'s, arrived at `now`, are paid for at its rate (at or
        before `now`: within the burst, none owed)."""
        self._forget(now)
        full = now - self.burst_bytes / self.rate_bytes_per_s  # a full bucket: burst_bytes paid ahead
        bucket = self._buckets.setdefault(client, _Bucket(full))
        bucket.paid_s = max(bucket.paid_s, full) + nbytes / self.rate_bytes_per_s
        return bucket.paid_s

    def check(self, client: object, deadline: float) -> None:
        """Before a body is read: 408 at once when what `client` owes already runs past `deadline`
        (its other bodies took its rate; this one's first byte could not be read in time)."""
        bucket = self._buckets.get(client)
        if bucket is not None and bucket.paid_s > deadline:
            raise self._late()

    def pay(self, client: object, nbytes: int, deadline: float) -> float:
        """`nbytes` of `client`'s just arrived: when they are paid for (anyio's clock; its next
        chunk is read only then); 408 if that is past `deadline`."""
        due = self.due(client, nbytes, anyio.current_time())
        if due > deadline:
            raise self._late()
        return due

    def _late(self) -> BadRequest:
        return BadRequest(f"the request body would take past the server's timeout to arrive at this client's rate "
                          f"({self.rate_bytes_per_s / (1 << 20):.3g} MiB/s for its bodies together)", status=408,
                          kind="request_timeout")

    def _forget(self, now: float) -> None:
        """Buckets full again are dropped: the dict holds only clients that sent lately."""
        if len(self._buckets) > 64:
            full = now - self.burst_bytes / self.rate_bytes_per_s
            for client in [c for c, b in self._buckets.items() if b.paid_s <= full]:
                del self._buckets[client]
