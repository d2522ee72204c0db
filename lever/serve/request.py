"""A request's body as the server reads it: bounded before it is read, type-checked field by field.

The first layer of `lever serve` (lever.serve.server calls it): the body is read only up to
MAX_BODY_BYTES and within the server's timeout (a declared Content-Length over the bound is
refused before one byte is read), parsed as JSON (nesting past the interpreter's recursion
limit refused), and each field checked; a field Lever does not honour is refused with 400
naming it, never silently ignored.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading

import anyio
import attrs
from starlette.requests import ClientDisconnect, Request

from lever.config import KNOBS

MAX_BODY_BYTES = 4 << 20
BODY_POOL_BYTES = 4 * MAX_BODY_BYTES  # bodies held at once, read and not yet parsed (in the server's plan)


class BadRequest(Exception):
    """A refusal: the HTTP status, OpenAI's error type, and the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


# the fields each endpoint reads, with the JSON types they may have (others are ignored, as OpenAI's clients
# send more): the generation knobs by their call names (lever.config.KNOBS), and the request's own
COMMON = {**{k.arg: (int,) if k.call.integer else (int, float) for k in KNOBS.values()},
          "model": (str,), "max_completion_tokens": (int,), "stop": (str, list), "stream": (bool,), "n": (int,),
          "stream_options": (dict,), "user": (str,),
          # structured output: OpenAI's response_format, and llama-server's grammar (GBNF or Lark) and json_schema
          "response_format": (dict,), "grammar": (str,), "json_schema": (dict,)}
FIELDS = {"completions": {**COMMON, "prompt": (str, list), "logprobs": (int, bool)},
          "chat": {**COMMON, "messages": (list,), "logprobs": (bool,), "top_logprobs": (int,), "tools": (list,),
                   "tool_choice": (str, dict), "parallel_tool_calls": (bool,)},
          # llama.cpp's own endpoints, by its field names
          "tokenize": {"content": (str,), "add_special": (bool,), "with_pieces": (bool,)},
          "detokenize": {"tokens": (list,)}}
# fields OpenAI's API has and Lever does not honour yet: refused unless absent or at their default
UNSUPPORTED = ("echo", "suffix", "best_of", "functions", "function_call", "logit_bias", "presence_penalty",
               "frequency_penalty")
DEFAULTS = (None, False, 0, [], {}, "none", "auto")


@attrs.define
class BodyPool:
    """The bytes of request bodies held at once (read, not yet parsed): a request reserves its
    declared length (the bound, when it declares none) before a byte is read and gives it back
    once parsed; past the pool it gets 503 at once, so many clients' bodies cannot add up past
    the server's memory plan."""

    capacity_bytes: int = BODY_POOL_BYTES
    used_bytes: int = 0
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    @contextlib.contextmanager
    def reserve(self, declared: str | None, max_bytes: int = MAX_BODY_BYTES):
        n = int(declared) if declared is not None and declared.isdigit() and int(declared) <= max_bytes \
            else max_bytes
        with self._lock:
            if self.used_bytes + n > self.capacity_bytes:
                raise BadRequest("the server is busy reading other requests' bodies; try again", status=503,
                                 kind="server_busy")
            self.used_bytes += n
        try:
            yield
        finally:
            with self._lock:
                self.used_bytes -= n


async def read_body(request: Request, *, timeout_s: float, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The body, checked against its bound before it is read (Content-Length) and while it is
    read (a client that lies or chunks); 413 past the bound, 408 past the timeout."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest("Content-Length: not a number", status=400)
        if int(declared) > max_bytes:
            raise BadRequest(f"the request body is {declared} bytes, over the bound of {max_bytes}", status=413)
    body = bytearray()
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_bytes:
                    raise BadRequest(f"the request body is over the bound of {max_bytes} bytes", status=413)
    except TimeoutError:
        raise BadRequest(f"the request body took over {timeout_s:g} s to arrive", status=408,
                         kind="request_timeout") from None
    except ClientDisconnect:
        raise BadRequest("the client left before its body arrived", status=400) from None
    return bytes(body)


def parse(body: bytes, endpoint: str) -> dict:
    """The request's fields, type-checked; BadRequest naming the first one at fault."""
    if len(body) > MAX_BODY_BYTES:
        raise BadRequest(f"request body over {MAX_BODY_BYTES} bytes", status=413)
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    except RecursionError:  # the parser's C recursion is bounded by the interpreter's limit
        raise BadRequest("the body nests too deep") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    for name in UNSUPPORTED:
        if name in data and not any(data[name] == d and type(data[name]) is type(d) for d in DEFAULTS):
            raise BadRequest(f"{name}: not supported by this server yet", name)
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
    if data.get("n") not in (None, 1):
        raise BadRequest("n: only 1 completion per request", "n")
    if endpoint == "tokenize":
        if not isinstance(data.get("content"), str):
            raise BadRequest("content: required, a string", "content")
    elif endpoint == "detokenize":
        ids = data.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise BadRequest("tokens: required, a list of token ids", "tokens")
    elif endpoint == "completions":
        p = data.get("prompt")
        if isinstance(p, list):
            if len(p) != 1 or not isinstance(p[0], str):
                raise BadRequest("prompt: a string, or a list of one string", "prompt")
            data["prompt"] = p[0]
        if not isinstance(data.get("prompt"), str):
            raise BadRequest("prompt: required, a string", "prompt")
    elif "messages" not in data:
        raise BadRequest("messages: required, a list of {role, content}", "messages")
    elif data.get("top_logprobs") is not None and not data.get("logprobs"):
        raise BadRequest("top_logprobs: needs logprobs: true", "top_logprobs")
    if endpoint in ("completions", "chat"):
        data["json_schema"] = _schema(data)
        if data["json_schema"] is not None and data.get("grammar") is not None:
            raise BadRequest("grammar: give a grammar or a JSON schema (response_format), not both", "grammar")
    return data


def _schema(data: dict) -> dict | None:
    """The JSON schema a request asks its output to follow: OpenAI's response_format (a
    json_object is any object), else llama-server's json_schema field."""
    rf = data.get("response_format")
    if rf is None:
        return data.get("json_schema")
    kind = rf.get("type")
    if kind == "text":
        return data.get("json_schema")
    if data.get("json_schema") is not None:
        raise BadRequest("json_schema: give it or response_format, not both", "json_schema")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("response_format.json_schema.schema: required, a JSON Schema object",
                             "response_format.json_schema.schema")
        return schema
    raise BadRequest(f"response_format.type: must be text, json_object or json_schema, got {json.dumps(kind)[:40]}",
                     "response_format.type")


def sampling(data: dict, endpoint: str = "completions") -> dict:
    """The call's arguments (lever.api.LLM.prepare) from a request: its knobs and stop strings;
    OpenAI's newer max_completion_tokens, when given, for max_tokens; `logprobs` as the count of
    alternatives per token (completions: the number given; chat: `top_logprobs` once
    `logprobs` is true)."""
    out = {k: data[k] for k in (*(k.arg for k in KNOBS.values()), "stop", "grammar", "json_schema")
           if data.get(k) is not None}
    if data.get("max_completion_tokens") is not None:
        out[KNOBS["n_predict"].arg] = data["max_completion_tokens"]
    if endpoint == "chat":
        if data.get("logprobs"):
            out["logprobs"] = data.get("top_logprobs") or 0
    elif data.get("logprobs") is not None and data["logprobs"] is not False:
        out["logprobs"] = 0 if data["logprobs"] is True else data["logprobs"]  # true: the tokens' own, no alternatives
    return out
