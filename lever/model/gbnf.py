"""llama.cpp's GBNF grammars as Lark, the grammar engine's own language, in linear time.

Below lever.model.grammar, which calls `to_lark` before the bounds (lever.model.bounds) and the
engine see a GBNF grammar. llguidance ships a converter (llguidance.gbnf_to_lark) and this one
writes the same Lark text (tests/model/test_gbnf.py holds them equal on every grammar it
generates), but that one decides which rules are terminals by sweeping all rules until nothing
changes: one rule per sweep on a chain, quadratic in the rules (two 0.35 MB grammars held a
server's request threads for two minutes, issue 44). Here each rule waits on a count of the
rules it refers to that are not yet known terminals, and is settled when that count reaches 0:
one visit per reference.

A terminal rule (no reference, however indirect, to `root` or to a rule on a cycle) is written
in capitals, so the engine lexes it as one regular lexeme, as llguidance's converter has it;
the others stay rules of the grammar. Nesting is bounded before parsing (the caller checks the
text's depth: lever.model.bounds), so the recursive descent below cannot overflow.
"""

from __future__ import annotations

import collections
import re

import attrs

from lever.errors import LeverError

WORD = re.compile(r"[^\W]|-", re.UNICODE)  # a name's characters: letters, digits, _ and -
ESCAPES = '"\\[]nrt'
HEX = {"x": 2, "u": 4, "U": 8}


class GbnfError(LeverError):
    """A GBNF grammar that does not parse: one line naming where."""


# the tree of a rule's alternatives, as tuples: ("lit", text) ("rx", text) ("ref", name)
# ("seq", [nodes]) ("alt", [nodes]) ("rep", node, min, max or None)


@attrs.define
class Rule:
    name: str
    body: tuple
    comment: str
    order: int
    terminal: bool = False


