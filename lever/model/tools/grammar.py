"""The grammar of a required tool call, in each format's own shape (llguidance's Lark, the
arguments by %json under each function's parameters schema).

Beside lever.model.tools.formats, whose table names one of these per format; lever.model.tools.plan
calls it with the functions a request lets the reply call. The markers are the tokenizer's own
special tokens where it has them (as the model writes them), else their text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from lever.gguf.tokenizer import Tokenizer

# a call's JSON as the templates show it (`{"name": ..., "arguments": {...}}`): one form, no runs of blank
CALL_JSON = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
MISTRAL_ID = "[a-zA-Z0-9]{9}"  # what Mistral's templates check a call's id against

# (tokenizer, the functions that may be called, several calls allowed) -> Lark text
Build = Callable[[Tokenizer, Sequence[dict], bool], str]


def marker(tok: Tokenizer, text: str) -> str:
    i = tok.specials.get(text)
    return f"<[{i}]>" if i is not None else json.dumps(text)


def call_schema(chosen: Sequence[dict], args_key: str = "arguments", ids: bool = False) -> dict:
    """One call object of any of `chosen`: {"name": its name, args_key: its arguments (, "id")}."""
    def one(f: dict) -> dict:
        props = {"name": {"const": f["name"]}, args_key: f["parameters"]}
        if ids:
            props["id"] = {"type": "string", "pattern": f"^{MISTRAL_ID}$"}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    return {"anyOf": [one(f) for f in chosen]}


def listed(schema: dict, parallel: bool) -> dict:
    """A JSON array of calls: at least one, exactly one unless `parallel`."""
    return {"type": "array", "items": schema, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def tagged(open_: str, close: str) -> Build:
    """Each call's object between two markers, a line each (Hermes, Qwen)."""
    def build(tok: Tokenizer, chosen: Sequence[dict], parallel: bool) -> str:
        more = '("\\n" call)* ' if parallel else ""
        return (f'start: call {more}"\\n"?\n'  # a newline may end it, as the models write
                f'call: {marker(tok, open_)} "\\n" body "\\n" {marker(tok, close)}\n'
                f"body: %json {json.dumps({**call_schema(chosen), 'x-guidance': CALL_JSON})}\n")
    return build


def bare(args_key: str) -> Build:
    """The reply is one call's object (Llama 3.x: `{"name": ..., "parameters": {...}}`). One call
    even when several are allowed: Llama's templates take one call per message (they raise on
    more), so the model never learnt a way to write a second."""
    def build(tok: Tokenizer, chosen: Sequence[dict], parallel: bool) -> str:
        return f"start: %json {json.dumps({**call_schema(chosen, args_key), 'x-guidance': CALL_JSON})}\n"
    return build


def prefixed_list(prefix: str, ids: bool) -> Build:
    """A marker, then the calls as one JSON array (Mistral Nemo's `[TOOL_CALLS][...]`, with ids;
    FireFunction's `functools[...]`)."""
    def build(tok: Tokenizer, chosen: Sequence[dict], parallel: bool) -> str:
        schema = {**listed(call_schema(chosen, ids=ids), parallel), "x-guidance": CALL_JSON}
        return f"start: {marker(tok, prefix)} body\nbody: %json {json.dumps(schema)}\n"
    return build


def named(ids: bool) -> Build:
    """Each call `[TOOL_CALLS]name[ARGS]{...}` (Mistral's newer templates; `[CALL_ID]id` before
    `[ARGS]` where the template writes ids)."""
    def build(tok: Tokenizer, chosen: Sequence[dict], parallel: bool) -> str:
        call_id = f'{marker(tok, "[CALL_ID]")} /{MISTRAL_ID}/ ' if ids else ""
        rules = [f"start: {'call+' if parallel else 'call'}",
                 f"call: {marker(tok, '[TOOL_CALLS]')} ({' | '.join(f'f{i}' for i in range(len(chosen)))})"]
        for i, f in enumerate(chosen):
            rules.append(f"f{i}: {json.dumps(f['name'])} {call_id}{marker(tok, '[ARGS]')} a{i}")
            rules.append(f"a{i}: %json {json.dumps({**f['parameters'], 'x-guidance': CALL_JSON})}")
        return "\n".join(rules) + "\n"
    return build


def fenced(tok: Tokenizer, chosen: Sequence[dict], parallel: bool) -> str:
    """Each call's object in a ```json fence, a line between them."""
    more = '("\\n" call)* ' if parallel else ""
    return (f"start: call {more}\n"
            f'call: "```json\\n" body "\\n```"\n'
            f"body: %json {json.dumps({**call_schema(chosen), 'x-guidance': CALL_JSON})}\n")


def wrapped(tok: Tokenizer, chosen: Sequence[dict], parallel: bool) -> str:
    """The reply is {"tool_calls": [...]} (llama.cpp's generic format, for a template that
    knows no tools)."""
    schema = {"type": "object", "properties": {"tool_calls": listed(call_schema(chosen), parallel)},
              "required": ["tool_calls"], "additionalProperties": False, "x-guidance": CALL_JSON}
    return f"start: %json {json.dumps(schema)}\n"
