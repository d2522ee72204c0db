"""A streamed answer's events: a request's calls run one after another, each call's chunks as its
reply's events (lever.serve.dialect's Reply-likes), llama-server's telemetry on them when asked
(lever.serve.progress), and the failures that end a stream with an error event.

Below the server's routes (lever.serve.server builds a Stream once the request is admitted and
hands its `events` to a Streamed response): the generation runs in a worker thread, each chunk
fetched from it off the event loop; a client gone mid-stream, or the stream's end, cancels the
generation at its next pass. A generation cut by shutdown is never reported as finished: an
error event ends its stream, as OpenAI's streams report a failure (no [DONE]).
"""

from __future__ import annotations

import anyio
import attrs

from lever.api import Call, Cancelled, Chunk
from lever.errors import LeverError
from lever.model.grammar import GrammarError
from lever.model.stop import StopReason
from lever.serve.dialect import param_of, public
from lever.serve.prepare import Shape, named
from lever.serve.progress import Progress, with_fields
from lever.serve.render import Reply, timings
from lever.serve.request import SHUTTING_DOWN


def failure(e: LeverError, shape: Shape) -> dict:
    """The error's arguments for a generation that failed: a grammar the engine gave up on is the
    request's (400 naming its field), anything else (NaN in a model's numbers) the server's."""
    msg = named(str(e), shape.schema_field)
    if isinstance(e, GrammarError):
        return {"message": public(msg), "status": 400, "kind": "invalid_request_error", "param": param_of(msg)}
    return {"message": public(msg), "status": 500, "kind": "server_error", "param": None}


@attrs.define
class Stream:
    """One admitted request's stream: its calls and their replies, run on `server`'s model."""

    server: object  # lever.serve.server.Server
    calls: tuple[Call, ...]
    replies: list
    shape: Shape
    client: object  # whose prefix cache the calls may use (the key)
    whose: object  # whose turn they take (lever.serve.admission.Turns)
    n_out: int = 0
    n_prompt: int = 0
    ended: bool = False  # an error event ended it
    timings: dict | None = None  # the last call's, for the usage chunk (llama-server's)

    async def events(self):
        """The calls' events one call after another; an error event ends the stream where a call
        fails or shutdown cuts it."""
        for call in self.calls:
            self.server.admission.track(call.cancel)
        try:
            for call, reply in zip(self.calls, self.replies, strict=True):
                for event in reply.opening():
                    yield event
                async for event in self._one(call, reply):
                    yield event
                if self.ended:
                    return
            trailer = self.replies[-1].trailer(self.shape.usage, self.n_prompt, self.n_out)
            if self.shape.usage and self.timings is not None and isinstance(self.replies[-1], Reply):
                trailer[0] = with_fields(trailer[0], {"timings": self.timings})  # the counts' chunk: llama-server's
            for event in trailer:
                yield event
        finally:
            for call in self.calls:  # a client gone mid-stream: the generation ends at its next pass
                call.cancel.set()
                self.server.admission.untrack(call.cancel)

    async def _one(self, call: Call, reply):
        """One call's chunks as its reply's events."""
        s, options = self.server, self.shape.options
        progress = Progress(s.watch()) if (options.get("return_progress") or options.get("timings_per_token")) \
            and hasattr(reply, "progress") else None
        it = s.llm.stream_call(call, client=self.client, watch=progress or s.watch(),
                               turn=s.turn(self.whose, call, self.shape, self.client))
        n_out, n_chars, reported = 0, 0, False
        self.n_prompt += len(call.ids)
        try:
            while True:
                try:
                    chunk = await anyio.to_thread.run_sync(next, it, None)
                except Cancelled:
                    chunk = None if not s.closing else Chunk("", 0, StopReason.CANCELLED)
                    if chunk is None:
                        self.ended = True
                        return
                except LeverError as e:  # failed mid-stream: an error event ends it, as OpenAI's do; no [DONE]
                    f = failure(e, self.shape)
                    yield reply.failed(f["message"], f["kind"], f["param"])
                    self.ended = True
                    return
                if chunk is None:
                    break
                if progress is not None and not reported and options.get("return_progress"):
                    for fields in progress.prompt():  # the prefill's reports, once it is done
                        for event in reply.progress(fields):
                            yield event
                reported = True
                n_out += chunk.n_tokens
                s.finished(chunk.stats, chunk.usage.cached_tokens if chunk.usage else 0)
                if chunk.stats is not None:
                    self.timings = timings(chunk.stats, chunk.usage.cached_tokens if chunk.usage else 0)
                for event in self._chunk_events(chunk, call, reply, progress, n_out, n_chars):
                    yield event
                n_chars += len(chunk.text)
                if chunk.finish_reason is StopReason.CANCELLED and s.closing:
                    self.ended = True
                    return
        finally:
            self.n_out += n_out
            call.cancel.set()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(it.close)

    def _chunk_events(self, chunk: Chunk, call: Call, reply, progress: Progress | None, n_out: int,
                      n_chars: int) -> list[str]:
        """A chunk's events: its piece (llama-server's timings so far on it, when asked), and on
        the last its closing (its timings on it) or, cut by shutdown, an error event."""
        out = []
        if chunk.text or chunk.logprobs:
            out = reply.piece(chunk, n_chars, call.logprobs is not None)
            if out and progress is not None and self.shape.options.get("timings_per_token"):
                out[-1] = with_fields(out[-1], {"timings": progress.timings(n_out)})
        if chunk.finish_reason is StopReason.CANCELLED and self.server.closing:
            return [*out, reply.failed(f"the server is shutting down: the generation was cut after "
                                       f"{self.n_out + n_out} tokens", SHUTTING_DOWN[2])]
        if chunk.finish_reason is not None:
            out += reply.closing(chunk)
        return out
