"""An OpenAI-compatible HTTP server over one open pipeline (lever.api.LLM).

    /health, /v1/models, /v1/completions, /v1/chat/completions (SSE with "stream": true),
    /tokenize, /detokenize, /props (llama.cpp's), /metrics (Prometheus's, when asked for),
    / (a live page of the trees being verified) and its /live events (lever.serve.page)

One model pair, one generation at a time, as on a phone: requests wait in a queue of at most
`queue` beside the one running (a client at most half of it), and past it get 429 with an
OpenAI-style error; the waiting generations take their turns round their clients
(lever.serve.admission.Turns), so one key's many requests do not make another's wait behind all. A client that
goes away cancels its generation at the end of the current pass and frees its place. Bad
requests get 400 naming the field. On shutdown (SIGINT, SIGTERM or SIGHUP to `lever serve`) new
requests get 503 and the admitted ones have `grace_s` to finish; then the running one is
cancelled at its next pass and the waiting ones get 503; a cut generation is never reported as
finished (503, or an `error` event ending its stream). Starlette (on anyio, like the pipeline)
serves it. Nothing that scales with a request runs on the event loop: preparing it (reading,
parsing, rendering in a child process, tokenizing, compiling its grammar: lever.serve.prepare)
runs in worker threads, each step bounded before it starts, and the generation in another, so
/health answers whatever a request holds. Admission and shutdown: lever.serve.admission;
/tokenize and /detokenize: lever.serve.tokens.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import anyio
import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lever.api import LLM, Call, Cancelled, Chunk, Completion, Session
from lever.errors import LeverError
from lever.model.grammar import GrammarError
from lever.model.stop import StopReason
from lever.pipelines.prefix_cache import PrefixCache
from lever.pipelines.watch import LIVE_BYTES, Watch
from lever.serve import MAX_CONNECTIONS, TIMEOUT_S, anthropic, llama, ollama
from lever.serve.admission import Admission, Turns
from lever.serve.dialect import OPENAI_CHAT, OPENAI_COMPLETIONS, Dialect, param_of, public, refusal
from lever.serve.guard import Access, Guard
from lever.serve.metrics import Metrics
from lever.serve.page import Page
from lever.serve.pool import Hold, RequestPool, client_of
from lever.serve.prepare import Preparer, Shape, named
from lever.serve.request import SHUTTING_DOWN, BadRequest, shutting_down
from lever.serve.streamed import Streamed

DISCONNECT_POLL_S = 0.2  # how often a waiting or running request checks that its client is still there
# the routes of generations, by dialect (llama-server answers OpenAI's with and without /v1)
GENERATIONS = {"/v1/completions": OPENAI_COMPLETIONS, "/completions": OPENAI_COMPLETIONS,
               "/v1/chat/completions": OPENAI_CHAT, "/chat/completions": OPENAI_CHAT}
CACHE_BYTES = 256 << 20  # `lever serve --cache-ram`'s default (MiB there): a few long conversations of a 1.5B pair


def error(message: str, status: int, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


@attrs.define
class Server:
    """The routes' state: the model and its one conversation pair, admission, preparation, the
    figures it serves. Built by `app`, which hands it its collaborators."""

    llm: LLM
    model_id: str
    admission: Admission
    prep: Preparer
    # the live conversation's KV caches (one pair, the memory plan's; one generation at a time)
    # and, in its cache, other conversations' rows: a request that continues one of its client's
    # (API key) conversations prefills only what is new; clients never share
    session: Session
    pool: RequestPool = attrs.field(factory=RequestPool)  # what requests hold, from their first byte to their end
    turns: Turns = attrs.field(factory=Turns)  # whose generation runs next: round the clients waiting
    metrics: Metrics | None = None  # running totals for /metrics; None: not served
    page: Page | None = None  # the live page and its events (lever.serve.page); None: not served
    created: int = attrs.field(factory=lambda: int(time.time()))

    @property
    def closing(self) -> bool:
        return self.admission.closing

    def memory_plan(self) -> dict[str, int]:
        """What the server's RSS stays within, by part (bytes): the largest generation's plan
        (a prompt filling the context; its grammars among it), what requests hold (their bodies,
        their parsing, their queued calls: lever.serve.pool), the kept conversations, the live page."""
        cache = self.session.cache
        return {"run": self.llm.memory_plan().rss_bound_bytes, "requests": self.pool.capacity_bytes,
                "kept conversations": cache.capacity_bytes if cache is not None else 0,
                "live page": self.page.watch.max_bytes if self.page is not None else 0}

    def shutdown(self, grace_s: float) -> None:
        """Refuse new requests; cancel the admitted ones after `grace_s`; a render or a grammar's
        compile in progress fails at once. Safe from a signal handler."""
        self.admission.shutdown(grace_s)
        self.prep.close()

    # -- endpoints

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "admitted": self.admission.admitted, "queue": self.admission.queue})

    async def models(self, request: Request) -> Response:
        model = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "lever"}
        return JSONResponse({"object": "list", "data": [model]})

    async def props(self, request: Request) -> Response:
        """llama-server's /props, its fields Lever has: the chat template (empty without one: a
        client then sends completions), one slot, the context, the defaults; the model's file
        by its name only (where it sits on the server's disk is no client's business)."""
        try:
            template = self.llm.chat_template.text
        except LeverError:
            template = ""
        g = self.llm.config.generate
        params = {"n_predict": g.n_predict, "seed": g.seed, "temperature": g.temperature, "top_k": g.top_k,
                  "top_p": g.top_p, "min_p": g.min_p, "repeat_penalty": g.repeat_penalty}
        return JSONResponse({"model_alias": self.model_id, "model_path": Path(self.llm.config.model.target).name,
                             "chat_template": template, "total_slots": 1, "modalities": {"vision": False},
                             "default_generation_settings": {"n_ctx": self.llm.n_ctx, "params": params},
                             "build_info": "lever"})

    async def tokens(self, request: Request) -> Response:
        """/tokenize and /detokenize (lever.serve.tokens), never queued behind a generation."""
        with self.pool.hold(client_of(request)) as hold:
            try:
                return JSONResponse(await self.prep.tokens(request, request.url.path.strip("/"), hold))
            except BadRequest as e:
                return error(e.message, e.status, e.kind, e.param)

    async def prometheus(self, request: Request) -> Response:
        if self.metrics is None:  # as llama-server answers it
            return error("this server does not serve /metrics: start it with --metrics", 501, "not_supported")
        running = int(self.llm.busy)
        return Response(self.metrics.text(processing=running, deferred=max(self.admission.admitted - running, 0)),
                        media_type="text/plain; version=0.0.4")

    def generation(self, dialect: Dialect):
        """The route of a dialect's generations (lever.serve.dialect)."""
        async def route(request: Request) -> Response:
            return await self._counted(request, dialect)
        route.__name__ = dialect.name
        return route

    async def _counted(self, request: Request, dialect: Dialect) -> Response:
        response = await self._handle(request, dialect)
        if self.metrics is not None:
            self.metrics.add_status(response.status_code)
        return response

    def _finished(self, stats) -> None:
        if self.metrics is not None and stats is not None:
            self.metrics.add_run(stats)

    async def _handle(self, request: Request, dialect: Dialect) -> Response:
        hold = self.pool.hold(client_of(request))  # given back when the answer ends (a stream's, at its end)
        try:
            response = await self._answer(request, dialect, hold)
        except BaseException:
            hold.release()
            raise
        if not isinstance(response, Streamed):
            hold.release()
        return response

    async def _answer(self, request: Request, dialect: Dialect, hold: Hold) -> Response:
        error = dialect.error
        try:
            if self.closing:
                raise shutting_down()
            # checked before queueing: a bad request never waits for its 400 (lever.serve.prepare)
            shape, call = await self.prep.call(request, dialect, hold)
            self.admission.admit(hold.client)
        except BadRequest as e:
            return error(e.message, e.status, e.kind, e.param)
        except LeverError as e:
            if self.closing:  # a render cut by shutdown
                return error(*SHUTTING_DOWN)
            return error(**refusal(str(e)))
        reply = dialect.reply(dialect.rid_prefix + uuid.uuid4().hex[:24], dialect.chat, self.model_id,
                              self.llm.tokenizer)
        if hasattr(reply, "bind"):  # a dialect whose answer repeats the call's settings (lever.serve.llama)
            reply = reply.bind(call=call, shape=shape)
        client = request.scope.get("state", {}).get("client")
        if shape.stream:
            def end() -> None:  # however the stream ends, even before its first chunk
                self.admission.release(hold.client)
                hold.release()
            return Streamed(self._stream(request, call, reply, shape, client, hold.client), on_end=end,
                            media_type=reply.media_type)
        try:
            c = await self._generate(request, call, client, hold.client)
        except Cancelled as e:  # its client left while it waited (nobody reads this), or shutdown
            if self.closing:
                return error(*SHUTTING_DOWN)
            return error(str(e), 499, "cancelled")
        except LeverError as e:  # the generation failed: a grammar the engine gave up on, NaN in a model
            return error(**failure(e, shape))
        finally:
            self.admission.release(hold.client)
        self._finished(c.stats)
        if c.finish_reason is StopReason.CANCELLED and self.closing:  # cut: never reported as finished
            return error(f"the server is shutting down: the generation was cut after {len(c.tokens)} tokens",
                         503, SHUTTING_DOWN[2])
        return JSONResponse(reply.body(c))

    async def _generate(self, request: Request, call: Call, client, whose) -> Completion:
        self.admission.track(call.cancel)
        outcome: list = []  # the completion or the error, raised outside the task group (no ExceptionGroup)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._until_client_leaves, request, call.cancel)
                try:
                    outcome.append(await anyio.to_thread.run_sync(
                        lambda: self.llm.run(call, session=self.session, client=client, watch=self._watch(),
                                             turn=self.turns.turn(whose, call.cancel))))
                except LeverError as e:
                    outcome.append(e)
                finally:
                    call.cancel.set()
                    tg.cancel_scope.cancel()
        finally:
            self.admission.untrack(call.cancel)
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]

    def _watch(self):
        return self.page.watch if self.page is not None else None

    @staticmethod
    async def _until_client_leaves(request: Request, cancel: threading.Event) -> None:
        while not cancel.is_set():
            if await request.is_disconnected():
                cancel.set()
            await anyio.sleep(DISCONNECT_POLL_S)

    async def _stream(self, request: Request, call: Call, reply, shape: Shape, client, whose):
        cancel = call.cancel
        self.admission.track(cancel)
        it = self.llm.stream_call(call, session=self.session, client=client, watch=self._watch(),
                                  turn=self.turns.turn(whose, call.cancel))
        n_out, n_chars = 0, 0
        try:
            for event in reply.opening():
                yield event
            while True:
                try:
                    chunk = await anyio.to_thread.run_sync(next, it, None)
                except Cancelled:
                    chunk = None if not self.closing else Chunk("", 0, StopReason.CANCELLED)
                    if chunk is None:
                        return
                except LeverError as e:  # failed mid-stream: an error event ends it, as OpenAI's do; no [DONE]
                    f = failure(e, shape)
                    yield reply.failed(f["message"], f["kind"], f["param"])
                    return
                if chunk is None:
                    break
                n_out += chunk.n_tokens
                self._finished(chunk.stats)
                if chunk.text or chunk.logprobs:
                    for event in reply.piece(chunk, n_chars, call.logprobs is not None):
                        yield event
                    n_chars += len(chunk.text)
                if chunk.finish_reason is StopReason.CANCELLED and self.closing:
                    # cut by shutdown: an error event, as OpenAI's streams report a failure; no [DONE]
                    yield reply.failed(f"the server is shutting down: the generation was cut after {n_out} tokens",
                                       SHUTTING_DOWN[2])
                    return
                if chunk.finish_reason is not None:  # llama.cpp's timings ride on the last chunk
                    for event in reply.closing(chunk):
                        yield event
            for event in reply.trailer(shape.usage, len(call.ids), n_out):
                yield event
        finally:
            cancel.set()  # a client gone mid-stream: the generation ends at its next pass
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(it.close)
            self.admission.untrack(cancel)


