"""Structured output: a grammar that says which tokens may come next, along any path of a tree.

Sits beside lever.model.sampling, below the stages: Accept masks the target's logits with it at
every token it emits (so greedy output is constrained autoregressive greedy output, and a sample
is drawn from the constrained distribution exactly), and Draft masks the draft's logits at every
node it expands (so no tree grows a branch the grammar forbids). A tree's nodes are paths, not
one text: `Constraint.mask(path)` answers for any token sequence since the generation began, by
moving one matcher there (rolling back to the common prefix, consuming the rest) and caching the
masks it computed, so Accept finds the masks Draft already paid for.

The grammar engine is llguidance (Microsoft's, in Rust, on PyPI with no dependencies): it takes
JSON schemas, Lark grammars and regular expressions, builds its token trie from a plain list of
token bytes (here the GGUF's, via lever.gguf.tokenizer), computes a mask in tens of
microseconds on a 150k vocabulary, and rolls back any number of tokens, which a tree needs.
outlines-core (no dependencies either) compiles each schema to an index over the whole vocabulary
before the first token; xgrammar requires PyTorch, transformers and triton. Figures:
docs/measurements.md, 'Structured output'.
"""

from __future__ import annotations

import collections
import json
import threading
import time
import weakref
from collections.abc import Sequence

import attrs
import numpy as np

from lever.errors import LeverError
from lever.gguf.tokenizer import Tokenizer

# whitespace between JSON tokens bounded as llama.cpp's json-schema-to-grammar bounds it (a space,
# or a newline and up to 20 of indent), so a model fond of blank space still closes its object
JSON_OPTIONS = {"whitespace_pattern": r"[ ]?|\n[ \t]{0,20}"}
MAX_CACHED_MASKS = 512  # masks kept per generation (each n_vocab / 8 bytes: 19 KB for a 152k vocabulary)
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> llguidance's, built once


def _llg():
    try:
        import llguidance
    except ImportError:  # a broken install: the package is a dependency
        raise LeverError("structured output needs the llguidance package: pip install llguidance") from None
    return llguidance


def _ll_tokenizer(tok: Tokenizer):
    """llguidance's view of the GGUF's vocabulary: each token's bytes, control tokens marked
    with a leading 0xFF (as llguidance's own llama.cpp adapter does), the end-of-text tokens."""
    got = _TOKENIZERS.get(tok)
    if got is None:
        llg = _llg()
        specials = set(tok.specials.values())
        pieces = [b"\xff" + tok.token_bytes(i) if i in specials else tok.token_bytes(i) for i in range(tok.vocab_size)]

        class Wrapped:
            eos_token_id = tok.eos_id
            bos_token_id = tok.bos_id
            tokens = pieces
            special_token_ids = sorted(specials)

            def __call__(self, text):
                return tok.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text, add_bos=False)

        got = llg.LLTokenizer(llg.TokenizerWrapper(Wrapped()), eos_token=sorted(tok.eos_ids) or None)
        _TOKENIZERS[tok] = got
    return got


@attrs.frozen
class Grammar:
    """A compiled constraint for one tokenizer: what `Constraint` masks with. `source` names it
    in errors and figures ("json_schema", "json_object", "lark", "regex")."""

    source: str
    text: str = attrs.field(repr=False)  # llguidance's grammar (its JSON form)
    tok: Tokenizer = attrs.field(repr=False, eq=False)

    @classmethod
    def json_schema(cls, tok: Tokenizer, schema: dict | str, where: str = "json_schema") -> Grammar:
        """JSON that a JSON Schema accepts (OpenAI's `response_format` json_schema)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise LeverError(f"{where}: not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise LeverError(f"{where}: a JSON Schema is an object, got {type(schema).__name__}")
        return cls._checked(tok, where, lambda g: g.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS))

    @classmethod
    def json_object(cls, tok: Tokenizer, where: str = "response_format") -> Grammar:
        """Any JSON object (OpenAI's `response_format` json_object)."""
        return cls._checked(tok, where, lambda g: g.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                                        overrides=JSON_OPTIONS))

    @classmethod
    def lark(cls, tok: Tokenizer, grammar: str, where: str = "grammar") -> Grammar:
        """A Lark grammar (llguidance's dialect: `start: ...`); GBNF (llama.cpp's) is converted."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise LeverError(f"{where}: must be a non-empty string")
        if "::=" in grammar:  # llama.cpp's GBNF
            try:
                from llguidance.gbnf_to_lark import gbnf_to_lark

                grammar = gbnf_to_lark(grammar)
            except Exception as e:  # its parser's own messages
                raise LeverError(f"{where}: {_one_line(e)}") from None
        return cls._checked(tok, where, lambda g: g.LLMatcher.grammar_from_lark(grammar))

    @classmethod
    def regex(cls, tok: Tokenizer, pattern: str, where: str = "regex") -> Grammar:
        return cls._checked(tok, where, lambda g: g.LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def _checked(cls, tok: Tokenizer, where: str, build) -> Grammar:
        llg = _llg()
        try:
            text = build(llg)
        except Exception as e:  # llguidance raises ValueError (and others) with its reason
            raise LeverError(f"{where}: {_one_line(e)}") from None
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, _ll_tokenizer(tok))
        if is_error:
            raise LeverError(f"{where}: {_one_line(' '.join(messages) or 'not a grammar llguidance accepts')}")
        return cls(where, text, tok)

    def constraint(self, n_vocab: int) -> Constraint:
        """A fresh state for one generation, masks over a model's `n_vocab` logits (rows past the
        tokenizer's vocabulary, padding, are never allowed)."""
        return Constraint(self, n_vocab)


