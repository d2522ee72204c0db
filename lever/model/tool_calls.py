"""Tool calls in a model's reply: found in the text, and enforced by a grammar when they must come.

Beside lever.model.grammar, below the API and the server. Lever knows the format Qwen2.5's and
Hermes 2/3's chat templates teach their models (the templates' own instructions say it):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, after any text. `parse_calls` splits a reply into its text and its calls (OpenAI's
shape: an id, the function's name, its arguments as a JSON string); `required` builds the grammar
that makes the reply one or more calls of the given functions (OpenAI's tool_choice "required", or
a named function), their arguments following each function's JSON Schema, so the call is valid by
construction, inside speculation like any grammar.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Sequence

import attrs

from lever.errors import LeverError
from lever.gguf.chat_template import MAX_NESTING
from lever.gguf.tokenizer import Tokenizer
from lever.model.grammar import Source
from lever.nesting import check_json, text_depth

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
MAX_TOOLS = 128  # functions in one request (OpenAI's own bound)
# a call's JSON as the templates show it (`{"name": ..., "arguments": {...}}`): one form, no runs of blank
CALL_JSON = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@attrs.frozen
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def check_tools(tools) -> list[dict]:
    """OpenAI's `tools`, checked: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}}; one line naming the entry at fault."""
    if not isinstance(tools, list) or not tools:
        raise LeverError("tools: must be a non-empty list of {type: function, function: {...}}")
    if len(tools) > MAX_TOOLS:
        raise LeverError(f"tools: at most {MAX_TOOLS} functions, got {len(tools)}")
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise LeverError(f"tools[{i}]: must be {{type: function, function: {{name, parameters}}}}")
        if not isinstance(f.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", f["name"]):
            raise LeverError(f"tools[{i}].function.name: 1-64 letters, digits, _ . or -, got {f.get('name')!r:.40}")
        params = f.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise LeverError(f"tools[{i}].function.parameters: must be a JSON Schema object")
        # JSON (string keys, finite numbers, no cycle) within the nesting templates and the
        # grammar take, before a template, json.dumps or a compiler recurses into it
        check_json(params, f"tools[{i}].function.parameters", max_depth=MAX_NESTING)
        check_json(t, f"tools[{i}]", max_depth=MAX_NESTING + 2)  # the rest of the entry: the template writes it all
        if "description" in f and not isinstance(f["description"], str):
            raise LeverError(f"tools[{i}].function.description: must be a string")
        out.append({"type": "function", "function": {**f, "parameters": params}})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise LeverError("tools: two functions share a name")
    return out


def parse_calls(text: str, names: Collection[str] | None = None) -> tuple[str, list[ToolCall]]:
    """The reply's text outside its tool-call blocks (stripped), and its calls. A block whose
    JSON is not {"name": str, "arguments": ...}, or names a function not in `names` (the ones
    offered; None: any), stays text: the model did not call. A call begun and never closed (a
    reply cut by its token limit) is neither: no call, and its markup is not text either."""
    calls, kept, at = [], [], 0
    for m in BLOCK.finditer(text):
        obj = _json(m.group(1))
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or \
                (names is not None and obj["name"] not in names):
            continue
        args = obj.get("arguments", {})
        kept.append(text[at : m.start()])
        at = m.end()
        calls.append(ToolCall("call_" + uuid.uuid4().hex[:24], obj["name"],
                              args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    rest = text[at:]
    cut = rest.find(OPEN)
    kept.append(rest if cut < 0 or CLOSE in rest[cut:] else rest[:cut])
    return "".join(kept).strip(), calls


def _json(text: str):
    """The JSON value of `text`; None when it is not JSON or nests past MAX_NESTING."""
    if text_depth(text) > MAX_NESTING:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def required(tok: Tokenizer, tools: Sequence[dict], name: str | None = None, parallel: bool = True) -> Source:
    """The grammar of a reply that is one or more calls (exactly one unless `parallel`; of `name`
    alone, when given), each's
    arguments valid under its function's parameters schema. The markers are the tokenizer's own
    special tokens where it has them (as the model writes them), else their text."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise LeverError(f"tool_choice: no function named {name!r} in tools")
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                         "required": ["name", "arguments"], "additionalProperties": False} for f in chosen],
              "x-guidance": CALL_JSON}

    def marker(text: str) -> str:
        i = tok.specials.get(text)
        return f"<[{i}]>" if i is not None else json.dumps(text)

    more = "(\"\\n\" call)* " if parallel else ""
    lark = (f"start: call {more}\"\\n\"?\n"  # a newline may end it, as the models write
            f"call: {marker(OPEN)} \"\\n\" body \"\\n\" {marker(CLOSE)}\n"
            f"body: %json {json.dumps(schema)}\n")
    return Source(lark, "tool_choice")


def plan(tok: Tokenizer, tools, tool_choice, parallel: bool = True) -> tuple[list[dict] | None, Source | None]:
    """What a request's `tools` and `tool_choice` (OpenAI's) mean for one generation: the
    functions the template shows (none for "none") and the grammar that enforces a call
    ("required", or {"type": "function", "function": {"name": ...}}; None for "auto").
    `parallel` false (OpenAI's `parallel_tool_calls`): a required call is exactly one; under
    "auto" it is not enforced, so it is refused there."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise LeverError("tool_choice: needs tools")
        return None, None
    tools = check_tools(tools)
    if tool_choice in (None, "auto"):
        if not parallel:
            raise LeverError("parallel_tool_calls: false is enforced only with tool_choice required or a named "
                             "function")
        return tools, None
    if tool_choice == "none":
        return None, None
    if tool_choice == "required":
        return tools, required(tok, tools, parallel=parallel)
    f = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(f, dict) \
            and isinstance(f.get("name"), str):
        return tools, required(tok, tools, f["name"], parallel)
    # a value that is not a string may nest deep or hold itself: named by its type, never dumped
    got = json.dumps(tool_choice)[:60] if isinstance(tool_choice, str) else type(tool_choice).__name__
    raise LeverError(f"tool_choice: must be none, auto, required or {{type: function, function: {{name}}}}, "
                     f"got {got}")


@attrs.define
class CallStream:
    """A streamed reply with tools: its text is sent as it comes until a call may begin (the
    start marker, or a tail that could grow into it), held from there, and parsed at the end:
    text before the calls streams, the calls come whole (as OpenAI's deltas may)."""

    names: Collection[str] | None = None  # the functions offered (None: any)
    held: str = ""
    in_call: bool = False

    def push(self, text: str) -> str:
        """Of the text so far, what can be sent now."""
        self.held += text
        if self.in_call:
            return ""
        i = self.held.find(OPEN)
        if i >= 0:
            self.in_call = True
            out, self.held = self.held[:i], self.held[i:]
            return out
        keep = next((n for n in range(min(len(OPEN) - 1, len(self.held)), 0, -1) if OPEN.startswith(self.held[-n:])),
                    0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The held text not sent and the calls (parse_calls: of `names`)."""
        if not self.in_call:
            return self.held, []
        return parse_calls(self.held, self.names)