def failure(e: LeverError, shape: Shape) -> dict:
    """`error`'s arguments for a generation that failed: a grammar the engine gave up on is the
    request's (400 naming its field), anything else (NaN in a model's numbers) the server's."""
    msg = named(str(e), shape.schema_field)
    if isinstance(e, GrammarError):
        return {"message": public(msg), "status": 400, "kind": "invalid_request_error", "param": param_of(msg)}
    return {"message": public(msg), "status": 500, "kind": "server_error", "param": None}


def app(llm: LLM, *, model_id: str, queue: int = 8, access: Access | None = None,
        timeout_s: float = TIMEOUT_S, metrics: bool = False, cache_bytes: int = CACHE_BYTES, page: bool = True,
        live_bytes: int = LIVE_BYTES, max_connections: int = MAX_CONNECTIONS) -> Guard:
    """The ASGI app behind its Guard (lever.serve.guard); `.app.state.server` is its Server
    (for `shutdown` and `memory_plan`). With several keys, each has at most half of
    `max_connections` (the server's, lever.serve.protocol) under way."""
    access = access or Access()
    # the kept conversations' bytes split evenly among the keys: one key's cannot push another's out
    shares = max(len(access.api_keys), 1)
    session = llm.session(cache=PrefixCache(cache_bytes, shares=shares) if cache_bytes > 0 else None)
    live = None
    if page:  # the live page (lever.serve.page) over every generation's cycles
        tok = llm.tokenizer
        watch = Watch(lambda t: tok.token_bytes(t).decode("utf-8", "replace"), max_bytes=live_bytes)
        admission = Admission(queue, shared=len(access.api_keys) > 1)
        live = Page(watch, lambda: admission.closing)
    else:
        admission = Admission(queue, shared=len(access.api_keys) > 1)
    s = Server(llm, model_id, admission, Preparer(llm, timeout_s), session, metrics=Metrics() if metrics else None,
               page=live)
    handlers = {HTTPException: _http_error, Exception: _internal_error}
    routes = [Route("/health", s.health), Route("/v1/health", s.health), Route("/v1/models", s.models),
              Route("/models", s.models), Route("/props", s.props),
              *[Route(path, s.generation(d), methods=["POST"]) for path, d in GENERATIONS.items()],
              Route("/tokenize", s.tokens, methods=["POST"]),
              Route("/detokenize", s.tokens, methods=["POST"]), Route("/metrics", s.prometheus)]
    routes += [Route(path, s.generation(d), methods=["POST"])
               for path, d in {**llama.GENERATIONS, **ollama.GENERATIONS, **anthropic.GENERATIONS}.items()]
    routes += [Route("/apply-template", _bound(llama.apply_template, s), methods=["POST"]),
               Route("/slots", _bound(llama.slots, s))]
    routes += [*ollama.routes(s), *anthropic.routes(s)]
    if live is not None:
        routes += [Route("/", live.file), Route("/page/{name}", live.file), Route("/live", live.events)]
    a = Starlette(routes=routes, exception_handlers=handlers)
    a.state.server = s
    several = len(access.api_keys) > 1
    return Guard(a, access, max_requests=max(max_connections // 2, 1) if several else None)


def _bound(endpoint, server: Server):
    """A route's function of (server, request) as starlette's endpoint of the request alone (a
    functools.partial would be taken for an ASGI app)."""
    async def route(request: Request) -> Response:
        return await endpoint(server, request)
    route.__name__ = endpoint.__name__
    return route


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
    message = {404: f"no such route: {request.url.path[:80]}",
               405: f"{request.method} is not allowed on {request.url.path[:80]}"}.get(exc.status_code, str(exc.detail))
    return error(message, exc.status_code, kind)


async def _internal_error(request: Request, exc: Exception) -> Response:
    return error(f"internal error: {type(exc).__name__}", 500, "server_error")
