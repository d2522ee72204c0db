"""OpenAI's Responses API on `lever serve`: /v1/responses and /responses (streamed as its named
events, or whole), and /v1/responses/input_tokens; as llama-server serves it, a chat completion.

A dialect of lever.serve.dialect, as Anthropic's (lever.serve.anthropic): its body translated
into OpenAI chat's fields, as llama-server converts it (`instructions` a system message, `input`
a text or a list of items: messages with input_text parts, an assistant's earlier output_text,
its function calls and their outputs; `max_output_tokens`, function `tools`, `tool_choice`,
`text.format` as response_format); what Lever cannot honour refused by name (images and files:
the model reads text; previous_response_id: nothing is stored). Its answer is a `response`
object (a message item, a function_call item per call, the usage), or a stream of
response.created, response.in_progress, output_item / content_part added, output_text deltas,
their done events and response.completed, each with its sequence_number.
"""

from __future__ import annotations

import json
import time

import attrs
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lever.api import Chunk, Completion
from lever.gguf.tokenizer import Tokenizer
from lever.serve.dialect import Dialect
from lever.serve.render import timings
from lever.serve.request import BadRequest

TEXT_PARTS = ("input_text", "output_text", "text")  # a part whose text a message carries
# the Responses fields OpenAI chat's have by other names
RENAMED = {"max_output_tokens": "max_tokens"}


def _refuse(where: str, what: str) -> BadRequest:
    return BadRequest(f"{where}: {what}", where)


def translate(data: dict) -> dict:
    """A Responses body as OpenAI chat's fields (llama-server's conversion)."""
    if data.get("previous_response_id"):
        raise _refuse("previous_response_id", "this server keeps no responses; send the conversation as input")
    if "input" not in data:
        raise _refuse("input", "required: a text or a list of items")
    out = {k: v for k, v in data.items() if k not in ("input", "instructions", "tools", "text", "tool_choice",
                                                        "reasoning", *RENAMED)}
    out.update({ours: data[theirs] for theirs, ours in RENAMED.items() if theirs in data})
    messages = [{"role": "system", "content": data["instructions"]}] if data.get("instructions") else []
    if isinstance(data["input"], str):
        messages.append({"role": "user", "content": data["input"]})
    elif isinstance(data["input"], list):
        for i, item in enumerate(data["input"]):
            _item(messages, item, f"input[{i}]")
    else:
        raise _refuse("input", "must be a text or a list of items")
    out["messages"] = messages
    if data.get("tools") is not None:
        out["tools"] = _tools(data["tools"])
    if data.get("tool_choice") is not None:
        out["tool_choice"] = _choice(data["tool_choice"])
    fmt = (data.get("text") or {}).get("format") if isinstance(data.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                                         "schema": fmt.get("schema")}}
    elif isinstance(fmt, dict) and fmt.get("type") in ("json_object", "text"):
        out["response_format"] = {"type": fmt["type"]}
    return out


def _item(messages: list[dict], item, where: str) -> None:
    """One input item as chat messages: a message, an assistant's earlier output (joined to the
    assistant's message before it), a function call or its output."""
    if not isinstance(item, dict):
        raise _refuse(where, "must be an object")
    kind, role = item.get("type"), item.get("role")
    last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if role in ("user", "system", "developer", "assistant") and kind in (None, "message"):
        text = _text(item.get("content"), f"{where}.content")
        if role == "assistant" and last is not None:
            last["content"] = (last.get("content") or "") + text
        else:
            messages.append({"role": "system" if role == "developer" else role, "content": text})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
        if last is not None:
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": _text(item.get("output"), f"{where}.output")})
    elif kind == "reasoning":
        return  # an earlier turn's reasoning: not shown to the template again
    else:
        raise _refuse(where, f"an item of type {json.dumps(kind)[:40]} and role {json.dumps(role)[:40]} is not "
                             "one this server reads (message, function_call, function_call_output)")


