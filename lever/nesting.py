"""How deep a JSON value nests, found without recursing: the bound is checked before anything
that recurses per level (json.loads, json.dumps, a template's tojson, a schema compiler) sees it.

Above lever.errors, below everything else: the chat template's tool calls (lever.gguf.chat_template),
the tool calls in a reply (lever.model.tool_calls) and the grammars' bounds (lever.model.bounds).
`check_json` is the door for a JSON-like value an app hands over as Python objects (a
json_schema, a tool's parameters, a call's arguments): what json.dumps, a template and the
grammar engine can take, or one line saying what is wrong and where, never a hang.
"""

from __future__ import annotations

import math
import re

from lever.errors import LeverError

# values in one JSON-like value, a shared one counted each time it appears (as json.dumps writes
# it): a value of more is over 256 KiB of JSON text (two bytes a value at least), past
# lever.model.bounds.MAX_GRAMMAR_BYTES, so no schema that could compile is refused by this bound
MAX_NODES = 1 << 17
# the grammar engine's JSON numbers are 64-bit integers, signed or not: it refuses a schema with
# one past them (and json.dumps cannot write an integer of over 4,300 digits at all)
INT_RANGE = (-(1 << 63), (1 << 64) - 1)
_NAME = re.compile(r"[A-Za-z_$][A-Za-z0-9_$-]{0,39}")
_LEAVE = object()  # marks where a container's children end: it leaves the path there


class JsonValueError(LeverError):
    """A value that is not JSON, or is past a bound: `where` the argument, `at` the place in it
    (".properties.a", "[2]"; "" for the value itself), `why` what is wrong."""

    def __init__(self, where: str, at: str, why: str):
        super().__init__(f"{where}{at}: {why}")
        self.where, self.at, self.why = where, at, why


def check_json(value, where: str, *, max_depth: int, max_nodes: int = MAX_NODES) -> None:
    """`value` is JSON as Python holds it: dicts with string keys, lists (or tuples), strings,
    64-bit integers, finite floats, bools and None; no container inside itself (one shared by
    several places is fine, counted at each); at most `max_depth` levels of containers (as
    `depth` counts them) and `max_nodes` values in all. Iterative, and it visits at most
    `max_nodes` values; else a JsonValueError naming `where` and the place in it."""
    on_path: dict[int, tuple | None] = {}  # id of each container on the current path -> its place
    stack: list = [(value, None, 1)]  # (value, its place, its level); a place is (parent's place, key)
    n_nodes = 1
    while stack:
        v, place, level = stack.pop()
        if v is _LEAVE:
            del on_path[place]
            continue
        if not isinstance(v, (dict, list, tuple)):
            why = _scalar_problem(v)
            if why is not None:
                raise JsonValueError(where, _at(place), why)
            continue
        if id(v) in on_path:
            raise JsonValueError(where, _at(place), f"contains itself: the same {type(v).__name__} as "
                                                     f"{where}{_at(on_path[id(v)])} (a cycle)")
        if level > max_depth:
            raise JsonValueError(where, _at(place), f"nests deeper than {max_depth} levels")
        n_nodes += len(v)
        if n_nodes > max_nodes:
            raise JsonValueError(where, "", f"over the bound of {max_nodes} values (a shared one counted at "
                                            "each place it appears)")
        on_path[id(v)] = place
        stack.append((_LEAVE, id(v), 0))
        if isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise JsonValueError(where, _at(place), f"the key {_short(k)} is of type {type(k).__name__}; "
                                                             "JSON keys are strings")
                stack.append((x, (place, k), level + 1))
        else:
            stack.extend((x, (place, i), level + 1) for i, x in enumerate(v))


def _scalar_problem(v) -> str | None:
    """What is wrong with a value that is not a container; None when it is JSON."""
    if v is None or isinstance(v, (str, bool)):
        return None
    if isinstance(v, int):
        lo, hi = INT_RANGE
        return None if lo <= v <= hi else f"the integer {_short(v)} is past 64 bits (what JSON numbers hold here)"
    if isinstance(v, float):
        return None if math.isfinite(v) else f"{float(v)!r} is not a finite number"
    return f"a value of type {type(v).__name__} is not JSON (a dict, list, string, number, bool or None)"


def _at(place: tuple | None) -> str:
    """A place as a path: .name for a plain key, ['...'] for any other, [i] for an index; a deep
    one cut in the middle."""
    keys = []
    while place is not None:
        place, k = place
        keys.append(k)
    steps = [f"[{k}]" if isinstance(k, int) else f".{k}" if _NAME.fullmatch(k) else f"[{_short(k)}]"
             for k in reversed(keys)]
    if len(steps) > 12:
        steps = [*steps[:6], f"...({len(steps) - 10} more)", *steps[-4:]]
    return "".join(steps)


def _short(x) -> str:
    """A key or number as a message shows it: its repr, cut (an object's own repr is never called:
    it may recurse, raise or be huge)."""
    if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 128:
        return f"of {x.bit_length()} bits"
    if x is None:
        return "None"
    kind = next((t for t in (str, bytes, bool, int, float) if isinstance(x, t)), None)
    if kind is None:
        return f"<{type(x).__name__}>"
    text = kind.__repr__(x)  # a subclass's own repr is not called either
    return text if len(text) <= 40 else text[:37] + "..."


def depth(value) -> int:
    """Levels of lists and dicts in a parsed value (a scalar is 0), iteratively."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, (list, tuple)):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v if isinstance(x, (list, tuple, dict)))
    return deepest


def text_depth(text: str) -> int:
    """Levels of brackets in JSON text, outside its strings, in one pass (what a parser would
    recurse into, known before it runs; for text that is not JSON, a bound all the same)."""
    deepest = level = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            level += 1
            deepest = max(deepest, level)
        elif ch in "]}":
            level -= 1
    return deepest
