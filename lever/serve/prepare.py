"""A request's work before it queues: read, parse, render, prepare, each bounded, off the event loop.

Below the server's routes (lever.serve.server), above the body's reader and parser
(lever.serve.request) and the API (lever.api.LLM.prepare). What a request holds at each step is
held in the server's pool first (lever.serve.pool): its body's bytes as they arrive (read within
its bound and the server's timeout), what parsing them may take (refused unparsed past
MAX_PARSE_BYTES; only the fields read are kept), a chat's messages bounded (their count, their
bytes) before any template sees them and rendered by the LLM's renderer in its child process
(lever.api.render), bounded in time and output, the prompt's tokenizing; then the call is
prepared once (the prompt within the context, the knobs in their ranges, a grammar compiled)
and the request holds only what the call keeps until it ends.
Each step runs in a worker thread of its own kind, so a slow template holds up chats and a slow
grammar other grammars, never plain completions or /tokenize.
"""

from __future__ import annotations

import json
import threading

import anyio
import attrs
from starlette.requests import Request

from lever.api import LLM, Call, Offer
from lever.api.render import PromptTooLong
from lever.errors import LeverError
from lever.gguf.chat_template import Rendered, check_messages, check_variables, continues
from lever.gguf.fim import Extra, fim_ids
from lever.serve import TIMEOUT_S
from lever.serve.dialect import Dialect
from lever.serve.pool import Hold
from lever.serve.rate import BodyRate
from lever.serve.request import OPTIONS, BadRequest, parse, parse_bytes, read_body, sampling
from lever.serve.tokens import detokenize, tokenize

PREP_THREADS = 2  # requests parsed and tokenized at once (what each holds is in its Hold)
MAX_PARSE_BYTES = 24 << 20  # a body whose JSON would take more to parse is refused (4 MiB of text: 8-9 MB)
# what `tokenizers` allocates per byte of text it encodes (0.23: 256 for "a a a ...", 107 for
# 128-byte tokens, measured on a 1-2 MB text; less for code), held while a prompt is tokenized
ENCODE_BYTES_PER_BYTE = 256
TOKEN_ANSWER_BYTES = 64  # /tokenize's answer per token: its id in a list and its JSON text (pieces: 4x)
CALL_BYTES = 16 << 10  # a call's own objects beside its ids (knobs, events, the Call itself), at most


