"""A request's work before it queues: read, parse, render, prepare, each bounded, off the event loop.

Below the server's routes (lever.serve.server), above the body's reader and parser
(lever.serve.request) and the API (lever.api.LLM.prepare). A body is read within its bound and
the server's timeout, its bytes reserved in the pool of bodies held at once; it is parsed and a
chat's messages bounded (their count, their bytes) before any template sees them; a chat is
rendered in a child process (lever.gguf.render_child), bounded in time and output; then the call
is prepared once: the prompt within the context, the knobs in their ranges, a grammar compiled.
Each step runs in a worker thread of its own kind, so a slow template holds up chats and a slow
grammar other grammars, never plain completions or /tokenize.
"""

from __future__ import annotations

import json

import anyio
import attrs
from starlette.requests import Request

from lever.api import LLM, Call, Offer
from lever.errors import LeverError
from lever.gguf.chat_template import Rendered, check_messages
from lever.gguf.render_child import RenderProcess
from lever.serve import TIMEOUT_S
from lever.serve.request import BadRequest, BodyPool, parse, read_body, sampling
from lever.serve.tokens import detokenize, tokenize

PREP_THREADS = 2  # requests parsed and tokenized at once (each holds at most a body's bound of memory)


@attrs.define
class Preparer:
    """The server's preparation of requests: the pool of bodies, the renderer's child, the
    worker threads' limits."""

    llm: LLM
    timeout_s: float = TIMEOUT_S
    renderer: RenderProcess = attrs.field(factory=RenderProcess)  # a chat template runs in a child process
    bodies: BodyPool = attrs.field(factory=BodyPool)  # bodies being read and parsed, bounded together
    max_prompt_bytes: int = attrs.field(init=False)
    _prep: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(PREP_THREADS))
    _renders: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(1))  # one child
    _compiles: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(1))  # one grammar child

    def __attrs_post_init__(self):
        # a token stands for at most the longest token's bytes: a prompt of more bytes than the
        # context's tokens could hold is over the context before it is counted (twice that, for
        # normalizers that shorten text before the model sees it)
        self.max_prompt_bytes = 2 * self.llm.n_ctx * self.llm.tokenizer.max_token_bytes

    async def call(self, request: Request, endpoint: str) -> tuple[dict, Call]:
        """The request's fields and its call, checked: BadRequest or LeverError naming the field."""
        with self.bodies.reserve(request.headers.get("content-length")):
            body = await read_body(request, timeout_s=self.timeout_s)
            data, args, messages, offer = await anyio.to_thread.run_sync(self.parse, body, endpoint,
                                                                         limiter=self._prep)
            del body
        rendered = None if messages is None else \
            await anyio.to_thread.run_sync(self.render, messages, offer.tools, limiter=self._renders)
        grammar = args.get("grammar") is not None or args.get("json_schema") is not None or offer.grammar
        try:
            call = await anyio.to_thread.run_sync(self.prepare, data, args, messages, rendered, offer,
                                                  limiter=self._compiles if grammar else self._prep)
        except LeverError as e:  # named by the field the request gave it in
            raise LeverError(named(str(e), data)) from None
        return data, call

    async def tokens(self, request: Request, endpoint: str) -> dict:
        """/tokenize and /detokenize: bounded and off the event loop as a generation's prompt is."""
        with self.bodies.reserve(request.headers.get("content-length")):
            body = await read_body(request, timeout_s=self.timeout_s)
            data = await anyio.to_thread.run_sync(parse, body, endpoint, limiter=self._prep)
            del body
        tok = self.llm.tokenizer
        if endpoint == "tokenize":
            return await anyio.to_thread.run_sync(tokenize, tok, data, self.check_bytes, limiter=self._prep)
        return await anyio.to_thread.run_sync(detokenize, tok, data, limiter=self._prep)

    def parse(self, body: bytes, endpoint: str) -> tuple[dict, dict, list[dict] | None, Offer]:
        """The request's fields and call arguments; a chat's messages checked and bounded (their
        count, their bytes) before any template sees them, and the functions it offers."""
        data = parse(body, endpoint)
        args = sampling(data, endpoint)
        if endpoint != "chat":
            self.check_bytes(len(data["prompt"].encode("utf-8", "replace")), "prompt")
            return data, args, None, Offer()
        n_ctx = self.llm.n_ctx
        if isinstance(data["messages"], list) and len(data["messages"]) > n_ctx:  # each is a token at least
            raise BadRequest(f"messages: {len(data['messages'])} messages cannot fit a context of {n_ctx} tokens",
                             "messages")
        messages = check_messages(data["messages"])
        self.check_bytes(sum(len(json.dumps(m, ensure_ascii=False).encode("utf-8", "replace")) for m in messages)
                         + len(json.dumps(data.get("tools") or [], ensure_ascii=False).encode()), "messages")
        # the functions the template shows, and the grammar a required call brings (as LLM.chat's)
        offer = self.llm.offer(data.get("tools"), data.get("tool_choice"), data.get("parallel_tool_calls"))
        return data, args, messages, offer

    def render(self, messages: list[dict], tools: tuple[dict, ...] | None = None) -> Rendered:
        """The conversation through the template, in the child process, bounded in time and output."""
        rendered = self.renderer.render(self.llm.chat_template, messages, specials=tuple(self.llm.tokenizer.specials),
                                        timeout_s=self.timeout_s, max_chars=self.max_prompt_bytes,
                                        tools=list(tools) if tools else None)
        self.check_bytes(len(rendered.text.encode("utf-8", "replace")), "messages")
        return rendered

    def prepare(self, data: dict, args: dict, messages: list[dict] | None, rendered: Rendered | None,
                offer: Offer) -> Call:
        """The call, checked once (LLM.prepare): the prompt ids within the context, the knobs in
        their ranges, the grammar compiled (and kept)."""
        if messages is None:
            return self.llm.prepare(data["prompt"], **args)
        return self.llm.prepare(messages=messages, rendered=rendered, offer=offer, **args)

    def check_bytes(self, n_bytes: int, field: str) -> None:
        if n_bytes > self.max_prompt_bytes:
            raise BadRequest(f"{field}: {n_bytes} bytes of text is more than the context of {self.llm.n_ctx} tokens "
                             f"can hold ({self.llm.n_ctx_source})", field)

    def close(self) -> None:
        """Stops the children: a render or a grammar's compile under way fails at once."""
        self.renderer.close()
        self.llm.grammars.close()


def named(message: str, data: dict) -> str:
    """A line about the call's json_schema, named by the field the request gave it in."""
    rf = data.get("response_format")
    if message.startswith("json_schema:") and isinstance(rf, dict) and rf.get("type") != "text":
        return "response_format" + message[len("json_schema"):]
    return message
