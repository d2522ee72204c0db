"""An OpenAI-compatible HTTP server over one open pipeline (lever.api.LLM).

    /health, /v1/models, /v1/completions, /v1/chat/completions (SSE with "stream": true)

One model pair, one generation at a time, as on a phone: requests wait in a queue of at most
`queue` beside the one running, and past it get 429 with an OpenAI-style error. A client that
goes away cancels its generation at the end of the current pass and frees its place. Bad
requests get 400 naming the field. On shutdown (SIGINT, SIGTERM or SIGHUP to `lever serve`) new
requests get 503 and the admitted ones have `grace_s` to finish; then the running one is
cancelled at its next pass (its client gets what was generated) and the waiting ones get 503.
Starlette (on anyio, like the pipeline) serves it; the generation itself runs in a worker
thread, so the event loop keeps answering.
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid

import anyio
import attrs
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lever.api import LLM, Cancelled, Completion, Session
from lever.config import KNOBS
from lever.errors import LeverError
from lever.model.stop import StopReason

DISCONNECT_POLL_S = 0.2  # how often a waiting or running request checks that its client is still there
# OpenAI's finish_reason of each of Lever's (lever.model.stop)
OPENAI_FINISH = {StopReason.STOP: "stop", StopReason.EOS: "stop", StopReason.LENGTH: "length",
                 StopReason.CONTEXT: "length", StopReason.CANCELLED: "stop"}
MAX_BODY_BYTES = 4 << 20


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error(message: str, status: int, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


# the fields each endpoint reads, with the JSON types they may have (others are ignored, as OpenAI's clients
# send more): the generation knobs by their call names (lever.config.KNOBS), and the request's own
COMMON = {**{k.arg: (int,) if k.call.integer else (int, float) for k in KNOBS.values()},
          "model": (str,), "max_completion_tokens": (int,), "stop": (str, list), "stream": (bool,), "n": (int,),
          "stream_options": (dict,)}
FIELDS = {"completions": {**COMMON, "prompt": (str, list)}, "chat": {**COMMON, "messages": (list,)}}


def parse(body: bytes, endpoint: str) -> dict:
    """The request's fields, type-checked; BadRequest naming the first one at fault."""
    if len(body) > MAX_BODY_BYTES:
        raise BadRequest(f"request body over {MAX_BODY_BYTES} bytes", status=413)
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    for name, types in FIELDS[endpoint].items():
        v = data.get(name)
        if v is None:
            continue
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            want = " or ".join({str: "a string", int: "an integer", float: "a number", list: "a list",
                                bool: "a boolean", dict: "an object"}[t] for t in types)
            raise BadRequest(f"{name}: must be {want}, got {json.dumps(v)[:40]}", name)
        if isinstance(v, float) and not math.isfinite(v):
            raise BadRequest(f"{name}: must be a finite number", name)
    if data.get("n", 1) != 1:
        raise BadRequest("n: only 1 completion per request", "n")
    if endpoint == "completions":
        p = data.get("prompt")
        if isinstance(p, list):
            if len(p) != 1 or not isinstance(p[0], str):
                raise BadRequest("prompt: a string, or a list of one string", "prompt")
            data["prompt"] = p[0]
        if not isinstance(data.get("prompt"), str):
            raise BadRequest("prompt: required, a string", "prompt")
    elif "messages" not in data:
        raise BadRequest("messages: required, a list of {role, content}", "messages")
    return data


def sampling(data: dict) -> dict:
    """The call's arguments (lever.api.LLM.check) from a request: its knobs and stop strings;
    OpenAI's newer max_completion_tokens, when given, for max_tokens."""
    out = {k: data[k] for k in (*(k.arg for k in KNOBS.values()), "stop") if data.get(k) is not None}
    if data.get("max_completion_tokens") is not None:
        out[KNOBS["n_predict"].arg] = data["max_completion_tokens"]
    return out


