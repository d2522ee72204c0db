"""A request's body as the server reads it: bounded before it is read, type-checked field by field.

The first layer of `lever serve` (lever.serve.server calls it): the body is read only up to
MAX_BODY_BYTES and within the server's timeout (a declared Content-Length over the bound is
refused before one byte is read), parsed as JSON (nesting past the interpreter's recursion
limit refused), and each field checked; a field Lever does not honour is refused with 400
naming it, never silently ignored.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

import anyio
from starlette.requests import Request

from lever.api.call import MAX_LOGPROBS
from lever.config import KNOBS, GenerateConfig
from lever.model.sampling import NEVER

MAX_BODY_BYTES = 4 << 20
CLOSING_POLL_S = 0.05  # a body's reader sees the server shutting down within this
IDLE_S = 5.0  # a body that sends nothing for this long is cut (it holds a connection, if no memory)
PARSE_BASE_BYTES = 4 << 10  # the parser's own state, whatever the body (1.3 kB measured)
PER_VALUE_BYTES = 96  # a parsed JSON value's most, its place in its container included (measured: 36-68)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string literal, escapes included (unrolled: fast)


SHUTTING_DOWN = ("the server is shutting down", 503, "server_shutting_down")  # message, status, OpenAI's type


class BadRequest(Exception):
    """A refusal: the HTTP status, OpenAI's error type, and the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def shutting_down() -> BadRequest:
    """The refusal of a request the server will not serve because it is stopping."""
    return BadRequest(SHUTTING_DOWN[0], status=SHUTTING_DOWN[1], kind=SHUTTING_DOWN[2])


# the fields each endpoint reads, with the JSON types they may have (others are ignored, as OpenAI's clients
# send more): the generation knobs by their call names (lever.config.KNOBS), and the request's own
COMMON = {**{k.arg: (int,) if k.call.integer else (int, float) for k in KNOBS.values()},
          "model": (str,), "max_completion_tokens": (int,), "stop": (str, list), "stream": (bool,), "n": (int,),
          "stream_options": (dict,), "user": (str,),
          # llama-server's and OpenAI's logit bias (lever.api.call.logit_bias reads its forms), and its ignore_eos
          "logit_bias": (list, dict), "ignore_eos": (bool,),
          # structured output: OpenAI's response_format, and llama-server's grammar (GBNF or Lark) and json_schema
          "response_format": (dict,), "grammar": (str,), "json_schema": (dict,),
          # llama-server's asks of the answer's shape (OPTIONS: lever.serve.prepare.Shape keeps them)
          "verbose": (bool,), "timings_per_token": (bool,), "return_progress": (bool,),
          "post_sampling_probs": (bool,), "response_fields": (list,)}
OPTIONS = ("verbose", "timings_per_token", "return_progress", "post_sampling_probs", "response_fields")
FIELDS = {"completions": {**COMMON, "prompt": (str, list, dict), "logprobs": (int, bool),
                          # llama-server's: a prompt of token ids (strings among them), several prompts
                          # (_check_prompt), the ids in its answer, the code around a cursor
                          "prompt_ids": (list,), "prompts": (list,), "return_tokens": (bool,), "input_prefix": (str,),
                          "input_suffix": (str,), "input_extra": (list,)},
          "chat": {**COMMON, "messages": (list,), "logprobs": (bool,), "top_logprobs": (int,), "tools": (list,),
                   "tool_choice": (str, dict), "parallel_tool_calls": (bool,),
                   # llama-server's: what the chat template is given (lever.gguf.chat_template)
                   "add_generation_prompt": (bool,), "chat_template_kwargs": (dict,),
                   "continue_final_message": (bool, str)},
          # llama.cpp's own endpoints, by its field names
          "tokenize": {"content": (str,), "add_special": (bool,), "with_pieces": (bool,)},
          "detokenize": {"tokens": (list,)}}
# fields OpenAI's API has and Lever does not honour yet: refused unless absent or at their default
UNSUPPORTED = ("echo", "suffix", "best_of", "functions", "function_call")
DEFAULTS = (None, False, 0, [], {}, "none", "auto")


