"""Anthropic's Messages API over the one model: `POST /v1/messages` (streamed or not, with tools)
and `POST /v1/messages/count_tokens`; a dialect of lever.serve.dialect.

Beside OpenAI's chat (lever.serve.render), behind the same routes (lever.serve.server): a body is
translated into OpenAI chat's fields (`translate`: its system prompt a system message, its
content blocks text, `tool_use` blocks an assistant's tool_calls, `tool_result` blocks tool
messages, its tools functions), so preparation (lever.serve.prepare) checks, bounds and refuses
it as it does any chat, and the generation is the same whoever asked; the answer is Anthropic's
message, or its stream of named events (`MessagesReply`), and a refusal its error object. What
Lever does not honour (images, documents, server tools, extended thinking, a prefill of the
reply, a field Anthropic's API does not have) is refused by name, as Anthropic refuses unknown
fields.
"""

from __future__ import annotations

import json
import re

import attrs
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lever.api import Chunk, Completion, Usage
from lever.config import KNOBS
from lever.gguf.chat_template import MAX_NESTING
from lever.gguf.tokenizer import Tokenizer
from lever.model.stop import StopReason
from lever.model.tool_calls import ToolCall
from lever.nesting import check_json
from lever.pipelines.result import RunResult
from lever.serve.dialect import Dialect
from lever.serve.llama import input_tokens
from lever.serve.request import BadRequest

# Anthropic's stop_reason of each of Lever's (lever.model.stop); a reply that calls says tool_use
STOP_REASONS = {StopReason.EOS: "end_turn", StopReason.LENGTH: "max_tokens", StopReason.STOP: "stop_sequence",
                StopReason.CONTEXT: "model_context_window_exceeded", StopReason.CANCELLED: "end_turn"}
# Anthropic's error type of each refusal's kind (lever.serve.server, lever.serve.request); others: api_error
ERROR_TYPES = {"invalid_request_error": "invalid_request_error", "exceed_context_size_error": "invalid_request_error",
               "invalid_api_key": "authentication_error", "not_found": "not_found_error",
               "rate_limit_exceeded": "rate_limit_error", "server_shutting_down": "overloaded_error",
               "request_timeout": "timeout_error"}
# the body's fields: Anthropic's (metadata, service_tier and cache_control change nothing here: every
# conversation's prefix is kept), and Lever's own knobs (min_p, seed, ...) as llama-server takes its
# extras (Anthropic's client sends temperature, top_p and top_k in extra_body); any other is refused by
# name, as Anthropic refuses extra inputs
COUNTED = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                     "cache_control"})
FIELDS = COUNTED | {"stop_sequences", "stream", "metadata", "service_tier", *(k.arg for k in KNOBS.values())}
PASSED = ("model", "stream", *(k.arg for k in KNOBS.values()))  # taken as they are (max_tokens is a knob)
MEDIA = ("image", "document", "search_result", "container_upload")  # blocks a text-only model cannot read
CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # tool_choice.type -> OpenAI's (and "tool": named)
# the fields a LeverError's line names by OpenAI's names (lever.api, lever.model.tool_calls), by Anthropic's
RENAMES = ((re.compile(r"^stop\b"), "stop_sequences"),
           (re.compile(r"(tools\[\d+\])\.function\.parameters"), r"\1.input_schema"),
           (re.compile(r"(tools\[\d+\])\.function\.(name|description)"), r"\1.\2"),
           (re.compile(r"^json_schema\b"), "output_config.format.schema"))


def _refuse(where: str, why: str) -> BadRequest:
    return BadRequest(f"{where}: {why}", where)


def _shown(value) -> str:
    """A value a message quotes: a string, cut; anything else by its type (never dumped: it may nest deep)."""
    return json.dumps(value)[:40] if isinstance(value, str) else type(value).__name__


def translate(data: dict) -> dict:
    """A Messages request's body as OpenAI chat's fields (lever.serve.request.FIELDS)."""
    _known(data, FIELDS)
    if "max_tokens" not in data:  # Anthropic's API requires it: a reply's length is never left to a default
        raise _refuse("max_tokens", "required (the most tokens the reply may have)")
    out = {**_conversation(data), **{k: data[k] for k in PASSED if k in data}}
    schema = _schema(data.get("output_config"))
    if schema is not None:
        out["json_schema"] = schema
    stops = data.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _refuse("stop_sequences", "must be a list of strings")
        if stops:
            out["stop"] = stops
    return out


def counted(data: dict) -> dict:
    """A count_tokens body as OpenAI chat's fields: the prompt as a reply to it would see it (a
    named or required call changes the grammar, not the prompt: it is not compiled here)."""
    _known(data, COUNTED)
    _schema(data.get("output_config"))  # checked: a schema holds the reply, not the prompt
    out = {**_conversation(data), "max_tokens": 1}
    if out.pop("tool_choice", None) == "none":
        out.pop("tools", None)
    out.pop("parallel_tool_calls", None)
    return out


