"""A streamed answer whose places are given back however it ends.

Below the server's routes and the live page (lever.serve.server, lever.serve.page), which count
a stream's places (admission, the request pool's hold, /live's readers) before they return it.
A generator's `finally` is not enough: a client gone before the first chunk is sent cancels the
response before the generator starts, and a generator never started never runs its `finally`;
one cut mid-stream runs it only when the garbage collector gets to it. Here the generator is
closed, and `on_end` called, when the response ends, whichever way.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
from starlette.responses import StreamingResponse


class Streamed(StreamingResponse):
    def __init__(self, content, *, on_end: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self.body_iterator.aclose()  # the generator's own finally, now
                finally:
                    self._on_end()
