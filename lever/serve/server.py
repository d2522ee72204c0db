"""An OpenAI-compatible HTTP server over one open pipeline (lever.api.LLM).

    /health, /v1/models, /v1/completions, /v1/chat/completions (SSE with "stream": true),
    /tokenize, /detokenize, /metrics (Prometheus's, when asked for), llama-server's own routes
    (lever.serve.llama: /completion, /props, /slots, ...), OpenAI's Responses API
    (lever.serve.responses), Anthropic's and Ollama's, / (a live page of the trees being
    verified) and its /live events (lever.serve.page)

One model pair; one generation at a time, or with `lever serve --parallel N` N at once, each in
a slot (llama-server's) with its own caches of n_ctx / N tokens, their trees verified in shared
passes of the target (one read of each streamed layer for all: lever.pipelines.batcher).
Requests wait in a queue of at most `queue` beside the running ones (a client at most half of
it), and past it get 429 with an OpenAI-style error; the waiting generations take their turns
round their clients (lever.serve.admission.Turns), so one key's many requests do not make
another's wait behind all. A request of several prompts or choices (`n`) runs them one after
another, in its one turn each.
A client that goes away cancels its generation at the end of the current pass and frees its
place. Bad requests get 400 naming the field. On shutdown (SIGINT, SIGTERM or SIGHUP to
`lever serve`) new requests get 503 and the admitted ones have `grace_s` to finish; then the
running one is cancelled at its next pass and the waiting ones get 503; a cut generation is never
reported as finished (503, or an `error` event ending its stream). Starlette (on anyio, like the
pipeline) serves it. Nothing that scales with a request runs on the event loop: preparing it
(reading, parsing, rendering in a child process, tokenizing, compiling its grammar:
lever.serve.prepare) runs in worker threads, each step bounded before it starts, and the
generation in another, so /health answers whatever a request holds. Admission and shutdown:
lever.serve.admission; /tokenize and /detokenize: lever.serve.tokens.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import uuid

import anyio
import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lever.api import LLM, Call, Cancelled, Completion, Session
from lever.errors import LeverError
from lever.model.stop import StopReason
from lever.pipelines.prefix_cache import PrefixCache, shared
from lever.pipelines.watch import LIVE_BYTES, Watch
from lever.serve import MAX_CONNECTIONS, TIMEOUT_S, admin, anthropic, llama, ollama, responses
from lever.serve.admission import Admission, Slots, Turns
from lever.serve.dialect import OPENAI_CHAT, OPENAI_COMPLETIONS, Dialect, overflow, public, refusal
from lever.serve.guard import Access, Guard
from lever.serve.metrics import Metrics
from lever.serve.page import Page
from lever.serve.pool import Hold, RequestPool, client_of
from lever.serve.prepare import Preparer, Shape
from lever.serve.render import Reply
from lever.serve.request import SHUTTING_DOWN, BadRequest, shutting_down
from lever.serve.streamed import Streamed
from lever.serve.streaming import Stream, failure
from lever.serve.webui import WEB_UI_FILES

DISCONNECT_POLL_S = 0.2  # how often a waiting or running request checks that its client is still there
# the routes of OpenAI's generations (llama-server answers chats with and without /v1; its
# /completions is its own: lever.serve.llama)
GENERATIONS = {"/v1/completions": OPENAI_COMPLETIONS, "/v1/chat/completions": OPENAI_CHAT,
               "/chat/completions": OPENAI_CHAT}
CACHE_BYTES = 256 << 20  # `lever serve --cache-ram`'s default (MiB there): a few long conversations of a 1.5B pair


def error(message: str, status: int, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


@attrs.frozen
class Settings:
    """What `lever serve`'s flags tell the routes beside the model (lever.cli.serve)."""

    aliases: tuple[str, ...] = ()  # --alias's names (the model's id is the first in order): /models lists them
    tags: tuple[str, ...] = ()  # --tags: /models lists them
    n_slots: int = 1  # --parallel: llama-server's slots, each the context's llm.n_ctx
    slots: bool = True  # GET /slots served (--no-slots: 501, as llama-server's)
    verbose: bool = False  # --verbose: every answer carries llama-server's __verbose