@attrs.define
class Preparer:
    """The server's preparation of requests: the worker threads' limits; its chats render
    through its LLM's renderer (one child process for the library's calls and the server's)."""

    llm: LLM
    timeout_s: float = TIMEOUT_S
    rate: BodyRate = attrs.field(factory=BodyRate)  # how fast one client's bodies are read
    _prep: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(PREP_THREADS))
    _renders: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(1))  # one child
    _compiles: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(1))  # one grammar child
    closed: bool = False  # shutting down: bodies still arriving get 503

    @property
    def max_prompt_bytes(self) -> int:
        """Text of more bytes is over the context before it is counted (the LLM's rule:
        lever.api.render.ChatRenderer.max_prompt_bytes)."""
        return self.llm.renderer.max_prompt_bytes

    async def call(self, request: Request, dialect: Dialect, hold: Hold) -> tuple[Shape, Call]:
        """The request's (first) call and how its answer is shaped (`calls`)."""
        shape, calls = await self.calls(request, dialect, hold)
        return shape, calls[0]

    async def calls(self, request: Request, dialect: Dialect, hold: Hold) -> tuple[Shape, tuple[Call, ...]]:
        """The request's calls, checked (BadRequest or LeverError naming the field): one per
        prompt (llama-server's several prompts: lever.serve.request._check_prompt), each asked
        `n` times (Shape.n: the server runs them one after another, `choices`); and how its
        answer is shaped. What the request holds meanwhile is in `hold`, and from here on only
        what the calls keep (`call_bytes`)."""
        data, args, messages, offer = await self._parsed(request, dialect.endpoint, hold, dialect.translate)
        shape = Shape.of(data)
        rendered = None
        if messages is not None:
            hold.add(4 * self.max_prompt_bytes, "its chat template's text")
            rendered = await anyio.to_thread.run_sync(self.render, messages, offer.tools, data, limiter=self._renders)
        text = prompt_texts(data) if messages is None else rendered.text
        hold.add(ENCODE_BYTES_PER_BYTE * len(text.encode("utf-8", "replace")), "tokenizing its prompt")
        grammar = args.get("grammar") is not None or args.get("json_schema") is not None or offer.grammar
        calls = []
        for one in data.pop("prompts", None) or [{}]:  # several prompts: a call each, the rest alike
            try:
                calls.append(await anyio.to_thread.run_sync(self.prepare, {**data, **one}, args, messages, rendered,
                                                            offer, limiter=self._compiles if grammar else self._prep))
            except LeverError as e:  # named by the field the request gave it in
                raise LeverError(named(str(e), shape.schema_field)) from None
        del data, args, messages, rendered, text
        calls = [c for call in calls for c in choices(call, shape.n)]
        hold.set(sum(call_bytes(c) for c in calls), "its calls")
        return shape, tuple(calls)

    async def tokens(self, request: Request, endpoint: str, hold: Hold) -> dict:
        """/tokenize and /detokenize: bounded and off the event loop as a generation's prompt
        is, their answers held (a token and its piece cost what TOKEN_ANSWER_BYTES says)."""
        data = (await self._parsed(request, endpoint, hold))[0]
        tok = self.llm.tokenizer
        if endpoint == "tokenize":
            n_bytes = len(data["content"].encode("utf-8", "replace"))
            self.check_bytes(n_bytes, "content")
            per_token = TOKEN_ANSWER_BYTES * (4 if data.get("with_pieces") else 1)  # at most a token per byte
            hold.add((ENCODE_BYTES_PER_BYTE + per_token) * n_bytes, "tokenizing its content")
            return await anyio.to_thread.run_sync(tokenize, tok, data, self.check_bytes, limiter=self._prep)
        hold.add(TOKEN_ANSWER_BYTES * len(data["tokens"]) * 4, "its text")
        return await anyio.to_thread.run_sync(detokenize, tok, data, limiter=self._prep)

    async def _parsed(self, request: Request, endpoint: str, hold: Hold, translate=None):
        """The body read and parsed, its bytes then what parsing may allocate held first
        (lever.serve.request.parse_bytes): a body whose JSON would take more is refused unparsed."""
        body = await read_body(request, hold=hold, timeout_s=self.timeout_s, rate=self.rate,
                               closing=lambda: self.closed)
        need = await anyio.to_thread.run_sync(parse_bytes, body, limiter=self._prep)
        if need > MAX_PARSE_BYTES:
            raise BadRequest(f"the request body's JSON would take {need >> 20} MiB to parse (its values), over "
                             f"the bound of {MAX_PARSE_BYTES >> 20} MiB", status=413)
        hold.set(len(body) + need, "parsing its JSON")
        if endpoint in ("tokenize", "detokenize"):
            return await anyio.to_thread.run_sync(parse, body, endpoint, limiter=self._prep), None, None, None
        return await anyio.to_thread.run_sync(self.parse, body, endpoint, translate, limiter=self._prep)

    def parse(self, body: bytes, endpoint: str, translate=None) -> tuple[dict, dict, list[dict] | None, Offer]:
        """The request's fields and call arguments (its dialect's body translated first); a chat's
        messages checked and bounded (their count, their bytes) before any template sees them,
        and the functions it offers."""
        data = parse(body, endpoint, translate)
        args = sampling(data, endpoint)
        if endpoint != "chat":
            self.check_bytes(len(prompt_texts(data).encode("utf-8", "replace")), "prompt")
            return data, args, None, Offer()
        n_ctx = self.llm.n_ctx
        if isinstance(data["messages"], list) and len(data["messages"]) > n_ctx:  # each is a token at least
            raise BadRequest(f"messages: {len(data['messages'])} messages cannot fit a context of {n_ctx} tokens",
                             "messages")
        # llama-server's prefill: a last assistant message is continued, not answered
        data["continue_final_message"] = continues(data["messages"], data.get("add_generation_prompt"),
                                                   data.get("continue_final_message"))
        messages = check_messages(data["messages"], data["continue_final_message"])
        data["chat_template_kwargs"] = check_variables(data.get("chat_template_kwargs"))
        self.check_bytes(sum(len(json.dumps(m, ensure_ascii=False).encode("utf-8", "replace")) for m in messages)
                         + len(json.dumps(data.get("tools") or [], ensure_ascii=False).encode())
                         + len(json.dumps(data["chat_template_kwargs"], ensure_ascii=False).encode()), "messages")
        # the functions the template shows, and the grammar a required call brings (as LLM.chat's); an
        # empty list offers none, as llama-server reads it
        offer = self.llm.offer(data.get("tools") or None, data.get("tool_choice"), data.get("parallel_tool_calls"))
        return data, args, messages, offer

    def render(self, messages: list[dict], tools: tuple[dict, ...] | None = None, data: dict | None = None
               ) -> Rendered:
        """The conversation through the template, in the LLM's renderer's child process, bounded
        in time (the server's timeout) and output; with the request's `add_generation_prompt`,
        `chat_template_kwargs` and `continue_final_message` (its `data`, parsed), as llama-server
        takes them."""
        data = data or {}
        try:
            return self.llm.renderer.render(self.llm.chat_template, messages, list(tools) if tools else None,
                                            timeout_s=self.timeout_s,
                                            add_generation_prompt=data.get("add_generation_prompt") is not False,
                                            variables=data.get("chat_template_kwargs"),
                                            continue_final=bool(data.get("continue_final_message")))
        except PromptTooLong as e:
            raise BadRequest(str(e), e.field) from None

    def prepare(self, data: dict, args: dict, messages: list[dict] | None, rendered: Rendered | None,
                offer: Offer) -> Call:
        """The call, checked once (LLM.prepare): the prompt ids within the context, the knobs in
        their ranges, the grammar compiled (and kept)."""
        if messages is None and any(k in data for k in ("input_prefix", "input_suffix")):
            return self.llm.prepare(ids=self.infill_ids(data, args), **args)
        if messages is None and data.get("prompt_ids") is not None:
            return self.llm.prepare(ids=mixed_ids(self.llm.tokenizer, data["prompt_ids"]), **args)
        if messages is None:
            return self.llm.prepare(data["prompt"], **args)
        return self.llm.prepare(messages=messages, rendered=rendered, offer=offer, **args)

    def infill_ids(self, data: dict, args: dict) -> list[int]:
        """A fill-in-the-middle prompt (lever.gguf.fim): the code around the cursor, other files
        before it, within the context less what the reply may take (a quarter at most)."""
        n_ctx = self.llm.n_ctx
        n_reply = min(args.get("max_tokens") or n_ctx // 4, n_ctx // 4)
        extra = [Extra(x.get("filename", "tmp"), x.get("text", "")) for x in data.get("input_extra") or ()]
        return fim_ids(self.llm.tokenizer, prefix=data.get("input_prefix", ""), suffix=data.get("input_suffix", ""),
                       prompt=data.get("prompt", ""), extra=extra, n_room=n_ctx - n_reply)

    async def rendered(self, request: Request, hold: Hold) -> Rendered:
        """A chat request's conversation through the template, read and bounded as a chat's
        (/apply-template: llama-server's view of what a chat would prefill)."""
        data, _, messages, offer = await self._parsed(request, "chat", hold)
        hold.add(4 * self.max_prompt_bytes, "its chat template's text")
        return await anyio.to_thread.run_sync(self.render, messages, offer.tools, data, limiter=self._renders)

    def check_bytes(self, n_bytes: int, field: str) -> None:
        try:
            self.llm.renderer.check_bytes(n_bytes, field)
        except PromptTooLong as e:
            raise BadRequest(str(e), e.field) from None

    def close(self) -> None:
        """Bodies still arriving get 503; the children stop: a render or a grammar's compile
        under way fails at once (safe from a signal handler: nothing here waits)."""
        self.closed = True
        self.llm.renderer.close(wait=False)
        self.llm.grammars.close()


@attrs.frozen
class Shape:
    """How a request's answer is shaped, all a request keeps of its body past preparation."""

    stream: bool = False
    usage: bool = False  # stream_options.include_usage: a last chunk with the counts
    schema_field: str = "json_schema"  # the field a JSON schema came in, for the errors about it
    return_tokens: bool = False  # llama-server's: the answer lists the generated ids
    n: int = 1  # the choices asked of each prompt
    # llama-server's asks of its answer (lever.serve.request.OPTIONS: verbose, response_fields, ...)
    options: dict = attrs.field(factory=dict)

    @classmethod
    def of(cls, data: dict) -> Shape:
        rf = data.get("response_format")
        field = "response_format" if isinstance(rf, dict) and rf.get("type") != "text" else "json_schema"
        return cls(bool(data.get("stream")), bool((data.get("stream_options") or {}).get("include_usage")), field,
                   bool(data.get("return_tokens")), data.get("n") or 1,
                   {k: data[k] for k in OPTIONS if data.get(k) is not None})


def prompt_texts(data: dict) -> str:
    """A completion's prompt text: its own, and the texts among its ids or its several prompts'."""
    parts = [data.get("prompt") or "", *(x for x in data.get("prompt_ids") or () if isinstance(x, str))]
    for one in data.get("prompts") or ():
        parts.append(prompt_texts(one))
    return "".join(parts)


def mixed_ids(tok, pieces) -> list:
    """A prompt of ids with strings among them (llama-server's mixed prompt): each string's ids
    in its place, a BOS before the first only when it leads (as a text prompt's)."""
    if all(not isinstance(x, str) for x in pieces):
        return pieces
    out = []
    for i, x in enumerate(pieces):
        out.extend(tok.encode(x, add_bos=None if i == 0 else False) if isinstance(x, str) else [x])
    return out


def choices(call: Call, n: int) -> list[Call]:
    """A call asked `n` times: each its own cancel event, and a seeded call's seed one more per
    choice (llama-server's: the same seed would give the same text n times)."""
    seeded = call.generate.seed >= 0
    return [call] + [attrs.evolve(call, cancel=threading.Event(), generate=attrs.evolve(
        call.generate, seed=call.generate.seed + j) if seeded else call.generate) for j in range(1, n)]


def call_bytes(call: Call) -> int:
    """What a prepared call holds while it waits and runs: its ids (a tuple of ints: 36 bytes
    each past the small ones), stop strings, the functions it offers, its grammar (kept alive
    by the call even when the grammar cache lets it go)."""
    tools = parse_bytes(json.dumps(call.tools).encode()) if call.tools else 0
    grammar = call.grammar.nbytes if call.grammar is not None else 0
    return (CALL_BYTES + 40 * len(call.ids) + 4 * sum(len(x) for x in call.stop) + tools + grammar
            + call.generate.logit_bias.nbytes)


def named(message: str, schema_field: str) -> str:
    """A line about the call's json_schema, named by the field the request gave it in (a place
    in the schema by its path there: response_format.json_schema.schema.properties.a)."""
    rest = message[len("json_schema"):]
    if schema_field == "json_schema" or not message.startswith("json_schema") or rest[:1] not in ":.[":
        return message
    return schema_field + (rest if rest.startswith(":") else ".json_schema.schema" + rest)