@attrs.define
class _Parser:
    text: str
    pos: int = 0
    comment: str = ""
    max_depth: int = 64  # groups inside groups: the descent below recurses once per level
    depth: int = 0

    def fail(self, why: str) -> GbnfError:
        line = self.text.count("\n", 0, self.pos) + 1
        near = self.text[self.pos : self.pos + 20]
        return GbnfError(f"{why} at line {line}, before {near!r}")

    def at(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def space(self, newlines: bool) -> None:
        text = self.text
        while self.pos < len(text):
            c = text[self.pos]
            if c in " \t" or (newlines and c in "\r\n"):
                self.pos += 1
            elif c == "#":
                end = text.find("\n", self.pos)
                end = len(text) if end < 0 else end
                if text[end - 1 : end] == "\r":
                    end -= 1
                self.comment += "//" + text[self.pos + 1 : end] + "\n"
                self.pos = end
            else:
                return

    def rules(self) -> dict[str, Rule]:
        out: dict[str, Rule] = {}
        self.space(True)
        while self.at():
            name = self.name()
            self.space(False)
            if self.text[self.pos : self.pos + 3] != "::=":
                raise self.fail("expected ::=")
            self.pos += 3
            self.space(True)
            body = self.alternatives(nested=False)
            if self.at() == "\r":
                self.pos += 1
            if self.at() == "\n":
                self.pos += 1
            order = out[name].order if name in out else len(out)  # a second definition replaces the first
            out[name] = Rule(name, body, self.comment, order)
            self.comment = ""
            self.space(True)
        return out

    def name(self) -> str:
        start = self.pos
        while self.at() and WORD.match(self.at()):
            self.pos += 1
        if self.pos == start:
            raise self.fail("expected a name")
        return self.text[start : self.pos]

    def integer(self) -> int:
        start = self.pos
        while self.at() and self.at() in "0123456789":
            self.pos += 1
        if self.pos == start:
            raise self.fail("expected an integer")
        return int(self.text[start : self.pos])

    def char(self) -> str:
        c = self.at()
        if not c:
            raise self.fail("unexpected end of input")
        if c != "\\":
            self.pos += 1
            return c
        e = self.text[self.pos + 1 : self.pos + 2]
        if not e:
            raise self.fail("incomplete escape sequence")
        if e in ESCAPES:
            self.pos += 2
            return "\\" + e
        if e in HEX:
            digits = self.text[self.pos + 2 : self.pos + 2 + HEX[e]]
            if len(digits) != HEX[e] or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"invalid \\{e} escape sequence")
            self.pos += 2 + HEX[e]
            return f"\\{e}{digits if e == 'x' else digits.lstrip('0')}"
        raise self.fail(f"invalid escape sequence \\{e}")

    def alternatives(self, nested: bool) -> tuple:
        alts = []
        while True:
            alts.append(self.sequence(nested))
            self.space(nested)
            if self.at() != "|":
                return ("alt", alts)
            self.pos += 1
            self.space(True)

    def sequence(self, nested: bool) -> tuple:
        nodes: list = []
        while (c := self.at()) and c not in "|)" and (nested or c not in "\r\n"):
            if c == '"':
                self.pos += 1
                parts = []
                while (ch := self.char()) != '"':
                    parts.append(ch)
                nodes.append(("lit", "".join(parts)))
            elif c == "[":
                self.pos += 1
                parts = ["["]
                while True:
                    ch = self.char()
                    parts.append("\\" + ch if ch in "/[" else ch)
                    if ch == "]":
                        break
                nodes.append(("rx", "".join(parts)))
            elif c == "(":
                self.pos += 1
                self.space(True)
                self.depth += 1
                if self.depth > self.max_depth:
                    raise self.fail(f"groups nested over {self.max_depth} deep")
                group = self.alternatives(nested=True)
                self.depth -= 1
                if self.at() != ")":
                    raise self.fail("expected ')'")
                self.pos += 1
                nodes.append(group)
            elif c == ".":
                self.pos += 1
                nodes.append(("rx", "."))
            elif WORD.match(c):
                nodes.append(("ref", self.name()))
            else:
                break
            self.space(nested)
            self.repetition(nodes)
            self.space(nested)
        return ("seq", nodes)

    def repetition(self, nodes: list) -> None:
        c = self.at()
        if not nodes or not c or c not in "*+?{":
            return
        self.pos += 1
        if c in "*+?":
            nodes[-1] = ("rep", nodes[-1], 1 if c == "+" else 0, 1 if c == "?" else None)
            return
        self.space(True)
        lo = self.integer()
        self.space(True)
        if self.at() == "}":
            self.pos += 1
            nodes[-1] = ("rep", nodes[-1], lo, lo)
            return
        if self.at() != ",":
            raise self.fail("expected ',' or '}'")
        self.pos += 1
        self.space(True)
        hi = self.integer() if self.at() and self.at() in "0123456789" else None
        self.space(True)
        if self.at() != "}":
            raise self.fail("expected '}'")
        self.pos += 1
        nodes[-1] = ("rep", nodes[-1], lo, hi)


def _simplified(node: tuple) -> tuple:
    kind = node[0]
    if kind in ("seq", "alt"):
        items = [_simplified(n) for n in node[1]]
        return items[0] if len(items) == 1 else (kind, items)
    if kind == "rep":
        return ("rep", _simplified(node[1]), node[2], node[3])
    return node


def _refs(node: tuple, out: list[str]) -> list[str]:
    kind = node[0]
    if kind == "ref":
        out.append(node[1])
    elif kind in ("seq", "alt"):
        for n in node[1]:
            _refs(n, out)
    elif kind == "rep":
        _refs(node[1], out)
    return out


