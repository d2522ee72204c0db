"""The tool-call formats Lever reads, one table: how each is known from a chat template's text,
where its calls begin, how their JSON is read, how a required call is constrained, how the
model writes calls (what the template shows it).

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>      Hermes 2/3, Qwen 2.5/3
    llama3       {"name": "f", "parameters": {...}}  (the reply; or after <|python_tag|>)  Llama 3.1-3.3
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "a1b2c3d4e"}]  Mistral Nemo
    mistral-args [TOOL_CALLS]f[ARGS]{...}  ([CALL_ID]id before [ARGS] where the template has it)
                 Mistral Small 3.2, Devstral, Ministral 3
    firefunction functools[{"name": "f", "arguments": {...}}]                    FireFunction v2
    json         ```json\\n{"name": "f", "arguments": {...}}\\n```, or that object as the reply:
                 a template that offers tools in a way none of the above is
    generic      {"tool_calls": [{"name": "f", "arguments": {...}}]} or {"response": "..."}
                 as the reply: llama.cpp's generic format, a template that knows no tools

Detected as llama.cpp's chat parser does, by what the template's text holds (`detect`, once per
text). Calls are read by lever.model.tools.stream with each row's patterns; required calls are
built by lever.model.tools.grammar. Templates whose calls are XML (Qwen3-Coder's <function=...>,
GLM's <arg_key>, MiniMax's <invoke>) or of another markup (functionary, DeepSeek, Kimi, GPT-OSS)
get the `json` row: their own markup is not read.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Collection, Sequence

import attrs

from lever.model.tools import grammar
from lever.model.tools.calls import ToolCall, call_of
from lever.model.tools.lexing import ID, JSON, NAME, WS, Pattern

Names = Collection[str] | None
# (the call's JSON value, the head's match, the functions offered, ids taken) -> the calls, a
# reply's text (generic's response), or None: not a call
Read = Callable[..., "list[ToolCall] | str | None"]

OBJECT = Pattern([WS, JSON, "{", WS, '"name"', WS, ":", WS, '"', NAME, '"'])
LIST = Pattern([WS, JSON, "[", WS, "{", WS, '"name"', WS, ":", WS, '"', NAME, '"'])
MISTRAL_HEADS = (Pattern([NAME, "[ARGS]", WS, JSON, "{"]), Pattern([NAME, "[CALL_ID]", ID, "[ARGS]", WS, JSON, "{"]))
GENERIC_HEADS = (Pattern([JSON, "{", WS, '"tool_calls"', WS, ":", WS, "[", WS, "{", WS, '"name"', WS, ":", WS, '"',
                         NAME, '"']),
                 Pattern([JSON, "{", WS, '"tool_call"', WS, ":", WS, "{", WS, '"name"', WS, ":", WS, '"', NAME, '"']),
                 Pattern([JSON, "{", WS, '"response"', WS, ":", WS, '"']))


def read_object(fmt: ToolFormat, value, m, names: Names, taken: Collection[str]) -> list[ToolCall] | None:
    call = call_of(value, names, args_keys=fmt.args_keys, ids=fmt.ids, taken=taken)
    return None if call is None else [call]


def read_list(fmt: ToolFormat, value, m, names: Names, taken: Collection[str]) -> list[ToolCall] | None:
    """Every item a call, or none is: one bad item makes the block text."""
    if not isinstance(value, list) or not value:
        return None
    calls: list[ToolCall] = []
    for item in value:
        call = call_of(item, names, args_keys=fmt.args_keys, ids=fmt.ids, taken=[*taken, *(c.id for c in calls)])
        if call is None:
            return None
        calls.append(call)
    return calls


def read_any(fmt: ToolFormat, value, m, names: Names, taken: Collection[str]) -> list[ToolCall] | None:
    return (read_list if isinstance(value, list) else read_object)(fmt, value, m, names, taken)


def read_named(fmt: ToolFormat, value, m, names: Names, taken: Collection[str]) -> list[ToolCall] | None:
    """Mistral's `name[CALL_ID]id[ARGS]{...}`: the head names the call, the value is its arguments."""
    call = call_of(value, names, ids=fmt.ids, taken=taken, name=m["name"], given_id=m.groupdict().get("id"))
    return None if call is None else [call]


def read_generic(fmt: ToolFormat, value, m, names: Names, taken: Collection[str]) -> list[ToolCall] | str | None:
    if not isinstance(value, dict):
        return None
    if "tool_calls" in value:
        return read_list(fmt, value["tool_calls"], m, names, taken)
    if "tool_call" in value:
        return read_object(fmt, value["tool_call"], m, names, taken)
    return value["response"] if isinstance(value.get("response"), str) else None


def _obj(c: ToolCall, args_key: str = "arguments", ids: bool = False) -> dict:
    return {"name": c.name, args_key: json.loads(c.arguments), **({"id": c.id} if ids else {})}


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


