"""How deep a JSON value nests, found without recursing: the bound is checked before anything
that recurses per level (json.loads, json.dumps, a template's tojson, a schema compiler) sees it.

Beside lever.errors, below everything: the chat template's tool calls (lever.gguf.chat_template),
the tool calls in a reply (lever.model.tool_calls) and the grammars' bounds (lever.model.bounds).
"""

from __future__ import annotations


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
