"""A generation's text as it leaves: decoded, stop strings held back and matched, tool calls parsed.

Beside lever.api.call, below the LLM. `StopStrings` is the stop rule Accept asks after every
pass (lever.stages.accept.StopRule): it decodes the tokens emitted, ends the generation when the
text holds a stop string (under a grammar, only where the grammar accepts the text before it)
or the caller cancelled, and hands on the text no stop string can still claim. `with_tool_calls`
and `with_call_stream` take the calls of the functions offered out of a reply, whole or streamed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import attrs

from lever.api.call import Chunk, Completion
from lever.dataflow.messages import TokenLogprob
from lever.gguf.tokenizer import StreamDecoder, Tokenizer
from lever.model.grammar import Grammar
from lever.model.stop import StopReason
from lever.model.tool_calls import CallStream, ToolCall, parse_calls


@attrs.define
class StopStrings:
    """The stop rule of one generation (lever.stages.accept.StopRule): decodes the tokens each
    pass emits, ends the generation when the text holds a stop string or the caller cancelled,
    and hands on the text that no stop string can still claim (`on_text(text, n_tokens,
    logprobs)`), with the logprobs of the tokens it covers when the generation computes them."""

    tok: Tokenizer
    stops: tuple[str, ...] = ()
    on_text: object = None  # callable(text, n_tokens) or None
    eos_ids: frozenset[int] = frozenset()
    cancel: threading.Event = attrs.field(factory=threading.Event)
    text: str = ""  # everything decoded, stop string included
    sent: int = 0  # chars of `text` handed on
    tokens: list[int] = attrs.field(factory=list)  # ids kept: past a stop string, none
    logprobs: list[TokenLogprob] = attrs.field(factory=list)  # of `tokens`, when the run computes them
    unsent_tokens: int = 0
    stopped_at: int = -1  # where the first stop string starts in `text`
    # under a grammar, a stop string ends the text only where the grammar accepts what comes
    # before it: a reply that stops is one the grammar accepts, as one that ends by EOS is
    grammar: Grammar | None = None
    _ends: list[int] = attrs.field(factory=list)  # len(text) after each of `tokens`
    _decoder: StreamDecoder = attrs.field(init=False)

    def __attrs_post_init__(self):
        self._decoder = StreamDecoder(self.tok, at_start=False)

    def __call__(self, tokens: tuple[int, ...], logprobs: tuple[TokenLogprob, ...] = ()) -> StopReason | None:
        for i, t in enumerate(tokens):
            if self.stopped_at >= 0:
                break
            self.tokens.append(t)
            if logprobs:
                self.logprobs.append(logprobs[i])
            self.unsent_tokens += 1
            before = len(self.text)
            if t not in self.eos_ids:  # the end-of-turn token is not text
                self.text += self._decoder.push(t)
            self._ends.append(len(self.text))
            self._find(before)
        if self.stopped_at >= 0:
            self._hand_on(self.stopped_at)
            return StopReason.STOP
        self._hand_on(len(self.text) - self._held())
        return StopReason.CANCELLED if self.cancel.is_set() else None

    def finish(self) -> None:
        """The generation ended (not by a stop string): what was held back is final."""
        if self.stopped_at < 0:
            before = len(self.text)
            self.text += self._decoder.flush()
            self._find(before)
        self._hand_on(self.stopped_at if self.stopped_at >= 0 else len(self.text))

    @property
    def final_text(self) -> str:
        return self.text[: self.stopped_at] if self.stopped_at >= 0 else self.text

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
            if self.on_text is not None:
                lps = tuple(self.logprobs[len(self.tokens) - self.unsent_tokens :]) if self.logprobs else ()
                self.on_text(self.text[self.sent : max(upto, self.sent)], self.unsent_tokens, lps)
            self.sent, self.unsent_tokens = max(upto, self.sent), 0


def _occurrences(text: str, s: str, lo: int) -> Iterator[int]:
    i = text.find(s, lo)
    while i >= 0:
        yield i
        i = text.find(s, i + 1)


def with_tool_calls(c: Completion, tools: Sequence[dict] | None) -> Completion:
    """The completion with the calls of the functions `tools` offers parsed out of its text
    (lever.model.tool_calls); None: no tools, the completion as it is."""
    if not tools:
        return c
    text, calls = parse_calls(c.text, _names(tools))
    return attrs.evolve(c, text=text, tool_calls=tuple(calls))


def with_call_stream(chunks: Iterator[Chunk], tools: Sequence[dict] | None) -> Iterator[Chunk]:
    """A stream whose text stops where a tool call may begin; the last chunk carries the rest
    of the text and the calls of the functions `tools` offers (lever.model.tool_calls.CallStream)."""
    if not tools:
        yield from chunks
        return
    calls = CallStream(_names(tools))
    for chunk in chunks:
        text = calls.push(chunk.text)
        if chunk.finish_reason is not None:
            rest, found = calls.finish()
            text += rest
            chunk = attrs.evolve(chunk, tool_calls=tuple(found))
        yield attrs.evolve(chunk, text=text)


def _names(tools: Sequence[dict]) -> frozenset[str]:
    return frozenset(t["function"]["name"] for t in tools)


def reply_message(text: str, calls: tuple[ToolCall, ...]) -> dict:
    """The assistant's message of a reply, as the conversation keeps it."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": [tc.as_openai() for tc in calls]}