def parse_bytes(body: bytes) -> int:
    """What `json.loads(body)` may allocate at most, from the body's bytes before it is parsed:
    each value a few dozen bytes (an empty object in a list: 36, measured; PER_VALUE_BYTES
    leaves room) and each string's characters up to four bytes each, twice over while the
    parser builds it. Values are counted from the body's structure (strings, commas, colons,
    brackets), so 4 MiB of `{},` is known for the 100 MB it would take before it takes it."""
    rest, n_strings = _STRING.subn(b"", body)
    n_values = n_strings + rest.count(b",") + rest.count(b":") + rest.count(b"{") + rest.count(b"[") + 1
    wide = not body.isascii() or b"\\u" in body  # a string with one character past Latin-1 stores all at 4 bytes
    return PARSE_BASE_BYTES + (8 if wide else 2) * len(body) + PER_VALUE_BYTES * n_values


async def read_body(request: Request, *, hold, timeout_s: float, idle_s: float = IDLE_S,
                    max_bytes: int = MAX_BODY_BYTES, rate=None, closing: Callable[[], bool] = lambda: False) -> bytes:
    """The body, checked against its bound before it is read (Content-Length) and while it is
    read (a client that lies or chunks); its bytes held in the server's pool (`hold`,
    lever.serve.pool) as they arrive, twice (the chunks, then the body they join into): 413
    past the bound, 408 past the timeout or when no byte comes for `idle_s`, 503 when the pool
    or the client's share of it is full, or once `closing` says the server is shutting down
    (within CLOSING_POLL_S: a body still arriving is not admitted, and shutdown does not wait
    for it). With a `rate` (lever.serve.rate.BodyRate), each chunk is paid for at the client's
    rate before the next is read (408 when it cannot be in time)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest("Content-Length: not a number", status=400)
        if int(declared) > max_bytes:
            raise BadRequest(f"the request body is {declared} bytes, over the bound of {max_bytes}", status=413)
    chunks, n = [], 0
    deadline = anyio.current_time() + timeout_s
    if rate is not None:
        rate.check(hold.client, deadline)
    more = True
    while more:
        until = min(anyio.current_time() + idle_s, deadline)
        message = None
        while message is None:  # in slices, to see shutdown: the ASGI receive may be cancelled and called again
            if closing():
                raise shutting_down()
            with anyio.move_on_after(max(min(CLOSING_POLL_S, until - anyio.current_time()), 0)):
                message = await request.receive()
            if message is None and anyio.current_time() >= until:
                why = f"took over {timeout_s:g} s to arrive" if until >= deadline else f"stalled for {idle_s:g} s"
                raise BadRequest(f"the request body {why}", status=408, kind="request_timeout")
        if message["type"] == "http.disconnect":
            raise BadRequest("the client left before its body arrived", status=400)
        chunk, more = message.get("body", b""), message.get("more_body", False)
        n += len(chunk)
        if n > max_bytes:
            raise BadRequest(f"the request body is over the bound of {max_bytes} bytes", status=413)
        hold.add(2 * len(chunk))
        chunks.append(chunk)
        if rate is not None:
            due = rate.pay(hold.client, len(chunk), deadline)
            while (wait := due - anyio.current_time()) > 0:
                if closing():
                    raise shutting_down()
                await anyio.sleep(min(wait, CLOSING_POLL_S))
    return b"".join(chunks)


def parse(body: bytes, endpoint: str, translate: Callable[[dict], dict] | None = None) -> dict:
    """The request's fields this server reads, type-checked; BadRequest naming the first one at
    fault. Parse the body only once its `parse_bytes` are held. `translate`: a dialect's body
    as the endpoint's fields (lever.serve.dialect), before they are checked."""
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
    if translate is not None:
        data = translate(data)
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
    if data.get("n") is not None and data["n"] < 1:
        raise BadRequest(f"n: must be 1 or more, got {data['n']}", "n")
    if endpoint == "tokenize":
        if not isinstance(data.get("content"), str):
            raise BadRequest("content: required, a string", "content")
    elif endpoint == "detokenize":
        ids = data.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise BadRequest("tokens: required, a list of token ids", "tokens")
    elif endpoint == "completions":
        _check_prompt(data)
    elif "messages" not in data:
        raise BadRequest("messages: required, a list of {role, content}", "messages")
    elif data.get("top_logprobs") is not None and not data.get("logprobs"):
        raise BadRequest("top_logprobs: needs logprobs: true", "top_logprobs")
    elif data.get("top_logprobs") is not None and not 0 <= data["top_logprobs"] <= MAX_LOGPROBS:
        raise BadRequest(f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got {data['top_logprobs']}", "top_logprobs")
    if endpoint in ("completions", "chat"):
        data["json_schema"] = _schema(data)
        if data["json_schema"] is not None and data.get("grammar") is not None:
            raise BadRequest("grammar: give a grammar or a JSON schema (response_format), not both", "grammar")
    # only the fields read from here on: what a client sends beside them (OpenAI's clients send
    # more) is let go now, not kept while the request waits
    return {k: data[k] for k in FIELDS[endpoint] if k in data}


def _check_prompt(data: dict) -> None:
    """A completion's prompt, as llama-server takes it: a string, a list of token ids (strings
    among them are tokenized in place), an object {"prompt_string": ...}, or a list of several
    of these (one answer each). One prompt is left in `prompt` (text) or `prompt_ids`, several
    in `prompts` (each {"prompt": text} or {"prompt_ids": [...]})."""
    p = data.get("prompt")
    if p is None and data.get("prompt_ids") is not None:
        p = data["prompt_ids"]
    if isinstance(p, list) and p and not any(_is_id(x) for x in p):
        prompts = [_one_prompt(x, f"prompt[{i}]") for i, x in enumerate(p)]
        if len(prompts) > 1:
            data["prompt"], data["prompts"] = "", prompts
            data.pop("prompt_ids", None)
            return
        p = p[0]
    one = _one_prompt(p, "prompt")
    data.pop("prompt_ids", None)
    data.update(one if "prompt" in one else {**one, "prompt": ""})


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _one_prompt(p, where: str) -> dict:
    """One prompt as {"prompt": text} or {"prompt_ids": ids and strings}; BadRequest naming `where`."""
    if isinstance(p, dict):
        if p.get("multimodal_data"):
            raise BadRequest(f"{where}.multimodal_data: this server's model takes text only (no multimodal "
                             "projector)", f"{where}.multimodal_data")
        p = p.get("prompt_string")
        where += ".prompt_string"
    if isinstance(p, str):
        return {"prompt": p}
    if isinstance(p, list) and p and all(_is_id(x) or isinstance(x, str) for x in p):
        return {"prompt_ids": p}
    raise BadRequest(f"{where}: a string, a list of token ids (and strings), or {{\"prompt_string\": ...}}; "
                     f"got {json.dumps(p)[:40]}", where.split(".")[0].split("[")[0])


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
    out = {k: data[k] for k in (*(k.arg for k in KNOBS.values()), "logit_bias", "ignore_eos", "stop", "grammar",
                                "json_schema") if data.get(k) is not None}
    if data.get("max_completion_tokens") is not None:
        out[KNOBS["n_predict"].arg] = data["max_completion_tokens"]
    if endpoint == "chat":
        if data.get("logprobs"):
            out["logprobs"] = data.get("top_logprobs") or 0
    elif data.get("logprobs") is not None and data["logprobs"] is not False:
        out["logprobs"] = 0 if data["logprobs"] is True else data["logprobs"]  # true: the tokens' own, no alternatives
    return out


def generation_settings(gen: GenerateConfig, eos_ids: frozenset[int] = frozenset()) -> dict:
    """A call's knobs (or the server's defaults) as llama-server's generation_settings names them:
    each knob by its [generate] key, which is llama-server's name; the logit bias as its list of
    {bias, token}, ignore_eos's bans of the end tokens (`eos_ids`) among them, a ban's bias null
    (llama-server's JSON for -inf)."""
    bias = gen.params(frozenset(eos_ids)).logit_bias
    return {**{k: getattr(gen, k) for k in KNOBS}, "max_tokens": gen.n_predict, "ignore_eos": gen.ignore_eos,
            "logit_bias": [{"bias": None if b == NEVER else b, "token": t} for t, b in bias.pairs]}