def _settle_terminals(rules: dict[str, Rule]) -> None:
    """A rule is a terminal when it is not `start` and every rule it refers to is one: each
    rule waits on its references' count and is settled when the last of them is (linear)."""
    waiting: dict[str, int] = {}
    users: dict[str, list[str]] = collections.defaultdict(list)
    for r in rules.values():
        refs = _refs(r.body, [])
        waiting[r.name] = len(refs)
        for name in refs:
            users[name].append(r.name)
    ready = collections.deque(n for n, k in waiting.items() if k == 0 and n != "start")
    while ready:
        name = ready.popleft()
        rules[name].terminal = True
        for user in users[name]:
            waiting[user] -= 1
            if waiting[user] == 0 and user != "start":
                ready.append(user)


def _renamed(rules: dict[str, Rule]) -> dict[str, str]:
    """Each rule's Lark name: `-` as `_`, camelCase as snake_case, capitals for terminals."""
    names: dict[str, str] = {}
    taken = set(rules)
    for r in sorted(rules.values(), key=lambda r: r.order):
        new = re.sub(r"([a-z])([A-Z])", r"\1_\2", r.name.replace("-", "_"))
        new = new.upper() if r.terminal else new.lower()
        if new != r.name:
            if new in taken:
                raise GbnfError(f"rule {r.name!r}: its Lark name {new!r} is another rule's")
            taken.discard(r.name)
            taken.add(new)
        names[r.name] = new
    return names


def _lark(node: tuple, names: dict[str, str], top: bool = False) -> str:
    kind = node[0]
    if kind == "lit":
        return f'"{node[1]}"'
    if kind == "rx":
        return f"/{node[1]}/"
    if kind == "ref":
        return names[node[1]]
    if kind == "seq":
        return " ".join(_lark(n, names) for n in node[1]) if node[1] else '""'
    if kind == "alt":
        alts = [_lark(n, names) for n in node[1]]
        return "\n     | ".join(alts) if top else "(" + " | ".join(alts) + ")"
    inner, lo, hi = _lark(node[1], names), node[2], node[3]
    if node[1][0] in ("seq", "alt"):
        inner = f"({inner})"
    if hi is None and lo in (0, 1):
        return inner + ("*" if lo == 0 else "+")
    if (lo, hi) == (0, 1):
        return inner + "?"
    return f"{inner}{{{lo},{'' if hi is None else hi}}}"


def to_lark(text: str, max_depth: int = 64) -> str:
    """A GBNF grammar (llama.cpp's: `root ::= ...`) as llguidance's Lark; GbnfError naming the
    line of the first problem (groups nested past `max_depth` among them)."""
    p = _Parser(text, max_depth=max_depth)
    rules = p.rules()
    for r in rules.values():
        r.body = _simplified(r.body)
        missing = next((n for n in _refs(r.body, []) if n not in rules), None)
        if missing is not None:
            raise GbnfError(f"rule {r.name!r} refers to {missing!r}, which is not defined")
    if "root" not in rules:
        raise GbnfError("no 'root' rule")
    if "start" in rules:
        raise GbnfError("a rule named 'start' (Lark's root) beside 'root'")
    root = rules.pop("root")
    root.name = "start"
    rules["start"] = root
    for r in rules.values():  # references to root are references to start now
        r.body = _rerooted(r.body)
    _settle_terminals(rules)
    names = _renamed(rules)
    out, newline_before = ["%llguidance {}\n\n"], True
    for r in sorted(rules.values(), key=lambda r: r.order):
        s = f"{r.comment}{names[r.name]}: {_lark(r.body, names, top=True)}"
        multi = "\n" in s
        if multi and not newline_before:
            out.append("\n")
        out.append(s + "\n" + ("\n" if multi else ""))
        newline_before = multi
    return "".join(out)


def _rerooted(node: tuple) -> tuple:
    kind = node[0]
    if kind == "ref":
        return ("ref", "start") if node[1] == "root" else node
    if kind in ("seq", "alt"):
        return (kind, [_rerooted(n) for n in node[1]])
    if kind == "rep":
        return ("rep", _rerooted(node[1]), node[2], node[3])
    return node