def compile_args(tok: Tokenizer, grammar=None, json_schema=None) -> Grammar | None:
    """A call's `grammar` (Lark or GBNF text, or a Grammar) or `json_schema` (a dict, or its
    JSON text), compiled; None when neither is given."""
    if grammar is not None and json_schema is not None:
        raise LeverError("grammar: give a grammar or a json_schema, not both")
    if isinstance(grammar, Grammar):
        return grammar
    if grammar is not None:
        return Grammar.lark(tok, grammar)
    return Grammar.json_schema(tok, json_schema) if json_schema is not None else None


def _one_line(e) -> str:
    return " ".join(str(e).split())[:300]


@attrs.define
class ConstraintStats:
    masks: int = 0  # masks computed (not taken from the cache)
    mask_s: float = 0.0  # seconds computing them
    lookups: int = 0  # masks asked for


@attrs.define
class Constraint:
    """One generation's grammar state, for any path: `mask(path)` is the tokens allowed after
    `path` (the tokens generated so far, then a tree node's ancestors and itself), as a bool
    array over the model's vocabulary. A path the grammar refused on the way, or past an end
    token, gets no token at all (Accept never walks it: its parent's mask excluded it, or the
    text ended; Draft grows nothing there).
    Safe from several threads (Draft and Accept run in different ones)."""

    grammar: Grammar
    n_vocab: int
    stats: ConstraintStats = attrs.field(factory=ConstraintStats)
    _matcher: object = attrs.field(init=False, repr=False)
    _at: list[int] = attrs.field(factory=list)  # the tokens the matcher has consumed
    _cache: collections.OrderedDict = attrs.field(factory=collections.OrderedDict, repr=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _eos: frozenset = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self):
        self._eos = frozenset(self.grammar.tok.eos_ids)
        llg = _llg()
        self._matcher = llg.LLMatcher(_ll_tokenizer(self.grammar.tok), self.grammar.text)
        if self._matcher.is_error():
            raise LeverError(f"{self.grammar.source}: {_one_line(self._matcher.get_error())}")

    def mask(self, path: Sequence[int]) -> np.ndarray:
        """(n_vocab,) bool: the tokens the grammar allows after `path`."""
        with self._lock:
            self.stats.lookups += 1
            key = tuple(path)
            bits = self._cached(key)
            if bits is None:
                bits = self._walk(key)
            return self._unpack(bits)

    def allows(self, path: Sequence[int], token: int) -> bool:
        return bool(self.mask(path)[token]) if 0 <= token < self.n_vocab else False

    def _cached(self, key: tuple[int, ...]) -> bytes | None:
        bits = self._cache.get(key)
        if bits is not None:
            self._cache.move_to_end(key)
        return bits

    def _walk(self, key: tuple[int, ...]) -> bytes:
        """Moves the matcher to `key` (back to the common prefix, then forward), checking each
        token against the mask before it is consumed: a refused token makes a dead path, and
        the matcher never enters its error state."""
        m, at = self._matcher, self._at
        k = 0
        while k < min(len(at), len(key)) and at[k] == key[k]:
            k += 1
        if len(at) > k:
            if not m.rollback(len(at) - k):
                raise LeverError(f"{self.grammar.source}: the grammar engine could not roll back {len(at) - k} tokens")
            del at[k:]
        for t in key[k:]:
            if at and at[-1] in self._eos:  # nothing follows the end of the text (and the engine
                return b""  # takes a second end token without counting it, so no rollback could undo it)
            here = self._here()
            if not (0 <= t < self.grammar.tok.vocab_size and here[t >> 3] >> (t & 7) & 1):
                return b""  # dead: nothing follows a refused token
            if not m.consume_token(t):
                return b""
            at.append(t)
        return b"" if at and at[-1] in self._eos else self._here()

    def _here(self) -> bytes:
        key = tuple(self._at)
        bits = self._cached(key)
        if bits is None:
            t0 = time.perf_counter()
            bits = self._matcher.compute_bitmask()
            self.stats.mask_s += time.perf_counter() - t0
            self.stats.masks += 1
            self._cache[key] = bits
            if len(self._cache) > MAX_CACHED_MASKS:
                self._cache.popitem(last=False)
        return bits

    def _unpack(self, bits: bytes) -> np.ndarray:
        out = np.zeros(self.n_vocab, bool)
        if bits:
            allowed = np.unpackbits(np.frombuffer(bits, np.uint8), bitorder="little").view(bool)
            n = min(self.n_vocab, self.grammar.tok.vocab_size, allowed.size)
            out[:n] = allowed[:n]
        return out
