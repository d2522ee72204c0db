"""A reply's tool calls read as its text comes: the text that might begin a call is held, the
rest handed on at once, and each call read whole where it closes.

Below lever.pipelines.text (TextStream pushes each piece of final text here when a call offers
functions) and the API's one-shot replies (`parse_calls`: the same reading, pushed at once, so a
streamed reply's text and calls are the one-shot reply's in any chunking). What a format's call
looks like is its row in lever.model.tools.formats; this walks the text by it:

- outside a call, text is handed on up to where the format's opener begins (or a tail that may
  grow into it), or, where a call may stand bare (the reply's start, after such a call), a bracket;
- from there it is held while its head (opener, name of a function offered, the bracket the JSON
  opens with) may still come, then until the JSON value closes and the format's trailer follows;
- the closed block is read (lever.model.tools.calls: a function offered, arguments a JSON object):
  calls, or, when it is none, the opener (or the bracket) is text and the walk goes on after it;
- a block begun and never closed (a reply cut by its token limit) is neither call nor text.

The text is the reply's outside its calls, stripped at both ends as the one-shot reply is: blank
before a call is handed on only when text follows it.
"""

from __future__ import annotations

import json
from collections.abc import Collection

import attrs

from lever.gguf.chat_template import MAX_NESTING
from lever.model.tools.calls import ToolCall
from lever.model.tools.formats import HERMES, ToolFormat
from lever.model.tools.lexing import JsonEnd

MAX_LEVELS = MAX_NESTING + 3  # a call's arguments inside its object, a list, generic's wrapper


@attrs.define
class Block:
    """A possible call being read: where it starts, where its head is read from, how far."""

    start: int
    body: int  # after the opener (= start for a bare call)
    head: object = None  # the head's match, once whole
    json: JsonEnd | None = None
    json_end: int = -1


@attrs.define
class CallStream:
    """One reply's text, pushed piece by piece: `push` says what of it can be handed on now,
    `finish` what is left and the calls (functions of `names`, None: any)."""

    names: Collection[str] | None = None
    fmt: ToolFormat = HERMES
    text: str = ""
    calls: list[ToolCall] = attrs.field(factory=list)
    out: list[str] = attrs.field(factory=list)  # every piece handed on: the reply's text is their join
    pos: int = 0  # `text` is decided up to here
    at_call: bool = True  # a bare call may begin at `pos`
    block: Block | None = None
    _started: bool = False  # text other than blank was handed on
    _blank: str = ""  # blank held: handed on before the next text, dropped at the end

    @property
    def reply_text(self) -> str:
        return "".join(self.out)

    def push(self, piece: str) -> str:
        """Of the text so far, what can be handed on now."""
        self.text += piece
        return self._walk(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The reply ended: the text not handed on yet, and the reply's calls."""
        return self._walk(final=True), list(self.calls)

    def _walk(self, final: bool) -> str:
        sent: list[str] = []
        while (self.block is not None or self._open(sent, final)) and self._read(sent, final):
            pass
        return "".join(sent)

    def _open(self, sent: list[str], final: bool) -> bool:
        """Hands on the text before the next possible call and opens a block there; False when
        there is none yet (what may still begin one is held, unless `final`)."""
        text, opener = self.text, self.fmt.opener or ""
        if self.at_call and self.fmt.bare:
            j = len(text) - len(text[self.pos:].lstrip())
            self._say(text[self.pos : j], sent)
            self.pos = j
            if j == len(text) or (opener and not final and opener.startswith(text[j:])):
                return False  # blank so far, or the opener's beginning
            if not (opener and text.startswith(opener, j)):
                self.block = Block(j, j)
                return True
        i = text.find(opener, self.pos) if opener else -1
        if i < 0:
            keep = 0 if final else next((n for n in range(min(len(opener) - 1, len(text) - self.pos), 0, -1)
                                         if opener.startswith(text[len(text) - n :])), 0)
            self._say(text[self.pos : len(text) - keep], sent)
            self.pos = len(text) - keep
            return False
        self._say(text[self.pos : i], sent)
        self.pos, self.block = i, Block(i, i + len(opener))
        return True

    def _read(self, sent: list[str], final: bool) -> bool:
        """Reads the open block as far as the text goes: True when it was decided (a call, or
        text, or cut at the end), False when it waits for more."""
        b, text = self.block, self.text
        if b.head is None:
            got = self.fmt.head(text, b.body, self.names)
            if got is False:
                return self._not_a_call(sent)
            if got is True:
                return self._cut() if final else False
            b.head, b.json = got, JsonEnd(got.start("json"), MAX_LEVELS)
        if b.json_end < 0:
            end = b.json.feed(text)
            if end == -1:
                return self._not_a_call(sent)
            if end is None:
                return self._cut() if final else False
            b.json_end = end
        end = b.json_end
        if self.fmt.trailer is not None and b.body > b.start:  # a bare call has no trailer
            got = self.fmt.trailer.match(text, end)
            if got is None:
                return self._not_a_call(sent)
            if not got[0]:
                return self._cut() if final else False
            end = got[1].end()
        try:
            value = json.loads(text[b.head.start("json") : b.json_end])
        except ValueError:
            return self._not_a_call(sent)
        read = self.fmt.read(self.fmt, value, b.head, self.names, [c.id for c in self.calls])
        if read is None:
            return self._not_a_call(sent)
        if isinstance(read, str):
            self._say(read, sent)
        else:
            self.calls += read
        self.pos, self.block, self.at_call = end, None, self.fmt.chain and not isinstance(read, str)
        return True

    def _not_a_call(self, sent: list[str]) -> bool:
        """The block is no call: its opener (or bracket) is text; the walk goes on after it."""
        b = self.block
        after = b.body if b.body > b.start else b.start + 1
        self._say(self.text[b.start : after], sent)
        self.pos, self.block, self.at_call = after, None, False
        return True

    def _cut(self) -> bool:
        """The reply ended inside a call: neither call nor text."""
        self.pos, self.block, self.at_call = len(self.text), None, False
        return True

    def _say(self, piece: str, sent: list[str]) -> None:
        """Hands text on, stripped at the reply's ends: leading blank dropped, trailing blank held."""
        if not self._started:
            piece = piece.lstrip()
            if not piece:
                return
            self._started = True
        piece = self._blank + piece
        kept = piece.rstrip()
        self._blank = piece[len(kept) :]
        if kept:
            self.out.append(kept)
            sent.append(kept)


def parse_calls(text: str, names: Collection[str] | None = None, fmt: ToolFormat = HERMES
                ) -> tuple[str, list[ToolCall]]:
    """A whole reply's text outside its calls (stripped) and its calls, in format `fmt`: a block
    that is not a call of a function in `names` (None: any) with arguments a JSON object stays
    text; one begun and never closed is neither."""
    s = CallStream(names, fmt)
    s.push(text)
    s.finish()
    return s.reply_text, s.calls
