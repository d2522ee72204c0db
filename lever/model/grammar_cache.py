"""The grammars an open pipeline keeps compiled, bounded by the bytes they hold.

Above lever.model.grammar, below the API (lever.api.LLM keeps one): a server's clients send the
same schema again and again, so a compiled grammar is kept by its text and found there; each is
compiled in the compiler's child first (lever.model.grammar_child), which bounds the compile and
measures what it holds, and the cache keeps at most `capacity_bytes` of them, the least recently
used leaving first. What the cache may hold, one generation's matcher and the child are the
grammar's part of the memory plan (`plan_bytes`).
"""

from __future__ import annotations

import collections
import json
import threading

import attrs

from lever.gguf.tokenizer import Tokenizer
from lever.model.grammar import (
    MAX_CACHED_MASKS,
    MAX_CHECKPOINTS,
    MAX_LEXER_STATES,
    Adapter,
    Grammar,
    Source,
    check_schema_value,
    compile_args,
    matcher_limits,
)
from lever.model.grammar_child import CompileProcess, CompileRefused, child_bytes

CACHE_BYTES = 32 << 20  # compiled grammars kept (a tool's schema: tens of kB; 1,000 properties: 4 MB)
MAX_GRAMMARS = 64  # and at most this many
LEXER_STATE_BYTES = 2 << 10  # the engine's figure for one lexer state (1-2 kB)
CHECKPOINT_BYTES = 256 << 10  # a saved copy of a matcher (58 kB at 700 tokens of JSON, measured; it grows with them)


def generation_bytes(n_vocab: int) -> int:
    """What one constrained generation adds beside its grammar: the matcher's lexer states at
    their limit, the masks it keeps (n_vocab / 8 bytes each), its saved copies."""
    return MAX_LEXER_STATES * LEXER_STATE_BYTES + MAX_CACHED_MASKS * (n_vocab // 8 + 1) + \
        MAX_CHECKPOINTS * CHECKPOINT_BYTES


def plan_bytes(n_vocab: int, cache_bytes: int = CACHE_BYTES) -> int:
    """Structured output's part of a memory plan: a cache of `cache_bytes` full, one
    generation's matcher and masks, the compiler's child."""
    return cache_bytes + generation_bytes(n_vocab) + child_bytes(n_vocab)


def one_grammar_bytes(g: Grammar, n_vocab: int) -> int:
    """One compiled grammar's part of a memory plan (`lever run`: compiled before the models
    load, its child gone): what it holds and one generation's matcher and masks."""
    return g.nbytes + generation_bytes(n_vocab)


@attrs.define
class GrammarCache:
    """Compiled grammars by their text, for one tokenizer; safe from several threads (a
    server's request threads): one compile at a time, lookups beside it."""

    tok: Tokenizer
    capacity_bytes: int = CACHE_BYTES
    _compiler: CompileProcess | None = None
    _kept: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)  # key -> Grammar, oldest first
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _compiling: threading.Lock = attrs.field(factory=threading.Lock)
    compiled: int = 0
    hits: int = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(g.nbytes for g in self._kept.values())

    def plan_bytes(self) -> int:
        return plan_bytes(self.tok.vocab_size, self.capacity_bytes)

    def get(self, grammar=None, json_schema=None) -> Grammar | None:
        """A call's `grammar` (Lark or GBNF text, a lever.model.grammar.Source, or a Grammar)
        or `json_schema` (a dict, or its JSON text), compiled; None when neither is given.
        GrammarError, naming the argument, for one past the bounds or refused by the engine."""
        plain = isinstance(grammar, (str, Source)) or isinstance(json_schema, (str, dict))
        if isinstance(grammar, Grammar) or (grammar is None) == (json_schema is None) or not plain:
            return compile_args(self.tok, grammar, json_schema)  # already compiled, none, both or not one: refused
        key = _key(grammar, json_schema)
        with self._lock:
            got = self._kept.get(key)
            if got is not None:
                self._kept.move_to_end(key)
                self.hits += 1
                return got
        with self._compiling:  # one compile at a time: the child does one, and a burst of one schema compiles once
            with self._lock:
                got = self._kept.get(key)
            if got is None:
                got = compile_args(self.tok, grammar, json_schema, self._child())
                self.compiled += 1
                self._keep(key, got)
        return got

    def _keep(self, key, g: Grammar) -> None:
        """Keeps `g`, the least recently used leaving while the cache is over its bounds (one
        grammar always fits: MAX_COMPILED_BYTES is under CACHE_BYTES)."""
        with self._lock:
            self._kept[key] = g
            while len(self._kept) > 1 and (len(self._kept) > MAX_GRAMMARS or
                                           sum(x.nbytes for x in self._kept.values()) > self.capacity_bytes):
                self._kept.popitem(last=False)

    def _child(self) -> CompileProcess:
        if self._compiler is None:
            tok = self.tok
            self._compiler = CompileProcess(tok.vocab_size, dict(tok.specials), tok.eos_id, limits=matcher_limits())
        return self._compiler

    def start(self) -> None:
        """Starts the compiler's child and builds the engine's view of the vocabulary now (a
        server, before its first request: a second on Qwen's vocabulary); a child that does not
        start is each grammar's refusal later, in its own words."""
        Adapter.of(self.tok)
        try:
            self._child().check('start: "a"')
        except CompileRefused:
            pass

    def close(self) -> None:
        """Stops the child (a compile under way fails at once); the kept grammars stay usable."""
        if self._compiler is not None:
            self._compiler.close()


def _key(grammar, json_schema) -> tuple:
    """The cache's key of a call's grammar: its kind and text (a schema as canonical JSON,
    once it is known to be JSON within the bounds)."""
    if isinstance(grammar, Source):
        return ("grammar", grammar.text, grammar.where)
    if grammar is not None:
        return ("grammar", grammar, "grammar")
    if isinstance(json_schema, str):
        return ("json_schema", json_schema)
    check_schema_value(json_schema)  # JSON, bounded, no cycle: json.dumps recurses per level
    return ("json_schema", json.dumps(json_schema, sort_keys=True))
