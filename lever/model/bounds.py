"""A grammar's bounds, checked on its text before the engine compiles it: linear, never recursive.

Below lever.model.grammar, which asks these of every JSON schema, Lark grammar and converted
GBNF grammar before llguidance sees it. The engine recurses once per reference it follows: a
chain of ~2,500 `$ref`s or Lark rules overflowed its stack (SIGSEGV: a server gone, issue 44);
it expands a counted repetition inside a lexeme into states (`a{1000000}`: it gave up mid-mask,
`(a{1000}){1000}`: 290 MB); and it compiles an object's properties in more than linear time
(5,000 in one object: 1.4 s). Each bound below sits an order of magnitude under where the
engine failed or slowed on this machine (docs/measurements.md, 'Grammar bounds'), and far above
what a tool's or an app's schema needs (OpenAI's structured outputs allow 5,000 properties in
all, 10 levels of nesting). A grammar past one is refused with its field, the bound and its figure.

Counts the engine keeps as counters are not bounded: a schema's minLength / maxLength /
minItems / maxItems (a million each compiled in a millisecond). A Lark grammar's counts are
multiplied through the rules they repeat (a conservative bound: the engine inlines many rules).
"""

from __future__ import annotations

import collections
import json
import re

import attrs

from lever.nesting import depth, text_depth

MAX_GRAMMAR_BYTES = 256 << 10  # a schema's JSON or a grammar's text
MAX_RULES = 2000  # definitions in a Lark or GBNF grammar
MAX_REFERENCE_CHAIN = 250  # rules (or $refs) one reference leads through before it ends; the engine crashed at ~2,500
MAX_SCHEMA_DEPTH = 100  # levels of a JSON schema's objects and lists (OpenAI allows 10 levels of properties)
MAX_PROPERTIES = 1000  # properties of one object schema
MAX_REPEAT = 10_000  # a lexeme's nested counted repetitions multiplied: (a{100}){100} is 10,000
MAX_GROUP_DEPTH = 64  # parentheses inside parentheses in a grammar's rule or a regex


class BoundError(Exception):
    """A grammar past a bound: the one line says which bound and by how much."""


def check_schema(schema: dict) -> None:
    """A JSON schema within the bounds (its nesting first: nothing below recurses on it)."""
    levels = depth(schema)
    if levels > MAX_SCHEMA_DEPTH:
        raise BoundError(f"nests {levels} levels deep, over the bound of {MAX_SCHEMA_DEPTH}")
    size = len(json.dumps(schema, ensure_ascii=False).encode())
    if size > MAX_GRAMMAR_BYTES:
        raise BoundError(f"{size} bytes of JSON, over the bound of {MAX_GRAMMAR_BYTES}")
    refs: dict[str, list[str]] = collections.defaultdict(list)  # a $ref target (or "#") -> the targets it refers to
    stack = [(schema, "#", "#")]  # (value, its JSON pointer, the nearest $ref target holding it)
    targets = _ref_targets(schema)
    while stack:
        v, where, owner = stack.pop()
        if where in targets:
            owner = where
        if isinstance(v, dict):
            ref = v.get("$ref")
            if isinstance(ref, str):
                refs[owner].append(_pointer(ref))
            props = v.get("properties")
            if isinstance(props, dict) and len(props) > MAX_PROPERTIES:
                raise BoundError(f"{where}: {len(props)} properties, over the bound of {MAX_PROPERTIES} in one object")
            for key in ("pattern",):
                if isinstance(v.get(key), str):
                    check_regex(v[key], f"{where}/{key}")
            if isinstance(v.get("patternProperties"), dict):
                for p in v["patternProperties"]:
                    check_regex(p, f"{where}/patternProperties")
            for k, x in v.items():
                # a definition compiles where it is referred to, not where it sits
                stack.append((x, f"{where}/{_escaped(k)}", "" if k in ("$defs", "definitions") else owner))
        elif isinstance(v, list):
            stack.extend((x, f"{where}/{i}", owner) for i, x in enumerate(v))
    longest = longest_chain(refs)
    if longest > MAX_REFERENCE_CHAIN:
        raise BoundError(f"a chain of {longest} $refs, over the bound of {MAX_REFERENCE_CHAIN}")


def _ref_targets(schema: dict) -> set[str]:
    out, stack = set(), [schema]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if isinstance(v.get("$ref"), str):
                out.add(_pointer(v["$ref"]))
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out


def _pointer(ref: str) -> str:
    return "#" + ref.split("#", 1)[1].rstrip("/") if "#" in ref else ref


