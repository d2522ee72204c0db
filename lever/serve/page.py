"""The live page at `/`: each cycle's tree (its nodes drawn in the order they grew) and the path
the target took, tokens per pass, acceptance and flash busy over time, and the stages' timeline,
for whoever watches `lever serve` work.

The page is three static files in lever/serve/static (no build step, nothing fetched from
elsewhere: its Content-Security-Policy allows only this server). It reads `/live`, a stream of
server-sent events polled from the LLM's Watch (lever.pipelines.watch), with fetch rather than
EventSource so it can send an API key. The page itself holds nothing secret and needs no key;
`/live` does, and on a server with keys each client sees only its own generations' trees.
Readers are bounded (MAX_READERS, then 503) and end on shutdown, so a watcher never holds the
server open; one that stops reading holds its place, and nothing else (its writes wait).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from importlib import resources

import anyio
import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from lever.pipelines.watch import Watch
from lever.serve import PAGE_FILES
from lever.serve.streamed import Streamed

MAX_READERS = 8  # pages reading /live at once
POLL_S = 0.05  # how often a reader looks for new events (20 a second: a cycle is 10-800 ms)
PING_S = 10.0  # a comment line this often, so a reader whose page is gone is noticed
BACKLOG = 200  # events a new reader starts with, at most (the newest)
HEADERS = {"content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                      "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
           "x-content-type-options": "nosniff", "cache-control": "no-cache", "referrer-policy": "no-referrer"}


@attrs.define
class Page:
    """The page's files and its event stream, over the LLM's Watch."""

    watch: Watch
    closing: Callable[[], bool]  # the server is shutting down: readers end
    _files: dict[str, bytes] = attrs.field(factory=dict)

    def asset(self, name: str) -> bytes:
        if name not in self._files:
            self._files[name] = resources.files("lever.serve").joinpath("static", name).read_bytes()
        return self._files[name]

    async def file(self, request: Request) -> Response:
        name = request.path_params.get("name", "index.html")
        if name not in PAGE_FILES:
            return JSONResponse({"error": {"message": f"no such file: {name[:80]}", "type": "not_found",
                                           "param": None, "code": None}}, status_code=404)
        return Response(self.asset(name), media_type=PAGE_FILES[name], headers=HEADERS)

    async def events(self, request: Request) -> Response:
        # counted now, in the event loop, and given back when the response ends whichever way
        # (lever.serve.streamed): a burst of readers meets the bound one by one
        if self.watch.readers >= MAX_READERS:
            return JSONResponse({"error": {"message": f"{MAX_READERS} pages already read /live", "type": "busy",
                                           "param": None, "code": None}}, status_code=503)
        self.watch.readers += 1
        try:
            since = int(request.query_params.get("since", -1))
        except ValueError:
            since = -1
        client = request.scope.get("state", {}).get("client")

        def end() -> None:
            self.watch.readers -= 1
        return Streamed(self._stream(since, client), on_end=end, media_type="text/event-stream",
                        headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def _stream(self, since: int, client):
        _, newest, _ = self.watch.since(2**62, client)
        seq = since if since >= 0 else max(newest - BACKLOG, 0)
        if since < 0:  # a new reader starts at the oldest event kept, unwarned
            seq += self.watch.since(seq, client)[2]
        yield f"retry: 1000\n\n: lever live, newest {newest}\n\n"
        last_sent = time.monotonic()
        while not self.closing():
            found, newest, missed = self.watch.since(seq, client)
            if missed:
                yield f'data: {{"type": "missed", "n": {missed}}}\n\n'
            for e in found:
                yield f"id: {e.seq}\ndata: {e.data}\n\n"
            if found or missed:
                last_sent = time.monotonic()
            elif time.monotonic() - last_sent > PING_S:
                yield ": ping\n\n"
                last_sent = time.monotonic()
            seq = newest
            await anyio.sleep(POLL_S)
