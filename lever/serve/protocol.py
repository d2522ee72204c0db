"""Connections as uvicorn's h11 protocol takes them, with two bounds it lacks.

uvicorn reads a request's headers for as long as a client takes to send them and accepts every
connection: a thousand clients that open a socket and send nothing (or a byte a minute) hold a
thousand sockets and the server's file descriptors until nobody else gets in. Here:
- a connection must deliver each request's headers within `header_timeout_s` of its start (or
  of the previous response's end), else it is closed;
- past `max_connections` open at once, an idle connection (no request under way; one that
  never sent a request first, then the longest idle) is closed to make room, so a crowd of idle
  sockets cannot lock out a client that asks; only
  when every connection is serving a request does a new one get 503 and is closed at once.
The body has its own bound, in the route (lever.serve.request.read_body).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

_BUSY_BODY = b'{"error": {"message": "too many connections", "type": "server_busy", "param": null, "code": null}}'
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


def protocol_class(*, max_connections: int, header_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol with these bounds, for uvicorn.Config(http=...)."""
    class Bounded(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._idle_since = self.loop.time()
            if len(self.connections) > max_connections and not self._evict_idle():
                transport.write(BUSY)
                transport.close()
                return
            self._arm()

        def _idle(self) -> bool:
            return (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing()

        def _evict_idle(self) -> bool:
            """Closes an idle connection (not this one): one that never sent a request first, then
            the one idle the longest (a client between requests loses its keep-alive last). False
            when none is idle."""
            idle = [c for c in self.connections if c is not self and getattr(c, "_idle", None) and c._idle()]
            if not idle:
                return False
            min(idle, key=lambda c: (c.cycle is not None, c._idle_since)).transport.close()
            return True

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            """Closes the connection unless a new request's headers arrive in time."""
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            waiting_for = self.cycle
            self._idle_since = self.loop.time()
            self._header_timer = self.loop.call_later(header_timeout_s, self._late, waiting_for)

        def _late(self, waiting_for) -> None:
            idle = waiting_for is None or waiting_for.response_complete  # not mid-response
            if self.cycle is waiting_for and idle and not self.transport.is_closing():  # no request since
                self.transport.close()

    return Bounded
