"""Structured output: a grammar that says which tokens may come next, along any path of a tree.

Sits beside lever.model.sampling, below the stages: Accept masks the target's logits with it at
every token it emits (so greedy output is constrained autoregressive greedy output, and a sample
is drawn from the constrained distribution exactly), and Draft masks the draft's logits at every
node it expands (so no tree grows a branch the grammar forbids). A tree's nodes are paths, not
one text: `Constraint.mask(path)` answers for any token sequence since the generation began, by
moving one matcher there (back to the common prefix from a saved copy, forward over the rest)
and caching the masks it computed, so Accept finds the masks Draft already paid for.

The grammar engine is llguidance (Microsoft's, in Rust, on PyPI with no dependencies): it takes
JSON schemas, Lark grammars and regular expressions, builds its token trie from the vocabulary
(`Adapter`: the GGUF's token bytes, checked), computes a mask in tens to hundreds of microseconds
on a 150k vocabulary, and rolls back any number of tokens, which a tree needs.
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
from lever.model import bounds, gbnf
from lever.model.grammar_child import CompileProcess, CompileRefused
from lever.nesting import JsonValueError, check_json, text_depth

# whitespace between JSON tokens bounded as llama.cpp's json-schema-to-grammar bounds it (a space,
# or a newline and up to 20 of indent), so a model fond of blank space still closes its object
JSON_OPTIONS = {"whitespace_pattern": r"[ ]?|\n[ \t]{0,20}"}
# a matcher's lexer states (the engine's default is 250,000: up to ~500 MB) and the lexer work of
# one mask (its default, ~15 ms); a generation past either ends with a GrammarError
MAX_LEXER_STATES = 10_000
STEP_LEXER_FUEL = 200_000
MAX_COMPILED_BYTES = 16 << 20  # what one compiled grammar may hold (1,000 properties: 4 MB)
CHECKPOINT_EVERY = 8  # tokens of a path between saved copies of the matcher (Constraint._walk)
MAX_CHECKPOINTS = 16  # copies kept (each 60-100 kB at hundreds of tokens): back 128 tokens from copies
MAX_CACHED_MASKS = 512  # masks kept per generation (each n_vocab / 8 bytes: 19 KB for a 152k vocabulary)
_ADAPTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> Adapter, built once


class GrammarError(LeverError):
    """A grammar refused, or one the engine gave up on while generating: one line naming the
    argument it came in (`field`: "grammar", "json_schema", "response_format", "tool_choice")
    and, for a schema given as Python objects, the place in it at fault (`at`: ".properties.a")."""

    def __init__(self, field: str, why: str, at: str = ""):
        super().__init__(f"{field}{at}: {why}")
        self.field, self.why, self.at = field, why, at


def _llg():
    try:
        import llguidance
    except ImportError:  # a broken install: the package is a dependency
        raise LeverError("structured output needs the llguidance package: pip install llguidance") from None
    return llguidance


@attrs.frozen
class Adapter:
    """The grammar engine's view of a GGUF's vocabulary, for both vocabulary families.

    llguidance's own adapter for `tokenizers` definitions, fed the one Lever builds from the
    GGUF (lever.gguf.tokenizer), then checked byte for byte against the GGUF's token bytes: its
    tokenize is byte-exact (SentencePiece's space prefix only where the text has a space), which
    the engine relies on when it tokenizes the bytes a grammar forces. A Python callback over
    Lever's `encode` was not: `encode("a")` gives " a" on a SentencePiece vocabulary, so the
    engine allowed the forced text's first token with a space it never had (issue 44).
    `never`: tokens the engine would take as text but decoding renders as nothing (unused
    slots), never allowed."""

    ll: object = attrs.field(repr=False)  # llguidance.LLTokenizer
    never: np.ndarray = attrs.field(repr=False)  # (n,) token ids

    @staticmethod
    def of(tok: Tokenizer) -> Adapter:
        got = _ADAPTERS.get(tok)
        if got is None:
            got = _ADAPTERS[tok] = Adapter._build(tok)
        return got

    @staticmethod
    def _build(tok: Tokenizer) -> Adapter:
        llg = _llg()
        try:
            ll = llg.LLTokenizer(tok.hf_json(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_ids) or None)
        except Exception as e:  # its reason, in one line
            raise LeverError(f"{tok}: the grammar engine cannot read this vocabulary: {_one_line(e)}") from None
        specials = set(tok.specials.values())
        never = []
        for i in range(tok.vocab_size):
            own, theirs = tok.token_bytes(i), None if ll.is_special_token(i) else ll.decode_bytes([i])
            if i in specials:
                ok = theirs is None
            elif own[:1] == b"\xff":  # the engine's own marker of special tokens: never text it produces
                ok = theirs in (None, b"")
            else:
                ok = theirs == own
            if not ok:
                raise LeverError(f"{tok}: the grammar engine reads token {i} as {theirs!r}, the GGUF as {own!r}")
            if theirs and not tok.piece(i):
                never.append(i)
        return Adapter(ll, np.asarray(never, np.int64))


@attrs.frozen
class Grammar:
    """A compiled constraint for one tokenizer: what `Constraint` masks with. `source` names it
    in errors and figures ("json_schema", "response_format", "grammar", "tool_choice")."""

    source: str
    text: str = attrs.field(repr=False)  # llguidance's grammar (its JSON form)
    tok: Tokenizer = attrs.field(repr=False, eq=False)
    _matcher: object = attrs.field(repr=False, eq=False, default=None, alias="matcher")  # compiled, never advanced
    nbytes: int = 0  # what the compiled grammar holds, measured in the compiler's child (0: compiled without one)

    @classmethod
    def json_schema(cls, tok: Tokenizer, schema: dict | str, where: str = "json_schema",
                    compiler: CompileProcess | None = None) -> Grammar:
        """JSON that a JSON Schema accepts (OpenAI's `response_format` json_schema). With a
        `compiler`, the grammar is compiled in its child first (lever.model.grammar_child)."""
        if isinstance(schema, str):
            if len(schema) > bounds.MAX_GRAMMAR_BYTES:  # chars: at least as many bytes
                raise GrammarError(where, f"{len(schema)} characters of JSON, over the bound of "
                                          f"{bounds.MAX_GRAMMAR_BYTES} bytes")
            if text_depth(schema) > bounds.MAX_SCHEMA_DEPTH:  # before json.loads recurses into it
                raise GrammarError(where, f"nests over {bounds.MAX_SCHEMA_DEPTH} levels deep")
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(where, f"not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError(where, f"a JSON Schema is an object, got {type(schema).__name__}")
        check_schema_value(schema, where)
        _bounded(where, bounds.check_schema, schema)
        return cls._compiled(tok, where, lambda g: g.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS),
                             compiler)

    @classmethod
    def json_object(cls, tok: Tokenizer, where: str = "response_format",
                    compiler: CompileProcess | None = None) -> Grammar:
        """Any JSON object (OpenAI's `response_format` json_object)."""
        return cls.json_schema(tok, {"type": "object"}, where, compiler)

    @classmethod
    def lark(cls, tok: Tokenizer, grammar: str, where: str = "grammar",
             compiler: CompileProcess | None = None) -> Grammar:
        """A Lark grammar (llguidance's dialect: `start: ...`); GBNF (llama.cpp's) is converted
        (lever.model.gbnf, linear in its size). Both are held to lever.model.bounds first."""
        if not isinstance(grammar, str):
            raise GrammarError(where, f"must be Lark or GBNF text (a str) or a compiled Grammar, got "
                                      f"{type(grammar).__name__}")
        if not grammar.strip():
            raise GrammarError(where, "must be a non-empty string")
        size = len(grammar.encode("utf-8", "replace"))
        if size > bounds.MAX_GRAMMAR_BYTES:
            raise GrammarError(where, f"{size} bytes, over the bound of {bounds.MAX_GRAMMAR_BYTES}")
        if "::=" in grammar:  # llama.cpp's GBNF
            n_rules = grammar.count("::=")
            if n_rules > bounds.MAX_RULES:
                raise GrammarError(where, f"{n_rules} rules, over the bound of {bounds.MAX_RULES}")
            try:
                grammar = gbnf.to_lark(grammar, max_depth=bounds.MAX_GROUP_DEPTH)
            except gbnf.GbnfError as e:
                raise GrammarError(where, f"GBNF: {e}") from None
        _bounded(where, bounds.check_lark, grammar)
        return cls._compiled(tok, where, lambda g: g.LLMatcher.grammar_from_lark(grammar), compiler)

    @classmethod
    def _compiled(cls, tok: Tokenizer, where: str, build, compiler: CompileProcess | None) -> Grammar:
        """The engine's grammar text from `build`, compiled (in `compiler`'s child first, which
        measures it) once into a matcher each generation copies (a copy is a microsecond; a
        compile, from a third of a millisecond up)."""
        llg = _llg()
        try:
            text = build(llg)
        except Exception as e:  # llguidance raises ValueError (and others) with its reason
            raise GrammarError(where, _one_line(e)) from None
        nbytes = 0
        if compiler is not None:
            try:
                nbytes = compiler.check(text)
            except CompileRefused as e:
                raise GrammarError(where, str(e)) from None
            if nbytes > MAX_COMPILED_BYTES:
                raise GrammarError(where, f"compiled, it holds {nbytes >> 20} MiB, over the bound of "
                                          f"{MAX_COMPILED_BYTES >> 20} MiB")
        matcher = llg.LLMatcher(Adapter.of(tok).ll, text, log_level=0, limits=llg.LLParserLimits(**matcher_limits()))
        if matcher.is_error():
            raise GrammarError(where, _one_line(matcher.get_error() or "not a grammar llguidance accepts"))
        return cls(where, text, tok, matcher=matcher, nbytes=nbytes)

    def fresh_matcher(self):
        """A matcher at the start of the text."""
        return self._matcher.deep_copy()

    def accepts(self, tokens: Sequence[int]) -> bool:
        """Whether the grammar accepts `tokens` as a whole text (no end token among them)."""
        m = self.fresh_matcher()
        return m.consume_tokens(list(tokens)) and m.is_accepting()

    def constraint(self, n_vocab: int) -> Constraint:
        """A fresh state for one generation, masks over a model's `n_vocab` logits (rows past the
        tokenizer's vocabulary, padding, are never allowed)."""
        return Constraint(self, n_vocab)


@attrs.frozen
class Source:
    """A Lark (or GBNF) grammar's text and the argument it came in, for errors: what a tool
    call's plan hands on (lever.model.tool_calls), to be compiled where grammars are."""

    text: str
    where: str


def compile_args(tok: Tokenizer, grammar=None, json_schema=None, compiler: CompileProcess | None = None
                 ) -> Grammar | None:
    """A call's `grammar` (Lark or GBNF text, a Source, or a Grammar) or `json_schema` (a
    dict, or its JSON text), compiled; None when neither is given."""
    if grammar is not None and json_schema is not None:
        raise GrammarError("grammar", "give a grammar or a json_schema, not both")
    if isinstance(grammar, Grammar):
        return grammar
    if isinstance(grammar, Source):
        return Grammar.lark(tok, grammar.text, grammar.where, compiler)
    if grammar is not None:
        return Grammar.lark(tok, grammar, compiler=compiler)
    return Grammar.json_schema(tok, json_schema, compiler=compiler) if json_schema is not None else None


def check_schema_value(schema, where: str = "json_schema") -> None:
    """A schema given as Python objects is JSON (string keys, finite numbers, no cycle) within
    the schema bounds of nesting and size, checked without recursing before anything serializes
    or compiles it (lever.nesting.check_json); a GrammarError naming `where` and the place."""
    try:
        check_json(schema, where, max_depth=bounds.MAX_SCHEMA_DEPTH)
    except JsonValueError as e:
        raise GrammarError(where, e.why, e.at) from None


def _bounded(where: str, check, value) -> None:
    try:
        check(value)
    except bounds.BoundError as e:
        raise GrammarError(where, str(e)) from None


def matcher_limits() -> dict:
    """The engine's own limits on a matcher (LLParserLimits' keywords): lexer states (its
    memory grows by them as a generation goes, 1-2 kB each), fuel per mask step (its time)."""
    return {"max_lexer_states": MAX_LEXER_STATES, "step_lexer_fuel": STEP_LEXER_FUEL}


def _one_line(e) -> str:
    """An engine's message in one line: its state dump (" <state> ...", llguidance's debug
    print of the parser) cut off, at most 300 characters."""
    text = " ".join(str(e).split())
    return text.split(" <state>")[0][:300]


@attrs.define
class ConstraintStats:
    masks: int = 0  # masks computed (not taken from the cache)
    mask_s: float = 0.0  # seconds computing them
    lookups: int = 0  # masks asked for


@attrs.define
class Constraint:
    """One generation's grammar state, for any path: `mask(path)` is the tokens allowed after
    `path` (the tokens generated so far, then a tree node's ancestors and itself), as a bool
    array over the model's vocabulary. An end token is allowed only where the grammar accepts
    the text; nothing follows it, nor a token the grammar refused on the way (Accept never walks
    such a path: its parent's mask excluded it, or the text ended; Draft grows nothing there).
    When the engine gives up (a grammar past its limits) or contradicts itself, `mask` raises
    GrammarError: the generation ends with that line, never with text the grammar did not check.
    Safe from several threads (Draft and Accept run in different ones)."""

    grammar: Grammar
    n_vocab: int
    stats: ConstraintStats = attrs.field(factory=ConstraintStats)
    _matcher: object = attrs.field(init=False, repr=False)
    _at: list[int] = attrs.field(factory=list)  # the tokens the matcher has consumed (never an end token)
    _marks: dict = attrs.field(factory=dict, repr=False)  # len(_at[:p]) -> a copy of the matcher there
    _cache: collections.OrderedDict = attrs.field(factory=collections.OrderedDict, repr=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _eos: frozenset = attrs.field(init=False, repr=False)
    _never: np.ndarray = attrs.field(init=False, repr=False)
    _failed: GrammarError | None = None

    def __attrs_post_init__(self):
        self._eos = frozenset(self.grammar.tok.eos_ids)
        self._never = Adapter.of(self.grammar.tok).never
        self._matcher = self.grammar.fresh_matcher()

    def mask(self, path: Sequence[int]) -> np.ndarray:
        """(n_vocab,) bool: the tokens the grammar allows after `path`."""
        with self._lock:
            if self._failed is not None:
                raise self._failed
            self.stats.lookups += 1
            key = tuple(path)
            bits = self._cached(key)
            if bits is None:
                try:
                    bits = self._walk(key)
                except GrammarError as e:
                    self._failed = e
                    raise
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
        new token against the mask before it is consumed: a refused token makes a dead path,
        and the matcher never enters its error state.

        Back is never llguidance's rollback. After one, a matcher that consumed several tokens
        before its next mask could sit in another state than a fresh matcher given the same
        tokens (a key's closing quote and a newline in one token, `"\\n`), and an end token
        taken where the grammar had stopped was not counted, so a rollback past it undid one
        token too many: masks one token behind the path, texts that differed call to call
        (issue 44). Back is a copy of the matcher saved at or before the common prefix (every
        CHECKPOINT_EVERY tokens of the path, the last MAX_CHECKPOINTS of them), or a fresh one,
        moved forward over tokens it took before: forward only, a microsecond a token.
        An end token is never consumed: whether it may come is the mask's own bit, and after
        one, nothing comes."""
        if any(t in self._eos for t in key):
            return b""
        at = self._at
        k = 0
        while k < min(len(at), len(key)) and at[k] == key[k]:
            k += 1
        if len(at) > k:
            self._back_to(k)
        n_tok = self.grammar.tok.vocab_size
        for t in key[k:]:
            here = self._here()
            if not (0 <= t < n_tok and here[t >> 3] >> (t & 7) & 1):
                return b""  # dead: nothing follows a refused token
            if not self._matcher.consume_token(t):
                raise self._gave_up(f"refused token {t} that its own mask allowed")
            at.append(t)
            if len(at) % CHECKPOINT_EVERY == 0:
                self._marks[len(at)] = self._matcher.deep_copy()
                while len(self._marks) > MAX_CHECKPOINTS:
                    del self._marks[min(self._marks)]
        return self._here()

    def _back_to(self, k: int) -> None:
        """The matcher at the first `k` tokens of the path it is on."""
        for p in [p for p in self._marks if p > k]:
            del self._marks[p]
        c = max(self._marks, default=0)
        m = self._marks[c].deep_copy() if c else self.grammar.fresh_matcher()
        if not m.consume_tokens(self._at[c:k]):  # each was consumed on the way here before
            raise self._gave_up("could not return to the text generated so far")
        self._matcher = m
        del self._at[k:]

    def _here(self) -> bytes:
        key = tuple(self._at)
        bits = self._cached(key)
        if bits is None:
            t0 = time.perf_counter()
            bits = self._matcher.compute_bitmask()
            self.stats.mask_s += time.perf_counter() - t0
            self.stats.masks += 1
            if self._matcher.is_error():
                raise self._gave_up(self._matcher.get_error())
            if bits.count(0) == len(bits):  # not even an end token: the engine is stuck
                raise self._gave_up("allows no token, not even the end of the text")
            self._cache[key] = bits
            if len(self._cache) > MAX_CACHED_MASKS:
                self._cache.popitem(last=False)
        return bits

    def _gave_up(self, why: str) -> GrammarError:
        n = len(self._at)
        return GrammarError(self.grammar.source, f"the grammar engine gave up after {n} generated tokens: "
                                                 f"{_one_line(why)}")

    def _unpack(self, bits: bytes) -> np.ndarray:
        out = np.zeros(self.n_vocab, bool)
        if bits:
            allowed = np.unpackbits(np.frombuffer(bits, np.uint8), bitorder="little").view(bool)
            n = min(self.n_vocab, self.grammar.tok.vocab_size, allowed.size)
            out[:n] = allowed[:n]
            out[self._never[self._never < self.n_vocab]] = False
        return out