def _known(data: dict, fields: frozenset) -> None:
    unknown = next((k for k in data if k not in fields), None)
    if unknown is not None:
        raise _refuse(unknown[:40], "not a field of Anthropic's Messages API this server takes (extra inputs "
                                    "are not permitted)")
    thinking = data.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") != "disabled"):
        raise _refuse("thinking", "extended thinking is not supported by this server: omit it or give "
                                  "{type: disabled}")


def _schema(config) -> dict | None:
    """output_config's JSON schema (Anthropic's structured output), which the reply follows by
    grammar; an effort is not something this server can spend."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise _refuse("output_config", "must be an object {format}")
    extra = next((k for k in config if k != "format" and config[k] is not None), None)
    if extra is not None:
        raise _refuse(f"output_config.{extra[:40]}", "not supported by this server (output_config.format is)")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _refuse("output_config.format", "must be {type: json_schema, schema: {...}}")
    return fmt["schema"]


def _conversation(data: dict) -> dict:
    """The messages (the system prompt first) and the functions offered, as OpenAI's chat has them."""
    out = {"messages": [*_system(data.get("system")), *_messages(data.get("messages"))]}
    if data.get("tools"):
        out["tools"] = _tools(data["tools"])
    if data.get("tool_choice") is not None:
        out["tool_choice"], parallel = _tool_choice(data["tool_choice"])
        if not parallel:
            out["parallel_tool_calls"] = False
    return out


def _system(system) -> list[dict]:
    if system is None or system == "":
        return []
    if isinstance(system, list):
        system = "\n".join(_text(b, f"system[{j}]") for j, b in enumerate(system))
    if not isinstance(system, str):
        raise _refuse("system", "must be a string or a list of text blocks")
    return [{"role": "system", "content": system}]


def _text(block, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in MEDIA:
        raise _refuse(where, _unsupported(kind, ""))
    if kind != "text":
        raise _refuse(where, f"must be a text block {{type: text, text}}, got {_kind(block)}")
    if not isinstance(block.get("text"), str):
        raise _refuse(f"{where}.text", "must be a string")
    return block["text"]


def _kind(block) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    return f"a {kind[:40]} block" if isinstance(kind, str) else f"{_shown(block)}"


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list):
        raise _refuse("messages", "required, a list of {role, content}")
    if not messages:
        raise _refuse("messages", "at least one message is required")
    if isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        # Anthropic continues such a turn; Lever's replies always start a new one
        raise _refuse(f"messages[{len(messages) - 1}]", "an assistant turn last (a prefill the reply would "
                                                        "continue) is not supported: end with a user turn")
    return [m for i, turn in enumerate(messages) for m in _turn(i, turn)]


