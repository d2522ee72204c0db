"""An OpenAI-compatible HTTP server over one open pipeline (lever.api.LLM).

    /health, /v1/models, /v1/completions, /v1/chat/completions (SSE with "stream": true),
    /tokenize, /detokenize, /props (llama.cpp's), /metrics (Prometheus's, when asked for),
    / (a live page of the trees being verified) and its /live events (lever.serve.page)

One model pair, one generation at a time, as on a phone: requests wait in a queue of at most
`queue` beside the one running, and past it get 429 with an OpenAI-style error. A client that
goes away cancels its generation at the end of the current pass and frees its place. Bad
requests get 400 naming the field. On shutdown (SIGINT, SIGTERM or SIGHUP to `lever serve`) new
requests get 503 and the admitted ones have `grace_s` to finish; then the running one is
cancelled at its next pass and the waiting ones get 503; a cut generation is never reported as
finished (503, or an `error` event ending its stream). Starlette (on anyio, like the pipeline)
serves it. Nothing that scales with a request runs on the event loop: parsing, rendering (in a
child process, lever.gguf.render_child) and tokenizing run in a worker thread, each bounded
before it starts, and the generation in another, so /health answers whatever a request holds.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import anyio
import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lever.api import LLM, Call, Cancelled, Chunk, Completion, Offer, Session
from lever.errors import LeverError
from lever.gguf.chat_template import Rendered, check_messages
from lever.gguf.render_child import RenderProcess
from lever.model.grammar import GrammarError
from lever.model.stop import StopReason
from lever.pipelines.prefix_cache import PrefixCache
from lever.pipelines.watch import LIVE_BYTES, Watch
from lever.serve import TIMEOUT_S
from lever.serve.guard import Access, Guard
from lever.serve.metrics import Metrics
from lever.serve.page import Page
from lever.serve.render import OPENAI_FINISH, Reply, sse, timings
from lever.serve.request import BadRequest, BodyPool, parse, read_body, sampling

DISCONNECT_POLL_S = 0.2  # how often a waiting or running request checks that its client is still there
SHUTTING_DOWN = ("the server is shutting down", 503, "server_shutting_down")
PREP_THREADS = 2
CACHE_BYTES = 256 << 20  # `lever serve --cache-ram`'s default (MiB there): a few long conversations of a 1.5B pair


def error(message: str, status: int, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


@attrs.define
class Server:
    """The app's state: the model, the queue's count, the renderer, the ids."""

    llm: LLM
    model_id: str
    queue: int = 8
    timeout_s: float = TIMEOUT_S
    admitted: int = 0  # running + waiting
    created: int = attrs.field(factory=lambda: int(time.time()))
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    closing: bool = False
    _cancels: set = attrs.field(factory=set)  # the admitted requests' cancel events
    # the live conversation's KV caches (one pair, the memory plan's; one generation at a time)
    # and, in `session.cache`, other conversations' rows: a request that continues one of its
    # client's (API key) conversations prefills only what is new; clients never share
    session: Session = attrs.field(init=False)
    # a chat template runs in a child process, bounded in time and memory (lever.gguf.render_child)
    renderer: RenderProcess = attrs.field(factory=RenderProcess)
    # parsing and tokenizing run off the event loop, PREP_THREADS requests at a time (each holds
    # at most a body's bound of memory); renders one at a time, the renderer's child being one
    _prep: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(PREP_THREADS))
    _renders: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(1))
    # grammars compile one at a time in their own thread: a slow one holds other grammars'
    # requests, never plain completions or /tokenize (lever.model.grammar_cache)
    _compiles: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(1))
    max_prompt_bytes: int = attrs.field(init=False)
    bodies: BodyPool = attrs.field(factory=BodyPool)  # bodies being read and parsed, bounded together
    metrics: Metrics | None = None  # running totals for /metrics; None: not served
    cache_bytes: int = CACHE_BYTES  # other conversations' KV rows kept (lever.pipelines.prefix_cache); 0: none
    page: Page | None = None  # the live page and its events (lever.serve.page); None: not served

    def __attrs_post_init__(self):
        self.session = self.llm.session()
        self.session.cache = PrefixCache(self.cache_bytes) if self.cache_bytes > 0 else None
        tok = self.llm.tokenizer
        # a token stands for at most the longest token's bytes: a prompt of more bytes than the
        # context's tokens could hold is over the context before it is counted (twice that, for
        # normalizers that shorten text before the model sees it)
        self.max_prompt_bytes = 2 * self.llm.n_ctx * tok.max_token_bytes

    def admit(self) -> None:
        with self._lock:
            if self.closing:
                raise BadRequest(*SHUTTING_DOWN[:1], status=503, kind=SHUTTING_DOWN[2])
            if self.admitted > self.queue:  # one running and `queue` waiting
                raise BadRequest(f"the server is busy: {self.queue} requests already wait", status=429,
                                 kind="rate_limit_exceeded")
            self.admitted += 1

    def release(self) -> None:
        with self._lock:
            self.admitted -= 1

    def shutdown(self, grace_s: float) -> None:
        """Refuse new requests; cancel the admitted ones after `grace_s`; a render in progress
        fails at once. Safe from a signal handler: it sets flags, kills a child, starts a timer."""
        with self._lock:
            self.closing = True
        self.renderer.close()
        self.llm.grammars.close()  # a grammar compiling in its child fails at once
        timer = threading.Timer(grace_s, self._cancel_all)
        timer.daemon = True
        timer.start()

    def _cancel_all(self) -> None:
        with self._lock:
            for c in self._cancels:
                c.set()

    def _watch(self, cancel: threading.Event) -> None:
        with self._lock:
            self._cancels.add(cancel)
            if self.closing:
                cancel.set()

    def _unwatch(self, cancel: threading.Event) -> None:
        with self._lock:
            self._cancels.discard(cancel)

    # -- a request's work before it queues: plain functions, run in a worker thread

    def parse(self, body: bytes, endpoint: str) -> tuple[dict, dict, list[dict] | None, Offer]:
        """The request's fields and call arguments; a chat's messages checked and bounded (their
        count, their bytes) before any template sees them, and the functions it offers."""
        data = parse(body, endpoint)
        args = sampling(data, endpoint)
        if endpoint != "chat":
            self._check_bytes(len(data["prompt"].encode("utf-8", "replace")), "prompt")
            return data, args, None, Offer()
        n_ctx = self.llm.n_ctx
        if isinstance(data["messages"], list) and len(data["messages"]) > n_ctx:  # each is a token at least
            raise BadRequest(f"messages: {len(data['messages'])} messages cannot fit a context of {n_ctx} tokens",
                             "messages")
        messages = check_messages(data["messages"])
        self._check_bytes(sum(len(json.dumps(m, ensure_ascii=False).encode("utf-8", "replace")) for m in messages)
                          + len(json.dumps(data.get("tools") or [], ensure_ascii=False).encode()), "messages")
        # the functions the template shows, and the grammar a required call brings (as LLM.chat's)
        offer = self.llm.offer(data.get("tools"), data.get("tool_choice"), data.get("parallel_tool_calls"))
        return data, args, messages, offer

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> Rendered:
        """The conversation through the template, in the child process, bounded in time and output."""
        rendered = self.renderer.render(self.llm.chat_template, messages, specials=tuple(self.llm.tokenizer.specials),
                                        timeout_s=self.timeout_s, max_chars=self.max_prompt_bytes, tools=tools)
        self._check_bytes(len(rendered.text.encode("utf-8", "replace")), "messages")
        return rendered

    def prepare(self, data: dict, args: dict, messages: list[dict] | None, rendered: Rendered | None,
                offer: Offer) -> Call:
        """The call, checked once (LLM.prepare): the prompt ids within the context, the knobs in
        their ranges, the grammar compiled (and kept)."""
        if messages is None:
            return self.llm.prepare(data["prompt"], **args)
        return self.llm.prepare(messages=messages, rendered=rendered, offer=offer, **args)

    def _check_bytes(self, n_bytes: int, field: str) -> None:
        if n_bytes > self.max_prompt_bytes:
            raise BadRequest(f"{field}: {n_bytes} bytes of text is more than the context of {self.llm.n_ctx} tokens "
                             f"can hold ({self.llm.n_ctx_source})", field)

    def tokenize(self, data: dict) -> dict:
        """llama.cpp's /tokenize: the ids of `content` (special-token text read as its token, as a
        completion's prompt is), a BOS first with `add_special`; `with_pieces`: each id's text
        (its bytes, when they are not UTF-8 on their own)."""
        self._check_bytes(len(data["content"].encode("utf-8", "replace")), "content")
        tok = self.llm.tokenizer
        ids = tok.encode(data["content"], add_bos=bool(data.get("add_special")))
        if not data.get("with_pieces"):
            return {"tokens": ids}

        def piece(i: int):
            b = tok.token_bytes(i)
            try:
                return b.decode("utf-8")
            except UnicodeDecodeError:
                return list(b)
        return {"tokens": [{"id": i, "piece": piece(i)} for i in ids]}

    def detokenize(self, data: dict) -> dict:
        """llama.cpp's /detokenize: the text of `tokens` (control tokens give no text)."""
        n_vocab = self.llm.tokenizer.vocab_size
        bad = next((i for i in data["tokens"] if not 0 <= i < n_vocab), None)
        if bad is not None:
            raise BadRequest(f"tokens: id {bad} is out of range [0, {n_vocab})", "tokens")
        return {"content": self.llm.tokenizer.decode(data["tokens"])}

    # -- endpoints

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "admitted": self.admitted, "queue": self.queue})

    async def models(self, request: Request) -> Response:
        model = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "lever"}
        return JSONResponse({"object": "list", "data": [model]})

    async def props(self, request: Request) -> Response:
        """llama-server's /props, its fields Lever has: the chat template (empty without one: a
        client then sends completions), one slot, the context."""
        try:
            template = self.llm.chat_template.text
        except LeverError:
            template = ""
        return JSONResponse({"model_alias": self.model_id, "chat_template": template, "total_slots": 1,
                             "default_generation_settings": {"n_ctx": self.llm.n_ctx},
                             "build_info": "lever"})

    async def tokens(self, request: Request) -> Response:
        """/tokenize and /detokenize: bounded and off the event loop as a generation's prompt is,
        never queued behind a generation."""
        endpoint = request.url.path.strip("/")
        try:
            with self.bodies.reserve(request.headers.get("content-length")):
                body = await read_body(request, timeout_s=self.timeout_s)
                data = await anyio.to_thread.run_sync(parse, body, endpoint, limiter=self._prep)
                del body
            work = self.tokenize if endpoint == "tokenize" else self.detokenize
            return JSONResponse(await anyio.to_thread.run_sync(work, data, limiter=self._prep))
        except BadRequest as e:
            return error(e.message, e.status, e.kind, e.param)

    async def prometheus(self, request: Request) -> Response:
        if self.metrics is None:  # as llama-server answers it
            return error("this server does not serve /metrics: start it with --metrics", 501, "not_supported")
        running = int(self.llm.busy)
        return Response(self.metrics.text(processing=running, deferred=max(self.admitted - running, 0)),
                        media_type="text/plain; version=0.0.4")

    async def completions(self, request: Request) -> Response:
        return await self._counted(request, "completions")

    async def chat(self, request: Request) -> Response:
        return await self._counted(request, "chat")

    async def _counted(self, request: Request, endpoint: str) -> Response:
        response = await self._handle(request, endpoint)
        if self.metrics is not None:
            self.metrics.add_status(response.status_code)
        return response

    def _finished(self, stats) -> None:
        if self.metrics is not None and stats is not None:
            self.metrics.add_run(stats)

    async def _handle(self, request: Request, endpoint: str) -> Response:
        chat = endpoint == "chat"
        data: dict = {}
        try:
            if self.closing:
                raise BadRequest(*SHUTTING_DOWN[:1], status=503, kind=SHUTTING_DOWN[2])
            # checked before queueing: a bad request never waits for its 400. Off the event loop,
            # a render apart from the rest: a slow template holds up chats, never completions
            with self.bodies.reserve(request.headers.get("content-length")):
                body = await read_body(request, timeout_s=self.timeout_s)
                data, args, messages, offer = await anyio.to_thread.run_sync(self.parse, body, endpoint,
                                                                             limiter=self._prep)
                del body
            rendered = None if messages is None else \
                await anyio.to_thread.run_sync(self.render, messages, offer.tools, limiter=self._renders)
            # prepared here, so a bad call is a 400 before the queue; a grammar compiles in its own thread
            grammar = args.get("grammar") is not None or args.get("json_schema") is not None or offer.grammar
            call = await anyio.to_thread.run_sync(self.prepare, data, args, messages, rendered, offer,
                                                  limiter=self._compiles if grammar else self._prep)
            self.admit()
        except BadRequest as e:
            return error(e.message, e.status, e.kind, e.param)
        except LeverError as e:
            if self.closing:  # a render cut by shutdown
                return error(*SHUTTING_DOWN)
            msg = _named(str(e), data)
            return error(msg, 400, "invalid_request_error", _param(msg))
        reply = Reply(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], chat, self.model_id,
                      self.llm.tokenizer)
        client = request.scope.get("state", {}).get("client")
        if data.get("stream"):
            usage = bool((data.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._stream(request, call, reply, usage, client, data),
                                     media_type="text/event-stream")
        try:
            c = await self._generate(request, call, client)
        except Cancelled as e:  # its client left while it waited (nobody reads this), or shutdown
            if self.closing:
                return error(*SHUTTING_DOWN)
            return error(str(e), 499, "cancelled")
        except LeverError as e:  # the generation failed: a grammar the engine gave up on, NaN in a model
            return error(**failure(e, data))
        finally:
            self.release()
        self._finished(c.stats)
        if c.finish_reason is StopReason.CANCELLED and self.closing:  # cut: never reported as finished
            return error(f"the server is shutting down: the generation was cut after {len(c.tokens)} tokens",
                         503, SHUTTING_DOWN[2])
        return JSONResponse(reply.body(c))

    async def _generate(self, request: Request, call: Call, client) -> Completion:
        cancel = call.cancel
        self._watch(cancel)
        outcome: list = []  # the completion or the error, raised outside the task group (no ExceptionGroup)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_client, request, cancel)
                try:
                    outcome.append(await anyio.to_thread.run_sync(
                        lambda: self.llm.run(call, session=self.session, client=client)))
                except LeverError as e:
                    outcome.append(e)
                finally:
                    cancel.set()
                    tg.cancel_scope.cancel()
        finally:
            self._unwatch(cancel)
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]

    @staticmethod
    async def _watch_client(request: Request, cancel: threading.Event) -> None:
        while not cancel.is_set():
            if await request.is_disconnected():
                cancel.set()
            await anyio.sleep(DISCONNECT_POLL_S)

    async def _stream(self, request: Request, call: Call, reply: Reply, usage: bool, client, data: dict):
        cancel = call.cancel
        self._watch(cancel)
        it = self.llm.stream_call(call, session=self.session, client=client)  # a tool call is held whole
        n_out, n_chars = 0, 0
        try:
            if reply.chat:
                yield reply.chunk({"role": "assistant", "content": ""}, None)
            while True:
                try:
                    chunk = await anyio.to_thread.run_sync(next, it, None)
                except Cancelled:
                    chunk = None if not self.closing else Chunk("", 0, StopReason.CANCELLED)
                    if chunk is None:
                        return
                except LeverError as e:  # failed mid-stream: an error event ends it, as OpenAI's do; no [DONE]
                    f = failure(e, data or {})
                    yield sse({"error": {"message": f["message"], "type": f["kind"], "param": f["param"],
                                         "code": None}})
                    return
                if chunk is None:
                    break
                n_out += chunk.n_tokens
                self._finished(chunk.stats)
                if chunk.text or chunk.logprobs:
                    lps = reply.logprobs(chunk.logprobs, n_chars) if call.logprobs is not None else None
                    yield reply.chunk({"content": chunk.text} if reply.chat else chunk.text, None, lps)
                    n_chars += len(chunk.text)
                if chunk.finish_reason is StopReason.CANCELLED and self.closing:
                    # cut by shutdown: an error event, as OpenAI's streams report a failure; no [DONE]
                    yield sse({"error": {"message": f"the server is shutting down: the generation was cut "
                                                    f"after {n_out} tokens", "type": SHUTTING_DOWN[2],
                                         "param": None, "code": None}})
                    return
                if chunk.finish_reason is not None:  # llama.cpp's timings ride on the last chunk
                    finish = OPENAI_FINISH[chunk.finish_reason]
                    if chunk.tool_calls:
                        finish = finish if chunk.finish_reason is StopReason.LENGTH else "tool_calls"
                        yield reply.chunk({"tool_calls": [tc.as_openai(i) for i, tc in enumerate(chunk.tool_calls)]},
                                          None)
                    extra = {"timings": timings(chunk.stats, chunk.usage.cached_tokens)} if chunk.stats else {}
                    yield reply.chunk({} if reply.chat else "", finish, extra=extra)
            if usage:
                yield reply.usage_chunk(len(call.ids), n_out)
            yield "data: [DONE]\n\n"
        finally:
            cancel.set()  # a client gone mid-stream: the generation ends at its next pass
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(it.close)
            self._unwatch(cancel)
            self.release()