@attrs.define
class Server:
    """The app's state: the model, the queue's count, the ids."""

    llm: LLM
    model_id: str
    queue: int = 8
    admitted: int = 0  # running + waiting
    created: int = attrs.field(factory=lambda: int(time.time()))
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    closing: bool = False
    _cancels: set = attrs.field(factory=set)  # the admitted requests' cancel events
    # the last conversation's KV caches: a request that continues it (the next chat turn, a
    # retry) prefills only what is new. One pair, the memory plan's; one generation at a time
    session: Session = attrs.field(init=False)

    def __attrs_post_init__(self):
        self.session = self.llm.session()

    def admit(self) -> None:
        with self._lock:
            if self.closing:
                raise BadRequest("the server is shutting down", status=503, kind="server_shutting_down")
            if self.admitted > self.queue:  # one running and `queue` waiting
                raise BadRequest(f"the server is busy: {self.queue} requests already wait", status=429,
                                 kind="rate_limit_exceeded")
            self.admitted += 1

    def release(self) -> None:
        with self._lock:
            self.admitted -= 1

    def shutdown(self, grace_s: float) -> None:
        """Refuse new requests; cancel the admitted ones after `grace_s`. Safe from a signal
        handler: it only sets a flag and starts a timer."""
        with self._lock:
            self.closing = True
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

    # -- endpoints

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "admitted": self.admitted, "queue": self.queue})

    async def models(self, request: Request) -> Response:
        model = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "lever"}
        return JSONResponse({"object": "list", "data": [model]})

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completions")

    async def chat(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    async def _handle(self, request: Request, endpoint: str) -> Response:
        try:
            data = parse(await request.body(), endpoint)
            args = sampling(data)
            chat = endpoint == "chat"
            # checked before queueing: a bad request never waits for its 400
            ids = self.llm.encode_prompt(self.llm.render(data["messages"]) if chat else data["prompt"], chat=chat)
            self.llm.check(args, len(ids))
            self.admit()
        except BadRequest as e:
            return error(e.message, e.status, e.kind, e.param)
        except LeverError as e:
            msg = str(e)
            return error(msg, 400, "invalid_request_error", msg.split(":")[0] if ":" in msg[:40] else None)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if data.get("stream"):
            usage = bool((data.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._stream(request, ids, args, rid, chat, usage), media_type="text/event-stream")
        try:
            c = await self._generate(request, ids, args)
        except Cancelled as e:  # its client left while it waited (nobody reads this), or shutdown
            if self.closing:
                return error("the server is shutting down", 503, "server_shutting_down")
            return error(str(e), 499, "cancelled")
        finally:
            self.release()
        return JSONResponse(self._body(c, rid, chat))

    async def _generate(self, request: Request, ids: list[int], args: dict) -> Completion:
        cancel = threading.Event()
        self._watch(cancel)
        async with anyio.create_task_group() as tg:
            async def watch():
                while not cancel.is_set():
                    if await request.is_disconnected():
                        cancel.set()
                    await anyio.sleep(DISCONNECT_POLL_S)

            tg.start_soon(watch)
            try:
                return await anyio.to_thread.run_sync(
                    lambda: self.llm.complete(ids, {**args, "cancel": cancel}, session=self.session))
            finally:
                cancel.set()
                self._unwatch(cancel)
                tg.cancel_scope.cancel()

    async def _stream(self, request: Request, ids: list[int], args: dict, rid: str, chat: bool, usage: bool):
        cancel = threading.Event()
        self._watch(cancel)
        it = self.llm.stream_ids(ids, {**args, "cancel": cancel}, session=self.session)
        n_out = 0
        try:
            if chat:
                yield self._event(rid, chat, {"role": "assistant", "content": ""}, None)
            while True:
                try:
                    chunk = await anyio.to_thread.run_sync(next, it, None)
                except Cancelled:
                    return
                if chunk is None:
                    break
                n_out += chunk.n_tokens
                if chunk.text:
                    yield self._event(rid, chat, {"content": chunk.text} if chat else chunk.text, None)
                if chunk.finish_reason is not None:
                    yield self._event(rid, chat, {} if chat else "", OPENAI_FINISH[chunk.finish_reason])
            if usage:
                yield _sse({"id": rid, "object": self._object(chat, True), "created": int(time.time()),
                            "model": self.model_id, "choices": [],
                            "usage": _usage(len(ids), n_out)})
            yield "data: [DONE]\n\n"
        finally:
            cancel.set()  # a client gone mid-stream: the generation ends at its next pass
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(it.close)
            self._unwatch(cancel)
            self.release()

    def _object(self, chat: bool, chunk: bool) -> str:
        return ("chat.completion" + (".chunk" if chunk else "")) if chat else "text_completion"

    def _event(self, rid: str, chat: bool, delta, finish: str | None) -> str:
        choice = {"index": 0, "finish_reason": finish}
        choice.update({"delta": delta} if chat else {"text": delta, "logprobs": None})
        return _sse({"id": rid, "object": self._object(chat, True), "created": int(time.time()),
                     "model": self.model_id, "choices": [choice]})

    def _body(self, c: Completion, rid: str, chat: bool) -> dict:
        choice = {"index": 0, "finish_reason": OPENAI_FINISH[c.finish_reason]}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice.update(text=c.text, logprobs=None)
        return {"id": rid, "object": self._object(chat, False), "created": int(time.time()), "model": self.model_id,
                "choices": [choice], "usage": _usage(c.usage.prompt_tokens, c.usage.completion_tokens,
                                                     c.usage.cached_tokens)}


def _usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def app(llm: LLM, *, model_id: str, queue: int = 8) -> Starlette:
    """The ASGI app; `app.state.server` is its Server (for `shutdown`)."""
    s = Server(llm, model_id, queue)
    a = Starlette(routes=[Route("/health", s.health), Route("/v1/models", s.models),
                             Route("/v1/completions", s.completions, methods=["POST"]),
                             Route("/v1/chat/completions", s.chat, methods=["POST"])])
    a.state.server = s
    return a
