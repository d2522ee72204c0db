"""A tool call as OpenAI's API carries it, and one read out of a call's JSON object.

The bottom of lever.model.tools: every format (lever.model.tools.formats) finds the JSON of its
calls its own way, then hands each object here, which says whether it is a call of a function
offered, with arguments that are a JSON object, and gives it its id.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Collection

import attrs

from lever.gguf.chat_template import MAX_NESTING
from lever.nesting import depth, text_depth


@attrs.frozen
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


# a call's id, by the format's kind: OpenAI's shape, or the nine letters and digits Mistral's
# templates insist on when the call comes back in the conversation (they raise otherwise)
ID_SHAPES = {"openai": re.compile(r"[A-Za-z0-9_-]{1,64}"), "mistral": re.compile(r"[A-Za-z0-9]{9}")}


def new_id(kind: str) -> str:
    if kind == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + uuid.uuid4().hex[:24]


def call_of(obj, names: Collection[str] | None, *, args_keys: tuple[str, ...] = ("arguments", "parameters"),
            ids: str = "openai", taken: Collection[str] = (), name: str | None = None,
            given_id: str | None = None) -> ToolCall | None:
    """The call a JSON object is ({"name": ..., "arguments": {...}, "id"?: ...}; the arguments
    under the first of `args_keys` present, none: {}), or None when it is not one: no name, a
    function not in `names` (None: any), arguments that are not a JSON object (or a string
    holding one) or nest past MAX_NESTING. `name` and `given_id`: written outside the object
    (Mistral's `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`, the object being the arguments). The
    model's id is kept when it has the format's shape and is not `taken` by an earlier call."""
    if name is None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        name, given_id = obj["name"], obj.get("id")
        args = next((obj[k] for k in args_keys if k in obj), {})
    else:
        args = obj
    if names is not None and name not in names:
        return None
    if isinstance(args, str):  # arguments written as JSON text: valid JSON or no call
        try:
            args = json.loads(args) if text_depth(args) <= MAX_NESTING else None
        except ValueError:
            return None
    if not isinstance(args, dict) or depth(args) > MAX_NESTING:
        return None
    if not (isinstance(given_id, str) and ID_SHAPES[ids].fullmatch(given_id) and given_id not in taken):
        given_id = new_id(ids)
    return ToolCall(given_id, name, json.dumps(args, ensure_ascii=False))

