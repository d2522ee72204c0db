"""TextStream: the one door a generation's text leaves by, for `lever run`, the API and the server.

Beside lever.pipelines.compose, which hands it to Accept as the request's stop rule: after every
pass Accept gives it the tokens emitted (and their logprobs), and it decodes them (UTF-8 never
split: lever.gguf.tokenizer.StreamDecoder), holds back text a stop string could still claim, and
hands on what is final (`on_text(text, tokens, logprobs)`) with the logprobs of the tokens it
covers. Its answer is the only decision it takes: STOP when a stop string completed (under a
grammar, only where the grammar accepts the text before it: a reply that stops is one the
grammar accepts, as one that ends by its end token is), CANCELLED when the caller's event is
set. With the functions a call offers, text that may begin a tool call (in the format the model's
template teaches, lever.model.tools.formats) is held too, released as soon as it cannot, and the
calls come out whole at the end (`reply`, lever.model.tools.stream). `lever run` prints what it
hands on; RunResult.text, the API's Completion and its Chunks, the server's replies are all it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import attrs

from lever.gguf.tokenizer import StreamDecoder, Tokenizer
from lever.model.grammar import Grammar
from lever.model.stop import StopReason
from lever.model.tool_calls import HERMES, CallStream, ToolCall, ToolFormat


@attrs.define
class TextStream:
    """One generation's text. Call it with each pass's tokens (it is a StopRule:
    lever.stages.accept); `finish()` once the generation ended."""

    tok: Tokenizer
    stops: tuple[str, ...] = ()
    on_text: Callable | None = None  # on_text(text, tokens, logprobs): each piece as it is final, with its ids
    eos_ids: frozenset[int] = frozenset()  # end tokens: not text
    cancel: threading.Event = attrs.field(factory=threading.Event)
    grammar: Grammar | None = None  # the generation's grammar: a stop string counts only where it accepts
    offered: frozenset[str] | None = None  # the functions a call offers: their calls are held and parsed
    tool_format: ToolFormat = HERMES  # how the model writes calls (lever.model.tools.formats.detect)
    text: str = ""  # everything decoded, stop string included
    sent: int = 0  # chars of `text` handed on
    tokens: list[int] = attrs.field(factory=list)  # ids kept: past a stop string, none
    logprobs: list = attrs.field(factory=list)  # TokenLogprob of `tokens`, when the run computes them
    unsent_tokens: int = 0
    stopped_at: int = -1  # where the first stop string starts in `text`
    _ends: list[int] = attrs.field(factory=list)  # len(text) after each of `tokens`
    _decoder: StreamDecoder = attrs.field(init=False)
    _calls: CallStream | None = attrs.field(init=False)
    _preserved: frozenset[int] = attrs.field(init=False)  # the format's markers that would decode to nothing

    def __attrs_post_init__(self):
        self._decoder = StreamDecoder(self.tok, at_start=False)
        self._calls = CallStream(self.offered, self.tool_format) if self.offered else None
        # a call's markers as their text, even where they are control tokens (Mistral's [TOOL_CALLS],
        # Llama's <|python_tag|>), or no call could be read
        marks = self.tool_format.preserved if self.offered else ()
        self._preserved = frozenset(i for m in marks if (i := self.tok.specials.get(m)) is not None)

    def __call__(self, tokens: tuple[int, ...], logprobs: tuple = ()) -> StopReason | None:
        for i, t in enumerate(tokens):
            if self.stopped_at >= 0:
                break
            self.tokens.append(t)
            if logprobs:
                self.logprobs.append(logprobs[i])
            self.unsent_tokens += 1
            before = len(self.text)
            if t in self._preserved:
                self.text += self._decoder.flush() + self.tok.token_text(t)
            elif t not in self.eos_ids:  # the end-of-turn token is not text
                self.text += self._decoder.push(t)
            self._ends.append(len(self.text))
            self._find(before)
        if self.stopped_at >= 0:
            self._hand_on(self.stopped_at)
            return StopReason.STOP
        self._hand_on(len(self.text) - self._held())
        return StopReason.CANCELLED if self.cancel.is_set() else None

    def finish(self) -> None:
        """The generation ended: what was held back is final (a call, parsed whole)."""
        if self.stopped_at < 0:
            before = len(self.text)
            self.text += self._decoder.flush()
            self._find(before)
        self._hand_on(self.stopped_at if self.stopped_at >= 0 else len(self.text))
        if self._calls is not None:
            rest, _ = self._calls.finish()
            if rest and self.on_text is not None:
                self.on_text(rest, (), ())

    @property
    def final_text(self) -> str:
        """The generation's text, a stop string and what followed it excluded."""
        return self.text[: self.stopped_at] if self.stopped_at >= 0 else self.text

    def reply(self) -> tuple[str, list[ToolCall]]:
        """The text and the calls of the functions offered (none offered: the text, no calls), as
        they were streamed (after `finish`)."""
        if self._calls is None:
            return self.final_text, []
        return self._calls.reply_text, list(self._calls.calls)

    def _find(self, before: int) -> None:
        """A match must end in the text added after `before` chars: it starts at most the
        longest stop string's length - 1 before them."""
        lo = max(0, before - max((len(s) for s in self.stops), default=0) + 1)
        hits = sorted(i for s in self.stops for i in _occurrences(self.text, s, lo))
        self.stopped_at = next((i for i in hits if self._ends_here(i)), -1)

    def _ends_here(self, at: int) -> bool:
        """Whether the text may end before `at` chars: always without a grammar; under one, at
        a token boundary where the grammar accepts the tokens before it."""
        if self.grammar is None:
            return True
        k = next((k for k, end in enumerate(self._ends) if end == at), None)  # the first: pending bytes are after
        return k is not None and self.grammar.accepts(self.tokens[: k + 1] if at else [])

    def _held(self) -> int:
        """Chars at the end of the text that begin a stop string: not final yet."""
        for n in range(min(len(self.text), max((len(s) for s in self.stops), default=0)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def _hand_on(self, upto: int) -> None:
        if upto > self.sent or (self.unsent_tokens and self.stopped_at >= 0):
            piece = self.text[self.sent : max(upto, self.sent)]
            if self._calls is not None:
                piece = self._calls.push(piece)
            if self.on_text is not None:
                first = len(self.tokens) - self.unsent_tokens
                lps = tuple(self.logprobs[first:]) if self.logprobs else ()
                self.on_text(piece, tuple(self.tokens[first:]), lps)
            self.sent, self.unsent_tokens = max(upto, self.sent), 0


def _occurrences(text: str, s: str, lo: int) -> Iterator[int]:
    i = text.find(s, lo)
    while i >= 0:
        yield i
        i = text.find(s, i + 1)