def _turn(i: int, m) -> list[dict]:
    """One of Anthropic's turns as OpenAI's messages: its tool results each a tool message (first:
    they answer the calls of the turn before), its text blocks one message joined by lines (as
    OpenAI's text parts are), its tool_use blocks that message's tool_calls, its thinking blocks
    its reasoning_content (as llama-server's; a template may show an earlier turn's thinking)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _refuse(where, "must be an object {role, content}")
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant"):
        raise _refuse(f"{where}.role", f"must be user or assistant (a system prompt is the system field), "
                                       f"got {_shown(role)}")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _refuse(f"{where}.content", "must be a string or a list of content blocks")
    texts, calls, results, thoughts = [], [], [], []
    for j, block in enumerate(content):
        at, kind = f"{where}.content[{j}]", block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_call(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_result(block, at))
        elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
            thoughts.append(block["thinking"])  # the turn's reasoning_content, for templates that show it
        elif kind not in ("thinking", "redacted_thinking") or role != "assistant":
            raise _refuse(at, _unsupported(kind, role))
    if texts or calls or thoughts or not results:
        message = {"role": role, "content": "\n".join(texts)}
        results.append(message | ({"tool_calls": calls} if calls else {})
                       | ({"reasoning_content": "".join(thoughts)} if thoughts else {}))
    return results


def _unsupported(kind, role: str) -> str:
    if kind in ("tool_use", "tool_result"):
        return f"{kind} blocks belong in {'assistant' if kind == 'tool_use' else 'user'} turns, not {role} ones"
    if kind in MEDIA:
        return f"{kind} blocks are not supported: this server's model reads text only"
    return f"{_kind({'type': kind}) if isinstance(kind, str) else 'an untyped block'} is not supported here " \
           f"(text, tool_use, tool_result)"


def _call(block: dict, where: str) -> dict:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise _refuse(where, "a tool_use block needs an id and a name (strings)")
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise _refuse(f"{where}.input", "must be an object")
    check_json(args, f"{where}.input", max_depth=MAX_NESTING)  # the template writes it whole
    # OpenAI's shape, its arguments an object (as templates read them: lever.gguf.chat_template)
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": args}}


def _result(block: dict, where: str) -> dict:
    if not isinstance(block.get("tool_use_id"), str):
        raise _refuse(f"{where}.tool_use_id", "required, the id of the tool_use block it answers")
    content = block.get("content", "")
    if isinstance(content, list):  # its text blocks joined by lines
        content = "\n".join(_text(b, f"{where}.content[{k}]") for k, b in enumerate(content))
    if not isinstance(content, str):
        raise _refuse(f"{where}.content", "must be a string or a list of text blocks")
    if block.get("is_error") not in (None, False, True):
        raise _refuse(f"{where}.is_error", "must be a boolean")
    if block.get("is_error"):  # templates have no place for the flag: the model reads it in the text
        content = "Error: " + content
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _tools(tools) -> list[dict]:
    """Anthropic's client tools as OpenAI's functions (checked by name and schema in
    lever.model.tool_calls.check_tools; its lines renamed by `error_body`)."""
    if not isinstance(tools, list):
        raise _refuse("tools", "must be a list of {name, description, input_schema}")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise _refuse(f"tools[{i}]", "must be an object {name, description, input_schema}")
        if t.get("type") not in (None, "custom"):
            raise _refuse(f"tools[{i}].type", f"{_shown(t['type'])} is a tool Anthropic's servers run; this server "
                                              "offers client tools only ({name, description, input_schema})")
        if "input_schema" not in t:
            raise _refuse(f"tools[{i}].input_schema", "required, the JSON Schema of the tool's input")
        # in OpenAI's order (name, description, parameters): a template that prints the tools as JSON
        # (Qwen's) must give the prompt OpenAI's route gives for the same tool
        f = {"name": t.get("name")} | ({"description": t["description"]} if "description" in t else {})
        out.append({"type": "function", "function": f | {"parameters": t["input_schema"]}})
    return out


def _tool_choice(choice) -> tuple[str | dict, bool]:
    """OpenAI's tool_choice for Anthropic's, and whether several calls may come."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _refuse("tool_choice.name", "required with type tool, a string")
        out = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in CHOICES:
        out = CHOICES[kind]
    else:
        raise _refuse("tool_choice", f"must be {{type: auto, any, tool or none}}, got {_shown(kind)}")
    one = choice.get("disable_parallel_tool_use", False)
    if not isinstance(one, bool):
        raise _refuse("tool_choice.disable_parallel_tool_use", "must be a boolean")
    if one and kind not in ("any", "tool"):  # only a required call's grammar can enforce it
        raise _refuse("tool_choice.disable_parallel_tool_use", "enforced only with tool_choice any or tool")
    return out, not one


def error_body(message: str, kind: str, param: str | None = None) -> dict:
    """Anthropic's error object; a line naming a field by OpenAI's name names it by Anthropic's."""
    for pattern, name in RENAMES:
        message = pattern.sub(name, message, count=1)
    return {"type": "error", "error": {"type": ERROR_TYPES.get(kind, "api_error"), "message": message}}


def _event(kind: str, **fields) -> str:
    """One of a stream's events: its name on the `event:` line (Anthropic's clients read it), and in its data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


def _usage(u: Usage) -> dict:
    """Anthropic's counts: input_tokens are those prefilled, the ones a kept conversation held already are
    cache_read_input_tokens (together the prompt)."""
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "cache_read_input_tokens": u.cached_tokens,
            "output_tokens": u.completion_tokens}


def _input(call: ToolCall) -> dict:
    """A call's arguments as a tool_use block's input, which must be an object: a model that
    wrote another value (no grammar held it, under auto) has it whole under "arguments"."""
    try:
        args = json.loads(call.arguments)
    except ValueError:
        args = call.arguments
    return args if isinstance(args, dict) else {"arguments": args}


def stop_sequence(tok: Tokenizer, stats: RunResult | None, n_kept: int, stops: tuple[str, ...] = ()) -> str | None:
    """The stop sequence that ended a reply: of the call's `stops`, the one its kept tokens' text
    goes on with past the reply's text (the first to complete there: the shortest)."""
    if stats is None:
        return None
    eos = frozenset(tok.eos_ids)
    whole = b"".join(tok.token_bytes(t) for t in stats.output.tokens[:n_kept] if t not in eos)
    whole = whole.decode("utf-8", "replace")
    if not whole.startswith(stats.text):
        return None
    tail = whole[len(stats.text):]
    return min((x for x in stops if tail.startswith(x)), key=len, default=tail or None)


