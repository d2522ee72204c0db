"""A conversation kept in both models' KV caches between calls (`LLM.session()`).

Beside the LLM, which runs its calls: each call's prompt is the whole conversation, and the
prefix the caches already hold is not prefilled again; a server's clients keep theirs apart
(`switch`), the ones leaving in a prefix cache (lever.pipelines.prefix_cache).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol

import attrs

from lever.api.call import Call, Chunk, Completion
from lever.errors import LeverError
from lever.gguf.chat_template import check_messages
from lever.gguf.identity import ModelIdentity
from lever.pipelines import saved_session
from lever.pipelines.batcher import Batcher
from lever.pipelines.compose import KVState
from lever.pipelines.engine import Engine
from lever.pipelines.prefix_cache import MIN_REUSE_TOKENS, KVSnapshot, PrefixCache, shared
from lever.pipelines.result import RunResult
from lever.pipelines.text import TextStream
from lever.pipelines.watch import RunWatch


class Runner(Protocol):
    """What a session needs of the LLM that opened it (lever.api.llm.LLM, one floor of the same
    unit: a session is made by it and runs through it, so the type is said here)."""

    engine: Engine

    def prepare(self, prompt: str | None = None, **args) -> Call: ...

    def run(self, call: Call, *, session: Session | None = None) -> Completion: ...

    def stream_call(self, call: Call, *, session: Session | None = None) -> Iterator[Chunk]: ...


@attrs.define
class Session:
    """A conversation kept in both models' KV caches between calls: each call's prompt is the
    whole text (a chat's whole conversation, rendered again), and the prefix the caches already
    hold is not prefilled again, so a second turn prefills only its new tokens. Editing or
    dropping messages (`rewind`) just makes that prefix shorter. The caches live as long as the
    session: one pair, the size the memory plan gives a run."""

    llm: Runner
    messages: list[dict] = attrs.field(factory=list)  # the conversation so far, replies included
    ids: list[int] = attrs.field(factory=list)  # the text both caches hold, token by token
    kv: KVState | None = None
    last_cached: int = 0  # prompt tokens the last call took from the caches
    client: object = None  # whose text the caches hold (a server's API key; None for every in-process call)
    cache: PrefixCache | None = None  # other conversations kept between calls (a server's); None: this one alone
    lock: threading.Lock = attrs.field(factory=threading.Lock, eq=False)  # one call at a time in these caches

    @property
    def n_cached(self) -> int:
        return self.kv.n_rows if self.kv is not None else 0

    def generate(self, prompt: str, **args) -> Completion:
        """A completion of `prompt`, the session's whole text so far (not only what is new)."""
        return self.llm.run(self.llm.prepare(prompt, **args), session=self)

    def stream(self, prompt: str, **args) -> Iterator[Chunk]:
        return self.llm.stream_call(self.llm.prepare(prompt, **args), session=self)

    def chat(self, messages: Sequence[dict], **args) -> Completion:
        """The reply to the conversation with `messages` added; the reply joins it (its tool
        calls too, as an assistant message with `tool_calls`, which the template renders back).
        `tools` and `tool_choice` as LLM.chat's, for this call: give them on every call that
        offers them, as an OpenAI client does (the rendered text, and so the reused prefix, has them)."""
        c = self.llm.run(self._turn(messages, args), session=self)
        self.messages.append(reply_message(c.text, c.tool_calls))
        return c

    def stream_chat(self, messages: Sequence[dict], **args) -> Iterator[Chunk]:
        call = self._turn(messages, args)  # checked here, at the call, not at the first next()

        def chunks() -> Iterator[Chunk]:
            text = []
            for chunk in self.llm.stream_call(call, session=self):
                text.append(chunk.text)
                if chunk.finish_reason is not None:
                    self.messages.append(reply_message("".join(text), chunk.tool_calls))
                yield chunk

        return chunks()

    def rewind(self, n_messages: int) -> None:
        """Keeps the first n_messages of the conversation (to edit the last one, rewind past it
        and chat again); the caches keep what the shorter text still shares with them."""
        if not 0 <= n_messages <= len(self.messages):
            raise LeverError(f"rewind: n_messages must be in [0, {len(self.messages)}], got {n_messages}")
        del self.messages[n_messages:]

    def reset(self) -> None:
        self.messages.clear()
        self.ids, self.kv = [], None

    def switch(self, ids: list[int], client: object) -> None:
        """Before a call of `client` with prompt `ids` (holding this session's lock): the caches should
        hold that client's conversation sharing the most with `ids`. Another client's text is
        never reused; with a prefix cache, the conversation leaving is kept there and a better
        one of this client's comes back from it (lever.pipelines.prefix_cache)."""
        same = self.client == client
        live = shared(self.ids, ids) if same and self.kv is not None else 0
        back = self.cache.take(client, ids, at_least=live) if self.cache is not None else None
        # the live conversation leaves, or the call would cut much of it: keep a copy first
        leaving = back is not None or not same or len(self.ids) - live > MIN_REUSE_TOKENS
        if self.cache is not None and self.kv is not None and self.ids and leaving:
            self.cache.put(self.client, KVSnapshot.of(self.kv, self.ids))
        if back is not None:
            if self.kv is None:
                self.kv = self.llm.engine.new_kv()
            back.restore(self.kv)
            self.messages.clear()
            self.ids, self.client = list(back.ids), client
        elif not same:
            self.reset()
            self.client = client
        # else: this client's live conversation shares the most; the run keeps what it shares

    def close(self) -> None:
        self.reset()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def save(self, path: str | os.PathLike) -> None:
        """The conversation and the caches' rows, to msgpack (lever.pipelines.saved_session)."""
        with self.lock:
            saved_session.write(path, messages=self.messages, ids=self.ids, kv=self.kv, **self._identities())

    def load(self, path: str | os.PathLike) -> None:
        """A saved session of the same model pair: its conversation goes on from its caches."""
        with self.lock:
            kv = self.llm.engine.new_kv()
            messages, ids = saved_session.read(path, kv=kv, n_vocab=self.llm.engine.plan.spec.n_vocab,
                                               **self._identities())
            self.messages, self.ids, self.kv = messages, ids, kv

    def _identities(self) -> dict[str, ModelIdentity | None]:
        """The pair's files, which a saved session is tied to (the draft's when it runs)."""
        p = self.llm.engine.plan
        return {"target": ModelIdentity.of(p.target_file.path),
                "draft": ModelIdentity.of(p.draft_file.path) if p.draft_file is not None else None}

    def _turn(self, messages: Sequence[dict], args: dict) -> Call:
        """The call of a turn: the conversation with `messages` added, which join it."""
        added = check_messages(messages) if messages else []
        call = self.llm.prepare(messages=self.messages + added, **args)
        self.messages.extend(added)
        return call

    def run(self, call: Call, text: TextStream, watch: RunWatch | None = None,
            batcher: Batcher | None = None) -> tuple[RunResult, int]:
        """The engine's run of `call` from what the caches share with its ids (called in one of
        the LLM's lanes, holding this session's lock), its passes shared through `batcher` when
        given. Returns the run and how many prompt tokens came from the caches."""
        ids = list(call.ids)
        # at least one token is prefilled: its logits start the reply
        common = min(shared(ids, self.ids[: self.n_cached]), len(ids) - 1)
        kv, kept = self.kv, []
        if kv is not None:
            kv.truncate(common)
        self.ids, self.kv = [], None  # until the run ends well, the caches are in flux
        res = self.llm.engine.run(call.request(text, watch=watch, kv=kv, cached=common, batcher=batcher),
                                  on_kv=kept.append)
        self.kv = kept[0]
        self.ids = (ids + res.tokens)[: self.kv.n_rows]
        self.last_cached = common
        return res, common


def reply_message(text: str, calls) -> dict:
    """The assistant's message of a reply, as the conversation keeps it."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": [tc.as_openai() for tc in calls]}