def _escaped(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def components(edges: dict[str, list[str]]) -> tuple[dict[str, int], list[int]]:
    """Each node's strongly connected component and the components' sizes, numbered so that a
    component comes after every one it reaches (iterative Tarjan: no recursion per node)."""
    nodes = list(dict.fromkeys([*edges, *(t for ts in edges.values() for t in ts)]))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comp: dict[str, int] = {}
    sizes: list[int] = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(edges.get(start, ())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                size = 0
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp[x] = len(sizes)
                    size += 1
                    if x == node:
                        break
                sizes.append(size)
    return comp, sizes


def longest_chain(edges: dict[str, list[str]]) -> int:
    """The most nodes a path through `edges` visits, a cycle's nodes all counted (its strongly
    connected component weighs its size): the longest path over the components, a DAG."""
    comp, sizes = components(edges)
    members: dict[int, list[str]] = collections.defaultdict(list)
    for n, c in comp.items():
        members[c].append(n)
    best = [0] * len(sizes)
    for c in range(len(sizes)):  # successors first
        after = max((best[comp[t]] for n in members[c] for t in edges.get(n, ()) if comp[t] != c), default=0)
        best[c] = sizes[c] + after
    return max(best, default=0)


# -- regular expressions and Lark

_QUANT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def regex_weight(rx: str) -> int:
    """The largest product of counted repetitions nested in a regex (`(a{10}){20}`: 200); a
    `*`, `+` or `?` counts 1 (the engine loops, it does not unroll)."""
    weight, _ = _weights(rx, 0, "")
    return weight


def _weights(text: str, start: int, end_char: str) -> tuple[int, int]:
    """(the weight of `text` from `start` to the unescaped `end_char`, or its end; where it
    stopped), iterative over groups."""
    frames = [[1, 1]]  # per open group: [its largest weight so far, the last atom's weight]
    i, n = start, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            frames[-1][1] = 1
            i += 2
            continue
        if c == end_char and len(frames) == 1:
            break
        if c == "[":
            j = i + 1
            if j < n and text[j] == "^":
                j += 1
            if j < n and text[j] == "]":
                j += 1
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            frames[-1][1] = 1
            frames[-1][0] = max(frames[-1][0], 1)
            i = j + 1
            continue
        if c == "(":
            if len(frames) > MAX_GROUP_DEPTH:
                raise BoundError(f"groups nested over {MAX_GROUP_DEPTH} deep")
            frames.append([1, 1])
            i += 1
            continue
        if c == ")" and len(frames) > 1:
            w = frames.pop()[0]
            frames[-1][1] = w
            frames[-1][0] = max(frames[-1][0], w)
            i += 1
            continue
        m = _QUANT.match(text, i) if c == "{" else None
        if m:
            count = int(m.group(2)) if m.group(2) else int(m.group(1))
            w = frames[-1][1] * max(count, 1)
            frames[-1][1] = w
            frames[-1][0] = max(frames[-1][0], w)
            i = m.end()
            continue
        if c not in "*+?|":
            frames[-1][1] = 1
        i += 1
    return frames[0][0] if len(frames) == 1 else max(f[0] for f in frames), i


def check_regex(rx: str, where: str) -> None:
    w = regex_weight(rx)
    if w > MAX_REPEAT:
        raise BoundError(f"{where}: repeats {w} times over (counts nested, multiplied), over the bound of {MAX_REPEAT}")


_DEFINITION = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\[[^\]\n]*\])?(?:\.-?\d+)?[ \t]*:(?!:)", re.M)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_lark(text: str) -> None:
    """A Lark grammar (llguidance's dialect) within the bounds: its size, its rules, the
    longest chain of references between them, each lexeme's repetitions (through the
    terminals it refers to), and any JSON schema inlined with %json."""
    size = len(text.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise BoundError(f"{size} bytes, over the bound of {MAX_GRAMMAR_BYTES}")
    starts = list(_DEFINITION.finditer(text))
    if len(starts) > MAX_RULES:
        raise BoundError(f"{len(starts)} rules, over the bound of {MAX_RULES}")
    refs: dict[str, list[str]] = {}
    local: dict[str, int] = {}  # a definition's own repetition weight
    counted: dict[str, list[tuple[str, int]]] = {}  # a definition -> (a name it refers to, the counts around it)
    for k, m in enumerate(starts):
        body = text[m.end() : starts[k + 1].start() if k + 1 < len(starts) else len(text)]
        name = m.group(1)
        names, weight, around, schemas = _scan_body(body)
        refs.setdefault(name, []).extend(names)
        local[name] = max(local.get(name, 1), weight)
        counted.setdefault(name, []).extend(around)
        for schema in schemas:
            check_schema(schema)
    longest = longest_chain(refs)
    if longest > MAX_REFERENCE_CHAIN:
        raise BoundError(f"a chain of {longest} rules, each referring to the next, over the bound of "
                         f"{MAX_REFERENCE_CHAIN}")
    # the engine inlines what a definition refers to where it can (a terminal always, a rule
    # of one literal too: `start: a{100000}` with `a: "a"` cost as much as `"a"{100000}`), so
    # counts multiply through every reference but those within a cycle
    comp, _ = components(refs)
    by_comp: dict[int, list[str]] = collections.defaultdict(list)
    for name, c in comp.items():
        by_comp[c].append(name)
    weights: dict[str, int] = {}
    for c in sorted(by_comp):  # successors first
        for name in by_comp[c]:
            w = local.get(name, 1)
            for ref, count in counted.get(name, ()):
                if comp[ref] != c:
                    w = max(w, count * weights.get(ref, 1))
            weights[name] = w
    for name, w in weights.items():
        if w > MAX_REPEAT:
            raise BoundError(f"{name}: repeats {w} times over (counts nested, multiplied), over the bound of "
                             f"{MAX_REPEAT}")


_TILDE = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


@attrs.define
class _Group:
    """A group being scanned: its largest weight, its last item's (weight, references with
    the counts around them), and every reference in it so far."""

    weight: int = 0  # a group of references alone weighs nothing here: theirs is counted through `refs`
    last_weight: int = 0
    last: list[tuple[str, int]] = attrs.field(factory=list)
    refs: list[tuple[str, int]] = attrs.field(factory=list)

    def item(self, weight: int, refs: list[tuple[str, int]]) -> None:
        self.refs += self.last
        self.last_weight, self.last = weight, refs
        self.weight = max(self.weight, weight)

    def count(self, n: int) -> None:
        n = max(n, 1)  # {0} or ~0: the item never comes, but the engine builds it all the same
        self.last_weight *= n
        self.weight = max(self.weight, self.last_weight)
        self.last = [(r, m * n) for r, m in self.last]

    def close(self) -> list[tuple[str, int]]:
        self.refs += self.last
        self.last = []
        return self.refs


def _scan_body(body: str) -> tuple[list[str], int, list[tuple[str, int]], list[dict]]:
    """A definition's names referred to, its largest repetition weight (literals, regexes and
    groups with their counts), each reference with the counts around it, its %json schemas."""
    names: list[str] = []
    schemas: list[dict] = []
    groups = [_Group()]
    i, n = 0, len(body)
    while i < n:
        c, g = body[i], groups[-1]
        if c == '"':
            j = i + 1
            while j < n and body[j] != '"':
                j += 2 if body[j] == "\\" else 1
            g.item(1, [])
            i = _flags(body, j + 1)
        elif c == "/" and body[i : i + 2] != "//":
            w, j = _weights(body, i + 1, "/")
            g.item(w, [])
            i = _flags(body, j + 1)
        elif c in "/#":  # a comment, to the end of the line
            j = body.find("\n", i)
            i = n if j < 0 else j
        elif body.startswith("%json", i) or body.startswith("%regex", i):
            i = _inlined(body, i, schemas)
            g.item(1, [])
        elif c in "([":
            if len(groups) > MAX_GROUP_DEPTH:
                raise BoundError(f"groups nested over {MAX_GROUP_DEPTH} deep")
            groups.append(_Group())
            i += 1
        elif c in ")]" and len(groups) > 1:
            inner = groups.pop()
            groups[-1].item(inner.weight, inner.close())
            i += 1
        elif c == "{" and (m := _QUANT.match(body, i)):
            g.count(int(m.group(2)) if m.group(2) else int(m.group(1)))
            i = m.end()
        elif c == "~" and (m := _TILDE.match(body, i)):
            g.count(int(m.group(2)) if m.group(2) else int(m.group(1)))
            i = m.end()
        elif c == "<" and body.startswith("<[", i):
            j = body.find("]>", i)
            g.item(1, [])
            i = n if j < 0 else j + 2
        elif (m := _NAME.match(body, i)) and (i == 0 or not (body[i - 1].isalnum() or body[i - 1] == "_")):
            names.append(m.group())
            g.item(0, [(m.group(), 1)])
            i = m.end()
        else:
            i += 1
    while len(groups) > 1:  # unbalanced: the engine's error to report
        inner = groups.pop()
        groups[-1].item(inner.weight, inner.close())
    return names, groups[0].weight, groups[0].close(), schemas


def _inlined(body: str, i: int, schemas: list[dict]) -> int:
    """Past a `%json {...}` or `%regex {...}` at `i`; a %json's schema joins `schemas` (one that
    does not parse is the engine's error to report)."""
    j = body.find("{", i)
    end = len(body) if j < 0 else _json_end(body, j)
    if j >= 0 and body.startswith("%json", i) and text_depth(body[j:end]) <= MAX_SCHEMA_DEPTH:
        try:
            schema = json.loads(body[j:end])
        except ValueError:
            schema = None
        if isinstance(schema, dict):
            schemas.append(schema)
    return end


def _flags(text: str, i: int) -> int:
    """Past a literal's or a regex's flags (`"if"i`, `/a/s`)."""
    while i < len(text) and text[i] in "imslux":
        i += 1
    return i


def _json_end(text: str, start: int) -> int:
    """Where the JSON object opening at `start` closes (balanced braces outside strings)."""
    level, i, n = 0, start, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c == "{":
            level += 1
        elif c == "}":
            level -= 1
            if level == 0:
                return i + 1
        i += 1
    return n