def failure(e: LeverError, data: dict) -> dict:
    """`error`'s arguments for a generation that failed: a grammar the engine gave up on is the
    request's (400 naming its field), anything else (NaN in a model's numbers) the server's."""
    msg = _named(str(e), data)
    if isinstance(e, GrammarError):
        return {"message": msg, "status": 400, "kind": "invalid_request_error", "param": _param(msg)}
    return {"message": msg, "status": 500, "kind": "server_error", "param": None}


def _named(message: str, data: dict) -> str:
    """A line about the call's json_schema, named by the field the request gave it in."""
    rf = data.get("response_format")
    if message.startswith("json_schema:") and isinstance(rf, dict) and rf.get("type") != "text":
        return "response_format" + message[len("json_schema"):]
    return message


def _param(message: str) -> str | None:
    """The field a LeverError's one line names first ("max_tokens: ..."), if any."""
    head = message.split(":")[0] if ":" in message[:40] else None
    return head if head and all(c.isalnum() or c in "_.[]" for c in head) else None


def app(llm: LLM, *, model_id: str, queue: int = 8, access: Access | None = None,
        timeout_s: float = TIMEOUT_S, metrics: bool = False, cache_bytes: int = CACHE_BYTES, page: bool = True,
        live_bytes: int = LIVE_BYTES) -> Guard:
    """The ASGI app behind its Guard (lever.serve.guard); `.app.state.server` is its Server
    (for `shutdown`)."""
    s = Server(llm, model_id, queue, timeout_s, metrics=Metrics() if metrics else None, cache_bytes=cache_bytes)
    handlers = {HTTPException: _http_error, Exception: _internal_error}
    routes = [Route("/health", s.health), Route("/v1/models", s.models), Route("/props", s.props),
              Route("/v1/completions", s.completions, methods=["POST"]),
              Route("/v1/chat/completions", s.chat, methods=["POST"]),
              Route("/tokenize", s.tokens, methods=["POST"]),
              Route("/detokenize", s.tokens, methods=["POST"]), Route("/metrics", s.prometheus)]
    if page:  # the live page (lever.serve.page) over every generation's cycles
        tok = llm.tokenizer
        llm.watch = Watch(lambda t: tok.token_bytes(t).decode("utf-8", "replace"), max_bytes=live_bytes)
        s.page = Page(llm.watch, lambda: s.closing)
        routes += [Route("/", s.page.file), Route("/page/{name}", s.page.file), Route("/live", s.page.events)]
    a = Starlette(routes=routes, exception_handlers=handlers)
    a.state.server = s
    return Guard(a, access or Access())


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
    message = {404: f"no such route: {request.url.path[:80]}",
               405: f"{request.method} is not allowed on {request.url.path[:80]}"}.get(exc.status_code, str(exc.detail))
    return error(message, exc.status_code, kind)


async def _internal_error(request: Request, exc: Exception) -> Response:
    return error(f"internal error: {type(exc).__name__}", 500, "server_error")
