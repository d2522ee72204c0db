"""What a tool call's text is read with while it is still coming: a pattern that knows its own
prefixes, and where a JSON value closes.

Beside lever.model.tools.stream, which holds a possible call back until one of these decides it:
a call's head (its opener, name, the bracket its JSON opens with) is a `Pattern`, matched whole or
found to be still a prefix of one, or neither (then it is text, released at once); its JSON value
is followed by `JsonEnd` to its closing bracket, resumed where it stopped as more text comes.
Both decide on a prefix what they decide on any longer text, so a reply streamed in any pieces
is read as the reply read at once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs


@attrs.frozen
class Re:
    """A pattern's regex piece (literal text is given as a str); `partial`: its form when the
    text may stop inside it (a name cut short), default the piece itself."""

    full: str
    partial: str | None = None


WS = Re(r"\s*")
JSON = Re(r"(?P<json>)")  # where the call's JSON value starts: its opening bracket follows
NAME = Re(r'(?P<name>[A-Za-z0-9_.-]+)', r'(?P<name>[A-Za-z0-9_.-]*)')  # a function's name (check_tools' shape)
ID = Re(r"(?P<id>[A-Za-z0-9]+)", r"(?P<id>[A-Za-z0-9]*)")


class Pattern:
    """A sequence of literal text and regex pieces, and its prefixes: `match` says whether text
    at a place holds it whole, is still a beginning of it, or neither."""

    def __init__(self, atoms: Sequence[str | Re]):
        parts = []
        for a in atoms:
            literal = isinstance(a, str)
            parts += [(re.escape(c), re.escape(c)) for c in a] if literal else [(a.full, a.partial or a.full)]
        self.full = re.compile("".join(f for f, _ in parts))
        partial = ""
        for _, p in reversed(parts):  # a(?:b(?:c)?)?: every prefix, piece by piece
            partial = f"(?:{p}{partial})?"
        self.partial = re.compile(partial)

    def match(self, text: str, at: int) -> tuple[bool, re.Match] | None:
        """(True, the match) when text at `at` holds the whole pattern; (False, the match) when
        the rest of the text is a beginning of it; None when it is neither."""
        m = self.full.match(text, at)
        if m:
            return True, m
        m = self.partial.fullmatch(text, at)
        return (False, m) if m else None


_PLAIN = re.compile(r'[^"\[\]{}]+')  # outside strings: what cannot open or close anything
_CHARS = re.compile(r'[^"\\]+')  # inside a string: what cannot end it


@attrs.define
class JsonEnd:
    """Follows a JSON value that opens with a bracket at `at` to its closing bracket, as its text
    comes (`feed` again with the longer text: it goes on where it stopped). Lexical only (the
    value is parsed once it closes), in one pass, never deeper than `limit` levels."""

    at: int
    limit: int
    level: int = 0
    in_string: bool = False
    escaped: bool = False

    def feed(self, text: str) -> int | None:
        """Where the value ends (past its closing bracket); None: not yet; -1: it nests past
        `limit` (no call's JSON: not followed further)."""
        i, n = self.at, len(text)
        while i < n:
            if self.in_string:
                if self.escaped:
                    self.escaped, i = False, i + 1
                elif m := _CHARS.match(text, i):
                    i = m.end()
                else:
                    self.escaped, self.in_string, i = text[i] == "\\", text[i] == "\\", i + 1
                continue
            if m := _PLAIN.match(text, i):
                i = m.end()
                continue
            c, i = text[i], i + 1
            if c == '"':
                self.in_string = True
            elif c in "[{":
                self.level += 1
                if self.level > self.limit:
                    return -1
            else:
                self.level -= 1
                if self.level <= 0:
                    self.at = i
                    return i
        self.at = i
        return None