@attrs.define
class Server:
    """The routes' state: the model and its one conversation pair, admission, preparation, the
    figures it serves. Built by `app`, which hands it its collaborators."""

    llm: LLM
    model_id: str
    admission: Admission
    prep: Preparer
    # each slot's live conversation (its KV caches, the memory plan's: one pair per slot) and, in
    # their shared prefix cache, other conversations' rows: a request that continues one of its
    # client's (API key) conversations prefills only what is new; clients never share
    sessions: tuple[Session, ...]
    settings: Settings = Settings()
    slots: Slots = attrs.field(factory=Slots)  # which slot runs which generation (GET /slots)
    pool: RequestPool = attrs.field(factory=RequestPool)  # what requests hold, from their first byte to their end
    turns: Turns = attrs.field(factory=Turns)  # whose generation runs next: round the clients waiting
    metrics: Metrics | None = None  # running totals for /metrics; None: not served
    page: Page | None = None  # the live page and its events (lever.serve.page); None: not served
    created: int = attrs.field(factory=lambda: int(time.time()))

    @property
    def closing(self) -> bool:
        return self.admission.closing

    def memory_plan(self) -> dict[str, int]:
        """The server's plan by part (bytes), what --mem holds it to: the largest generation's
        (a prompt filling the context; its grammars among it; its resident layers placed within
        what --mem leaves it, as `lever run --mem` places them), what requests hold (their bodies,
        their parsing, their queued calls: lever.serve.pool), the kept conversations, the live page."""
        cache = self.sessions[0].cache
        return {"run": self.llm.memory_plan().total_bytes, "requests": self.pool.capacity_bytes,
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
        """OpenAI's list of the one model, with llama-server's aliases, tags and meta."""
        model = {"id": self.model_id, "aliases": list(self.settings.aliases), "tags": list(self.settings.tags),
                 "object": "model", "created": self.created, "owned_by": "lever",
                 "meta": {"n_vocab": self.llm.tokenizer.vocab_size, "n_ctx": self.llm.n_ctx}}
        return JSONResponse({"object": "list", "data": [model]})

    async def tokens(self, request: Request) -> Response:
        """/tokenize and /detokenize (lever.serve.tokens), never queued behind a generation."""
        with self.pool.hold(client_of(request)) as hold:
            try:
                return JSONResponse(await self.prep.tokens(request, request.url.path.strip("/"), hold))
            except BadRequest as e:
                return error(e.message, e.status, e.kind, e.param)

    async def prometheus(self, request: Request) -> Response:
        if self.metrics is None:  # as llama-server answers it
            return error("this server does not serve /metrics: start it with --metrics", 501, "not_supported_error")
        running = self.slots.processing
        r = Response(self.metrics.text(processing=running, deferred=max(self.admission.admitted - running, 0),
                                       batcher=self.llm.lanes.batcher),
                     media_type="text/plain; version=0.0.4")
        # llama-server's header, in its case (starlette lowercases the names it is given; some clients read a dict)
        r.raw_headers.append((b"Process-Start-Time-Unix", str(self.created).encode()))
        return r

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

    def finished(self, stats, cached: int = 0) -> None:
        if self.metrics is not None and stats is not None:
            self.metrics.add_run(stats, cached)

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
        try:
            if self.closing:
                raise shutting_down()
            # checked before queueing: a bad request never waits for its 400 (lever.serve.prepare)
            shape, calls = await self.prep.calls(request, dialect, hold)
            replies = self._replies(dialect, calls, shape)
            self.admission.admit(hold.client)
        except BadRequest as e:
            return self.refused(dialect, e.message, e.status, e.kind, e.param)
        except LeverError as e:
            if self.closing:  # a render cut by shutdown
                return dialect.error(*SHUTTING_DOWN)
            return self.refused(dialect, **refusal(str(e)))
        client = request.scope.get("state", {}).get("client")
        if shape.stream:
            def end() -> None:  # however the stream ends, even before its first chunk
                self.admission.release(hold.client)
                hold.release()
            return Streamed(Stream(self, calls, replies, shape, client, hold.client).events(), on_end=end,
                            media_type=replies[0].media_type)
        try:
            cs = await self._generate(request, calls, shape, client, hold.client)
        except Cancelled as e:  # its client left while it waited (nobody reads this), or shutdown
            if self.closing:
                return dialect.error(*SHUTTING_DOWN)
            return dialect.error(str(e), 499, "cancelled")
        except LeverError as e:  # the generation failed: a grammar the engine gave up on, NaN in a model
            return dialect.error(**failure(e, shape))
        finally:
            self.admission.release(hold.client)
        for c in cs:
            self.finished(c.stats, c.usage.cached_tokens)
        if any(c.finish_reason is StopReason.CANCELLED for c in cs) and self.closing:  # cut: never "finished"
            return dialect.error(f"the server is shutting down: the generation was cut after "
                                 f"{sum(len(c.tokens) for c in cs)} tokens", 503, SHUTTING_DOWN[2])
        return JSONResponse(merged([r.body(c) for r, c in zip(replies, cs, strict=True)]))

    def refused(self, dialect: Dialect, message: str, status: int, kind: str, param: str | None = None) -> Response:
        """A request refused before it ran, in its dialect's form; a prompt past the context is
        llama-server's exceed_context_size_error with its n_prompt_tokens and n_ctx."""
        extra = overflow(message, self.llm.tokenizer.max_token_bytes) if status == 400 else None
        if extra is not None:
            kind = "exceed_context_size_error"
        return dialect.error(public(message), status, kind, param, extra)

    def _replies(self, dialect: Dialect, calls: tuple[Call, ...], shape: Shape) -> list:
        """Each call's answer shapes (lever.serve.dialect), bound to its call where the dialect's
        answer repeats it; OpenAI's with llama-server's __verbose when asked (--verbose, or the
        request's `verbose`). Several calls: BadRequest unless the dialect lists choices."""
        rid = dialect.rid_prefix + uuid.uuid4().hex[:24]
        verbose = self.settings.verbose or shape.options.get("verbose")
        out = []
        for i, call in enumerate(calls):
            reply = dialect.reply(rid, dialect.chat, self.model_id, self.llm.tokenizer)
            if hasattr(reply, "bind"):  # a dialect whose answer repeats the call's settings (lever.serve.llama)
                reply = reply.bind(call=call, shape=shape)
            if hasattr(reply, "index"):
                reply = attrs.evolve(reply, index=i)
            elif len(calls) > 1:
                raise BadRequest(f"n: one answer per request in the {dialect.name} API", "n")
            if verbose and isinstance(reply, Reply):
                native = llama.NativeReply(rid, dialect.chat, self.model_id, self.llm.tokenizer)
                reply = attrs.evolve(reply, native=native.bind(call=call, shape=shape))
            out.append(reply)
        llama.check_asks(calls[0], shape, self.settings.n_slots)
        return out

    async def _generate(self, request: Request, calls, shape: Shape, client, whose) -> list[Completion]:
        """The calls run one after another, each in its turn; the client leaving cancels them."""
        for call in calls:
            self.admission.track(call.cancel)
        outcome: list = []  # the completions or the error, raised outside the task group (no ExceptionGroup)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._until_client_leaves, request, [c.cancel for c in calls])
                try:
                    for call in calls:
                        outcome.append(await anyio.to_thread.run_sync(
                            lambda call=call: self.llm.run(call, client=client,
                                                           watch=self.watch(),
                                                           turn=self.turn(whose, call, shape, client))))
                except LeverError as e:
                    outcome.append(e)
                finally:
                    for call in calls:
                        call.cancel.set()
                    tg.cancel_scope.cancel()
        finally:
            for call in calls:
                self.admission.untrack(call.cancel)
        if isinstance(outcome[-1], Exception):
            raise outcome[-1]
        return outcome

    def watch(self):
        return self.page.watch if self.page is not None else None

    @contextlib.contextmanager
    def turn(self, whose, call: Call, shape: Shape, client):
        """A generation's turn (Turns), in the free slot whose conversation holds the most of its
        prompt (`client`'s conversations only), shown there while it runs (GET /slots); yields
        the slot's session, which the call runs in."""
        task = {"n_prompt_tokens": len(call.ids), "params": llama.generation_settings(call, shape)}

        def score(i: int) -> int:
            s = self.sessions[i]
            return shared(s.ids, call.ids) if s.client == client else -1 if s.ids else 0

        with self.turns.turn(whose, call.cancel), self.slots.hold(task, score) as slot:
            yield self.sessions[slot]

    @staticmethod
    async def _until_client_leaves(request: Request, cancels: list[threading.Event]) -> None:
        while not all(c.is_set() for c in cancels):
            if await request.is_disconnected():
                for c in cancels:
                    c.set()
            await anyio.sleep(DISCONNECT_POLL_S)

def merged(bodies: list) -> dict | list:
    """A request's answers as one: the one body; OpenAI's choices in one list (by their index,
    the counts added up), as llama-server merges them; else llama-server's list of bodies."""
    if len(bodies) == 1:
        return bodies[0]
    if "choices" not in bodies[0]:
        return bodies
    out = dict(bodies[0])
    out["choices"] = [ch for b in bodies for ch in b["choices"]]
    if "usage" in out:
        u = {k: sum(b["usage"][k] for b in bodies) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        out["usage"] = {**out["usage"], **u}
    return out


def app(llm: LLM, *, model_id: str, queue: int = 8, access: Access | None = None,
        timeout_s: float = TIMEOUT_S, metrics: bool = False, cache_bytes: int = CACHE_BYTES, page: bool = True,
        live_bytes: int = LIVE_BYTES, max_connections: int = MAX_CONNECTIONS,
        settings: Settings | None = None) -> Guard:
    """The ASGI app behind its Guard (lever.serve.guard); `.app.state.server` is its Server
    (for `shutdown` and `memory_plan`). With several keys, each has at most half of
    `max_connections` (the server's, lever.serve.protocol) under way."""
    access = access or Access()
    settings = settings or Settings()
    # the kept conversations' bytes split evenly among the keys: one key's cannot push another's out
    shares = max(len(access.api_keys), 1)
    cache = PrefixCache(cache_bytes, shares=shares) if cache_bytes > 0 else None
    sessions = tuple(llm.session(cache=cache) for _ in range(llm.parallel))
    admission = Admission(queue, shared=len(access.api_keys) > 1, running=llm.parallel)
    live = None
    if page:  # the live page (lever.serve.page) over every generation's cycles
        tok = llm.tokenizer
        watch = Watch(lambda t: tok.token_bytes(t).decode("utf-8", "replace"), max_bytes=live_bytes)
        live = Page(watch, lambda: admission.closing)
    slots = Slots(llm.parallel, llm.n_ctx, llm.engine.plan.kind.speculates)
    s = Server(llm, model_id, admission, Preparer(llm, timeout_s), sessions, settings, slots, turns=Turns(llm.parallel),
               metrics=Metrics() if metrics else None, page=live)
    if (watch := llm.engine.memory_watch) is not None:  # the cgroup's limit is the whole server's: the run's is
        watch.run_part = functools.partial(admin.run_part, s)  # what its own parts leave
        watch.on_limit = functools.partial(admin.keep_conversations, s)
        watch.follow_below_plan()  # a cgroup that grants less than --mem: followed now
    return Guard(_starlette(s, live, keyed=bool(access.api_keys)), access,
                 max_requests=max(max_connections // 2, 1) if len(access.api_keys) > 1 else None)


def _starlette(s: Server, live: Page | None, *, keyed: bool = False) -> Starlette:
    """The routes: OpenAI's, llama-server's, Anthropic's, Ollama's, the page's, the admin's
    (lever.serve.admin: behind the API keys, `keyed`)."""
    routes = [Route("/health", s.health), Route("/v1/health", s.health), Route("/v1/models", s.models),
              Route("/models", s.models), Route("/tokenize", s.tokens, methods=["POST"]),
              Route("/detokenize", s.tokens, methods=["POST"]), Route("/metrics", s.prometheus)]
    dialects = {**GENERATIONS, **llama.GENERATIONS, **ollama.GENERATIONS, **anthropic.GENERATIONS,
                **responses.GENERATIONS}
    routes += [Route(path, s.generation(d), methods=["POST"]) for path, d in dialects.items()]
    routes += [*llama.routes(s), *ollama.routes(s), *anthropic.routes(s), *responses.routes(s),
               *admin.routes(s, keyed=keyed)]
    if live is not None:
        routes += [Route("/", live.file), Route("/page/{name}", live.file), Route("/live", live.events),
                   *[Route(path, _web_ui_file) for path in WEB_UI_FILES]]
    a = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    a.state.server = s
    return a


async def _web_ui_file(request: Request) -> Response:
    """A file llama-server's web UI asks for (lever.serve.webui)."""
    media_type, body = WEB_UI_FILES[request.url.path]
    return Response(body, media_type=media_type, headers={"Cache-Control": "no-cache"})


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
    message = {404: f"no such route: {request.url.path[:80]}",
               405: f"{request.method} is not allowed on {request.url.path[:80]}"}.get(exc.status_code, str(exc.detail))
    return error(message, exc.status_code, kind)


async def _internal_error(request: Request, exc: Exception) -> Response:
    return error(f"internal error: {type(exc).__name__}", 500, "server_error")
