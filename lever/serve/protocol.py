"""Connections as uvicorn's h11 protocol takes them, with two bounds it lacks and JSON refusals.

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

A request h11 cannot parse (a request line like `G@T / HTTP/1.1`, a header line without a colon,
a NUL in a header, a head over h11's 16 KiB) never reaches the ASGI app, so lever.serve.guard
cannot answer it: uvicorn answers text/plain "Invalid HTTP request received.". Here it gets the
OpenAI-style JSON error every other refusal is, naming what was wrong (h11's status: 400, 431 for
a head too long, 501 for a transfer coding other than chunked), and the connection is closed, as
uvicorn does. Two things h11 lets through are refused the same way: a control character in a
header's value (400) and an HTTP version other than 1.x (505). The class is always h11's:
uvicorn's httptools protocol is never chosen (`http=` takes this class), installed or not.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE  # as uvicorn takes it
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

_BUSY_BODY = b'{"error": {"message": "too many connections", "type": "server_busy", "param": null, "code": null}}'
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


# h11's complaint (how its message starts) -> what the client is told; "{n}" is h11's bound on a
# request's head. The bytes h11 quotes (a request or header line) follow, cut to 60.
MALFORMED = (
    ("illegal request line", "the request line is malformed (METHOD TARGET HTTP/1.1 expected)"),
    ("no request line", "the request line is missing"),
    ("Illegal method", "the request line's method is malformed"),
    ("Illegal target", "the request line's target is malformed"),
    ("illegal header line", "a header line is malformed (NAME: VALUE expected, no control characters)"),
    ("continuation line", "a header line is malformed (a folded line before the first header)"),
    ("Illegal header name", "a header name is malformed"),
    ("Illegal header value", "a header value holds a control character"),
    ("Receive buffer too long", "the request's line or headers are over {n} bytes"),
    ("Missing mandatory Host", "Host: the header is missing (HTTP/1.1 requires it)"),
    ("Found multiple Host", "Host: the header is sent more than once"),
    ("bad Content-Length", "Content-Length: not a length"),
    ("conflicting Content-Length", "Content-Length: sent twice with different values"),
    ("multiple Transfer-Encoding", "Transfer-Encoding: sent more than once"),
    ("Only Transfer-Encoding", "Transfer-Encoding: only chunked is supported"),
    ("illegal chunk", "the chunked body is malformed"),
    ("HTTP version", "the HTTP version {version} is not supported (HTTP/1.1 is)"),
)
_QUOTED = re.compile(r"b(['\"]).*\1", re.S)


def error_response(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response carrying an OpenAI-style JSON error; the connection closes after."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": None}}).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (status, STATUS_PHRASES[status], len(body), body))


def malformed_message(error: h11.ProtocolError, *, max_head: int, version: bytes = b"") -> str:
    """What a client is told of the request h11 refused: the table's phrase and the bytes quoted."""
    text = str(error)
    what = next((say for start, say in MALFORMED if text.startswith(start)), "the request is malformed")
    what = what.format(n=max_head, version=version.decode("latin-1"))
    quoted = _QUOTED.search(text)
    if quoted is None:
        return what
    try:
        line = ast.literal_eval(quoted.group(0))
    except (ValueError, SyntaxError):  # not a bytes literal after all: the phrase alone
        return what
    return f"{what}: {line[:60].decode('latin-1')!r}"


class _Connection(h11.Connection):
    """h11's server side, keeping the error it raised (uvicorn's handler sees only that one came)
    and refusing what h11 lets through (`_unfit`)."""

    error: h11.ProtocolError | None = None
    version: bytes = b""

    def next_event(self):
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.error = e
            raise
        if isinstance(event, h11.Request):
            self.error = _unfit(event)
            if self.error is not None:
                self.version = event.http_version
                raise self.error
        return event


_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def _unfit(request: h11.Request) -> h11.RemoteProtocolError | None:
    """What h11 lets through and the server refuses: an HTTP version other than 1.x, a control
    character in a header's value (h11 refuses only NUL, \\v and \\f there; RFC 9110 lets a server
    refuse them all, and a control character in a value that reaches a log or a page does harm)."""
    if not request.http_version.startswith(b"1."):
        return h11.RemoteProtocolError("HTTP version", error_status_hint=505)
    for name, value in request.headers:
        if _CONTROL.search(value):
            return h11.RemoteProtocolError(f"Illegal header value {bytes(name + b': ' + value)!r}")
    return None


class JsonRefusals(H11Protocol):
    """uvicorn's h11 protocol, a request h11 refuses (or `_unfit` does) answered as JSON."""

    def __init__(self, config, server_state, app_state, _loop=None) -> None:
        super().__init__(config=config, server_state=server_state, app_state=app_state, _loop=_loop)
        self._max_head = config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        self.conn = _Connection(h11.SERVER, max_incomplete_event_size=self._max_head)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refused, as JSON naming what was wrong."""
        error = self.conn.error
        if error is None or self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            # a response already begun (a body refused after its route answered): no room for another
            self.transport.close()
            return
        status = error.error_status_hint if error.error_status_hint in STATUS_PHRASES else 400
        self.transport.write(error_response(status, malformed_message(
            error, max_head=self._max_head, version=self.conn.version)))
        self.transport.close()


def protocol_class(*, max_connections: int, header_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol with these bounds and JSON refusals, for uvicorn.Config(http=...)."""
    class Bounded(JsonRefusals):
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
