"""A request's tools, checked, and what its tool_choice means for one generation: the functions
the template shows, and the grammar a required call brings, in the model's format.

Above lever.model.tools.formats (whose rows say how a required call is constrained), below the
API (LLM.offer) and the server.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from lever.errors import LeverError
from lever.gguf.chat_template import MAX_NESTING
from lever.gguf.tokenizer import Tokenizer
from lever.model.grammar import Source
from lever.model.tools.formats import HERMES, ToolFormat
from lever.nesting import check_json

MAX_TOOLS = 128  # functions in one request (OpenAI's own bound)


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


def required(tok: Tokenizer, tools: Sequence[dict], name: str | None = None, parallel: bool = True,
             fmt: ToolFormat = HERMES) -> Source:
    """The grammar of a reply that is one or more calls in format `fmt` (exactly one unless
    `parallel`; of `name` alone, when given), each's arguments valid under its function's
    parameters schema: the call is valid by construction, inside speculation like any grammar."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise LeverError(f"tool_choice: no function named {name!r} in tools")
    return Source(fmt.constrain(tok, chosen, parallel), "tool_choice")


def plan(tok: Tokenizer, tools, tool_choice, parallel: bool = True, fmt: ToolFormat = HERMES
         ) -> tuple[list[dict] | None, Source | None]:
    """What a request's `tools` and `tool_choice` (OpenAI's) mean for one generation: the
    functions the template shows (none for "none") and the grammar that enforces a call in the
    model's format `fmt` ("required", or {"type": "function", "function": {"name": ...}}; None
    for "auto"). `parallel` false (OpenAI's `parallel_tool_calls`): a required call is exactly
    one; under "auto" it is not enforced, so it is refused there."""
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
        return tools, required(tok, tools, parallel=parallel, fmt=fmt)
    f = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(f, dict) \
            and isinstance(f.get("name"), str):
        return tools, required(tok, tools, f["name"], parallel, fmt)
    # a value that is not a string may nest deep or hold itself: named by its type, never dumped
    got = json.dumps(tool_choice)[:60] if isinstance(tool_choice, str) else type(tool_choice).__name__
    raise LeverError(f"tool_choice: must be none, auto, required or {{type: function, function: {{name}}}}, "
                     f"got {got}")