@attrs.define
class MessagesReply:
    """One request's answer as Anthropic's message, or its stream of events (lever.render.Reply's
    methods). Mutable: a stream's next event depends on the blocks it has opened."""

    rid: str  # "msg_..."
    chat: bool
    model_id: str
    tok: Tokenizer
    n_prompt: int = 0  # the prompt's tokens (bind): message_start's input_tokens
    stops: tuple[str, ...] = ()  # the call's stop sequences (bind): which one ended the reply
    n_blocks: int = attrs.field(default=0, init=False)  # content blocks a stream has opened
    text_open: bool = attrs.field(default=False, init=False)  # the last of them is a text block not yet stopped
    media_type = "text/event-stream"

    def bind(self, *, call, shape) -> MessagesReply:
        """The reply told its call: the prompt's length and the stop sequences."""
        return attrs.evolve(self, n_prompt=len(call.ids), stops=tuple(call.stop))

    def body(self, c: Completion) -> dict:
        reason, sequence = self.stop(c.finish_reason, c.tool_calls, c.stats, len(c.tokens))
        content = [{"type": "text", "text": c.text}] if c.text or not c.tool_calls else []
        content += [{"type": "tool_use", "id": tc.id, "name": tc.name, "input": _input(tc)} for tc in c.tool_calls]
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model_id, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(c.usage)}

    def stop(self, finish: StopReason, calls, stats: RunResult | None, n_kept: int) -> tuple[str, str | None]:
        if calls and finish is not StopReason.LENGTH:  # a reply cut by its limit says so
            return "tool_use", None
        if finish is StopReason.STOP:
            return "stop_sequence", stop_sequence(self.tok, stats, n_kept, self.stops)
        return STOP_REASONS[finish], None

    def opening(self) -> list[str]:
        """message_start: the message without content, the prompt's tokens counted (those a kept
        conversation held are told apart at the end, in message_delta)."""
        message = {"id": self.rid, "type": "message", "role": "assistant", "model": self.model_id, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.n_prompt, "output_tokens": 0}}
        return [_event("message_start", message=message), _event("ping")]

    def piece(self, chunk: Chunk, n_chars: int, logprobs: bool) -> list[str]:
        """A chunk's text as a text_delta, its block opened first."""
        if not chunk.text:
            return []
        out = [] if self.text_open else [self.start({"type": "text", "text": ""})]
        self.text_open = True
        return [*out, _event("content_block_delta", index=self.n_blocks - 1,
                             delta={"type": "text_delta", "text": chunk.text})]

    def start(self, block: dict) -> str:
        self.n_blocks += 1
        return _event("content_block_start", index=self.n_blocks - 1, content_block=block)

    def closing(self, chunk: Chunk) -> list[str]:
        """The open text block stopped, each call a tool_use block (its input as one
        input_json_delta), then message_delta: why it ended and the counts."""
        out = [_event("content_block_stop", index=self.n_blocks - 1)] if self.text_open else []
        self.text_open = False
        if not self.n_blocks and not chunk.tool_calls:  # no text: one empty text block, as the whole message has
            out += [self.start({"type": "text", "text": ""}), _event("content_block_stop", index=0)]
        for tc in chunk.tool_calls:
            out.append(self.start({"type": "tool_use", "id": tc.id, "name": tc.name, "input": {}}))
            delta = {"type": "input_json_delta", "partial_json": json.dumps(_input(tc), ensure_ascii=False)}
            out += [_event("content_block_delta", index=self.n_blocks - 1, delta=delta),
                    _event("content_block_stop", index=self.n_blocks - 1)]
        n_kept = chunk.usage.completion_tokens if chunk.usage is not None else 0
        reason, sequence = self.stop(chunk.finish_reason, chunk.tool_calls, chunk.stats, n_kept)
        usage = _usage(chunk.usage) if chunk.usage is not None else {"output_tokens": n_kept}
        return [*out, _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage)]

    def trailer(self, usage_asked: bool, n_prompt: int, n_out: int) -> list[str]:
        return [_event("message_stop")]

    @staticmethod
    def failed(message: str, kind: str, param: str | None = None) -> str:
        """A stream that fails mid-way ends with an error event, as Anthropic's do; no message_stop."""
        return f"event: error\ndata: {json.dumps(error_body(message, kind, param), ensure_ascii=False)}\n\n"

    error_body = staticmethod(error_body)


MESSAGES = Dialect("messages", "chat", MessagesReply, "msg_", translate=translate, error_body=error_body)
COUNT = Dialect("count_tokens", "chat", MessagesReply, "msg_", translate=counted, error_body=error_body)
GENERATIONS = {"/v1/messages": MESSAGES}  # route -> Dialect


def routes(server) -> list:
    """The routes that are not generations: count_tokens, the prompt's tokens as a reply would
    see them (read, rendered and tokenized as a generation's, within the same bounds; never queued)."""

    async def count_tokens(request: Request) -> Response:
        return await input_tokens(server, request, COUNT, body=lambda n: {"input_tokens": n})

    return [Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]