def _text(content, where: str) -> str:
    """A message's content as its text: a string, or text parts joined by lines (as OpenAI
    chat's parts are); an image or a file refused, the model reads text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(where, "must be a text or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _refuse(f"{where}[{j}]", f"a part of type {json.dumps(kind)[:40]}: this server's model reads "
                                           "text only (input_text, output_text)")
        texts.append(part["text"])
    return "\n".join(texts)


def _tools(tools) -> list[dict]:
    """Function tools as OpenAI chat's; others (web search, files...) refused by name."""
    if not isinstance(tools, list):
        raise _refuse("tools", "must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _refuse(f"tools[{i}].type", "only function tools are served")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out


def _choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


@attrs.define
class ResponsesReply:
    """One request's answer as a Responses `response`, or its stream of events (lever.render.Reply's
    methods). Mutable: a stream's next event depends on the items it has opened."""

    rid: str  # "resp_..."
    chat: bool
    model_id: str
    tok: Tokenizer
    n_prompt: int = 0
    timings: bool = False  # timings_per_token: llama-server's timings on the deltas
    seq: int = attrs.field(default=0, init=False)  # the stream's next sequence_number
    text: list = attrs.field(factory=list, init=False)  # the text streamed so far
    media_type = "text/event-stream"

    def bind(self, *, call, shape) -> ResponsesReply:
        return attrs.evolve(self, n_prompt=len(call.ids), timings=bool(shape.options.get("timings_per_token")))

    @property
    def message_id(self) -> str:
        return "msg_" + self.rid.removeprefix("resp_")

    def response(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        now = int(time.time())
        out = {"id": self.rid, "object": "response", "created_at": now, "status": status, "model": self.model_id,
               "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
        if status == "completed":
            out["completed_at"] = now
        return out | ({"usage": usage} if usage is not None else {})

    def output(self, text: str, calls) -> list[dict]:
        items = [self.message(text)] if text or not calls else []
        return items + [{"id": "fc_" + tc.id, "type": "function_call", "status": "completed", "name": tc.name,
                         "arguments": tc.arguments, "call_id": tc.id} for tc in calls]

    def message(self, text: str) -> dict:
        return {"id": self.message_id, "type": "message", "status": "completed", "role": "assistant",
                "content": [self.part(text)]}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def body(self, c: Completion) -> dict:
        return self.response("completed", self.output(c.text, c.tool_calls), _usage(c.usage))

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        data = {"type": kind, "sequence_number": self.seq - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def opening(self) -> list[str]:
        return [self.event("response.created", response=self.response("in_progress", [])),
                self.event("response.in_progress", response=self.response("in_progress", []))]

    def progress(self, fields: dict) -> list[str]:
        """llama-server's prompt_progress report (lever.serve.progress) on a response.in_progress."""
        return [self.event("response.in_progress", response=self.response("in_progress", []), **fields)]

    def piece(self, chunk: Chunk, n_chars: int, logprobs: bool) -> list[str]:
        """A chunk's text as an output_text delta, its message item and part opened first."""
        if not chunk.text:
            return []
        out = [] if self.text else [
            self.event("response.output_item.added", output_index=0, item={
                "id": self.message_id, "type": "message", "status": "in_progress", "role": "assistant",
                "content": []}),
            self.event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                       part=self.part(""))]
        self.text.append(chunk.text)
        return [*out, self.event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                 content_index=0, delta=chunk.text, logprobs=[])]

    def closing(self, chunk: Chunk) -> list[str]:
        """The text's done events, each call's item, then response.completed with the counts
        (and llama-server's timings)."""
        text, out = "".join(self.text), []
        if text:
            out += [self.event("response.output_text.done", item_id=self.message_id, output_index=0,
                               content_index=0, text=text, logprobs=[]),
                    self.event("response.content_part.done", item_id=self.message_id, output_index=0,
                               content_index=0, part=self.part(text)),
                    self.event("response.output_item.done", output_index=0, item=self.message(text))]
        output = self.output(text, chunk.tool_calls)
        for i, item in enumerate(output[1 if text else 0:], start=1 if text else 0):
            out.append(self.event("response.output_item.done", output_index=i, item=item))
        usage = _usage(chunk.usage) if chunk.usage is not None else None
        extra = {"timings": timings(chunk.stats, usage["input_tokens_details"]["cached_tokens"] if usage else 0)} \
            if chunk.stats is not None else {}
        return [*out, self.event("response.completed", response=self.response("completed", output, usage), **extra)]

    @staticmethod
    def trailer(usage_asked: bool, n_prompt: int, n_out: int) -> list[str]:
        return []  # response.completed ends it

    def failed(self, message: str, kind: str, param: str | None = None) -> str:
        """A stream that fails mid-way ends with an error event, as OpenAI's do."""
        return self.event("error", code=kind, message=message, param=param)


def _usage(u) -> dict:
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens, "total_tokens": u.total_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}


RESPONSES = Dialect("responses", "chat", ResponsesReply, "resp_", translate=translate)
GENERATIONS = {"/v1/responses": RESPONSES, "/responses": RESPONSES}


def routes(server) -> list:
    """/v1/responses/input_tokens: how many tokens the response's prompt is (lever.serve.llama)."""
    from lever.serve import llama

    async def input_tokens(request: Request) -> Response:
        return await llama.input_tokens(server, request, RESPONSES)

    return [Route(path, input_tokens, methods=["POST"]) for path in ("/v1/responses/input_tokens",
                                                                       "/responses/input_tokens")]