@attrs.frozen
class ToolFormat:
    """One row of the table. A call begins at `opener` anywhere in the reply, or, when `bare`,
    at the reply's start (after blank) with no opener, and after such a call when `chain`; then
    one of `heads` (up to the bracket its JSON opens with), its JSON value, `trailer`."""

    name: str
    read: Read
    constrain: grammar.Build  # the Lark of a required call
    render: Callable[[Sequence[ToolCall]], str]  # calls as the model writes them (the template shows them so)
    needs: tuple[str, ...] = ()  # detection: the template's text holds all of these,
    any_of: tuple[str, ...] = ()  # one of these (when given),
    unless: tuple[str, ...] = ()  # and none of these
    opener: str | None = None
    heads: tuple[Pattern, ...] = (OBJECT,)
    trailer: Pattern | None = None
    bare: bool = False
    chain: bool = False
    args_keys: tuple[str, ...] = ("arguments", "parameters")  # where a call object holds its arguments
    ids: str = "openai"  # the shape of the ids its calls get (lever.model.tools.calls.ID_SHAPES)
    writes_ids: bool = False  # the model writes its calls' ids (kept when they have the shape)
    # its markers: decoded as their text where the vocabulary has them as control tokens (which
    # decode to nothing), so the calls can be read (llama.cpp's preserved tokens)
    preserved: tuple[str, ...] = ()

    def fits(self, template: str) -> bool:
        return all(s in template for s in self.needs) and (not self.any_of or any(s in template for s in self.any_of)) \
            and not any(s in template for s in self.unless)

    def head(self, text: str, at: int, names: Names):
        """The match of a head whole at `at` (of a function offered); True: the text from `at`
        may still grow into one; False: it cannot."""
        maybe = False
        for p in self.heads:
            got = p.match(text, at)
            if got is None:
                continue
            whole, m = got
            name = m.groupdict().get("name")
            if whole and (name is None or names is None or name in names):
                return m
            if not whole and (name is None or names is None or any(n.startswith(name) for n in names)):
                maybe = True
        return maybe


HERMES = ToolFormat(  # a list of call objects in one block too (Apriel's template asks for that)
    "hermes", read_any, grammar.tagged("<tool_call>", "</tool_call>"),
    lambda calls: "\n".join(f"<tool_call>\n{_dumps(_obj(c))}\n</tool_call>" for c in calls),
    needs=("<tool_call>",), unless=("<function=", "<arg_key>", "<invoke"),
    opener="<tool_call>", heads=(OBJECT, LIST), trailer=Pattern([WS, "</tool_call>"]),
    preserved=("<tool_call>", "</tool_call>"))
LLAMA3 = ToolFormat(
    "llama3", read_object, grammar.bare("parameters"),
    lambda calls: "\n".join(_dumps(_obj(c, "parameters")) for c in calls),
    needs=("<|start_header_id|>",), any_of=("ipython", '"parameters"'), unless=("<function=", ">>>"),
    opener="<|python_tag|>", bare=True, chain=True, args_keys=("parameters", "arguments"),
    preserved=("<|python_tag|>",))
MISTRAL = ToolFormat(
    "mistral", read_list, grammar.prefixed_list("[TOOL_CALLS]", ids=True),
    lambda calls: "[TOOL_CALLS]" + _dumps([_obj(c, ids=True) for c in calls]),
    needs=("[TOOL_CALLS]",), opener="[TOOL_CALLS]", heads=(LIST,), ids="mistral", writes_ids=True,
    preserved=("[TOOL_CALLS]",))
MISTRAL_ARGS = ToolFormat(
    "mistral-args", read_named, grammar.named(ids=False),
    lambda calls: "".join(f"[TOOL_CALLS]{c.name}[ARGS]{c.arguments}" for c in calls),
    needs=("[TOOL_CALLS]", "[ARGS]"), unless=("[CALL_ID]",), opener="[TOOL_CALLS]", heads=MISTRAL_HEADS,
    ids="mistral", preserved=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"))
MISTRAL_IDS = attrs.evolve(
    MISTRAL_ARGS, name="mistral-ids", constrain=grammar.named(ids=True), writes_ids=True,
    render=lambda calls: "".join(f"[TOOL_CALLS]{c.name}[CALL_ID]{c.id}[ARGS]{c.arguments}" for c in calls),
    needs=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"), unless=())
FIREFUNCTION = ToolFormat(
    "firefunction", read_list, grammar.prefixed_list("functools", ids=False),
    lambda calls: "functools" + _dumps([_obj(c) for c in calls]),
    needs=("functools[",), opener="functools", heads=(LIST,))
FENCED = ToolFormat(
    "json", read_any, grammar.fenced,
    lambda calls: "\n".join(f"```json\n{_dumps(_obj(c))}\n```" for c in calls),
    any_of=("tools",), opener="```json", heads=(OBJECT, LIST), trailer=Pattern([WS, "```"]), bare=True, chain=True)
GENERIC = ToolFormat(
    "generic", read_generic, grammar.wrapped,
    lambda calls: _dumps({"tool_calls": [_obj(c, ids=True) for c in calls]}),
    heads=GENERIC_HEADS, bare=True, writes_ids=True)

# in the order they are tried: the first whose markers the template holds is its format
FORMATS = (MISTRAL_IDS, MISTRAL_ARGS, MISTRAL, FIREFUNCTION, HERMES, LLAMA3, FENCED, GENERIC)
BY_NAME = {f.name: f for f in FORMATS}


@functools.lru_cache(maxsize=16)
def detect(template: str | None) -> ToolFormat:
    """The format a chat template's text teaches its model (no template: generic)."""
    return next(f for f in FORMATS if f.fits(template or ""))
