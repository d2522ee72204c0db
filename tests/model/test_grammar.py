"""Structured output (lever.model.grammar): masks for any path of a tree, equal to a fresh
matcher's; speculative output under a grammar equal to constrained autoregressive output (an
independent loop here, the target's logits one position at a time), greedy on the shipped pair
and JSON-schema on the Qwen pair; no draft child the grammar forbids; bad grammars one line."""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest

import lever
from lever.config import load_config
from lever.errors import LeverError
from lever.model.generate import prefill
from lever.model.grammar import Adapter, Grammar, GrammarError
from lever.model.transformer import Model
from lever.shipped import shipped

PROMPT = "def parse_args(argv):"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False}
DIGITS = 'start: "x = " /[0-9]{1,3}/ ("+" /[0-9]{1,3}/)*'


@pytest.fixture(scope="module")
def llm():
    with lever.load(shipped("default.toml")) as m:
        yield m


def fresh_mask(g: Grammar, path: list[int], n_vocab: int) -> np.ndarray:
    m = llguidance.LLMatcher(Adapter.of(g.tok).ll, g.text)
    for t in path:
        assert m.consume_token(t)
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little").view(bool)
    out = np.zeros(n_vocab, bool)
    out[: g.tok.vocab_size] = bits[: g.tok.vocab_size]
    return out


def test_masks_along_any_path_equal_a_fresh_matchers(llm):
    tok = llm.tokenizer
    g = Grammar.lark(tok, DIGITS)
    c = g.constraint(tok.vocab_size + 3)  # rows past the vocabulary (padding) are never allowed
    a = tok.encode("x = 12+7", add_bos=False)
    b = tok.encode("x = 3+45+6", add_bos=False)
    for path in ([], a, b[:2], a[:3], b, a[:1], []):  # back and forth, as a tree's nodes come
        got = c.mask(path)
        assert np.array_equal(got, fresh_mask(g, path, tok.vocab_size + 3)), path
        assert not got[tok.vocab_size :].any()
    assert c.stats.lookups == 7 and c.stats.masks < sum(len(p) + 1 for p in ([], a, b[:2], a[:3], b, a[:1], []))
    bad = tok.encode("x = a", add_bos=False)  # refused on the way: a dead path allows nothing
    assert not c.mask(bad).any() and not c.mask([*bad, *a]).any()
    assert np.array_equal(c.mask(a), fresh_mask(g, a, tok.vocab_size + 3))  # the matcher was never broken


def test_a_random_tree_of_paths_gets_a_fresh_matchers_masks(llm):
    """Paths grown at random from allowed tokens, visited in random order (end tokens included:
    nothing follows one), as Draft and Accept ask for them."""
    import random

    tok = llm.tokenizer
    g = Grammar.lark(tok, DIGITS)
    c = g.constraint(tok.vocab_size)
    eos = set(tok.eos_ids)
    rng = random.Random(7)
    paths: list[list[int]] = [[]]
    for _ in range(300):
        p = rng.choice(paths)
        got = c.mask(p)
        ended = any(t in eos for t in p)
        assert np.array_equal(got, np.zeros_like(got) if ended else fresh_mask(g, p, tok.vocab_size)), p
        if got.any():
            paths.append([*p, int(rng.choice(np.flatnonzero(got)))])
    assert any(p and p[-1] in eos for p in paths) and max(map(len, paths)) > 6


@pytest.mark.parametrize("seed", range(6))
def test_masks_along_random_trees_equal_a_fresh_matchers_for_generated_schemas(llm, seed):
    """Grammars that stop (a closed object allows only the end token), paths that end in one
    and are walked back from: every mask equals that of a fresh matcher walking the path (the
    end token never given to it). llguidance's rollback past an end token it took where the
    grammar had stopped undid one token too many (issue 44): this walk found it."""
    import random

    from tests.model.schemas import schemas

    tok = llm.tokenizer
    eos = set(tok.eos_ids)
    rng = random.Random(seed)
    closing = np.array([bool(tok.token_bytes(i)) and set(tok.token_bytes(i)) <= set(b'"}],: 0123456789')
                        for i in range(tok.vocab_size)])
    ended = 0
    for schema in schemas(seed, 4):
        g = llm.grammars.get(json_schema=schema)
        c = g.constraint(tok.vocab_size)
        paths: list[list[int]] = [[]]
        for _ in range(150):
            p = paths[-1] if rng.random() < 0.7 else rng.choice(paths)  # deep, and back and forth
            got = c.mask(p)
            ended = any(t in eos for t in p)
            assert np.array_equal(got, np.zeros_like(got) if ended else fresh_mask(g, p, tok.vocab_size)), p
            if got.any():
                allowed = np.flatnonzero(got)
                ends = [t for t in allowed if t in eos]
                shut = allowed[closing[allowed]]
                # the end token when it may come, half the time, and tokens that close strings and
                # objects often: the walk goes through stopped grammars and back
                if ends and rng.random() < 0.5:
                    t = rng.choice(ends)
                else:
                    t = rng.choice(shut) if len(shut) and rng.random() < 0.7 else rng.choice(allowed)
                paths.append([*p, int(t)])
        ended += sum(bool(p) and p[-1] in eos for p in paths)
    assert ended  # the walks went through texts the grammar accepts whole


class GivesUp:
    """A matcher that enters the engine's error state after `after` tokens, as a grammar past
    the engine's limits does mid-generation."""

    def __init__(self, real, after: int):
        self.real, self.after, self.n = real, after, 0

    def consume_token(self, t):
        self.n += 1
        return self.real.consume_token(t)

    def consume_tokens(self, ts):
        self.n += len(ts)
        return self.real.consume_tokens(ts)

    def deep_copy(self):
        copy = GivesUp(self.real.deep_copy(), self.after)
        copy.n = self.n
        return copy

    def compute_bitmask(self):
        return self.real.compute_bitmask()

    def is_error(self):
        return self.n >= self.after

    def get_error(self):
        return "lexer error: too many expressions constructed" if self.is_error() else ""


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_the_engine_gives_up_on_is_an_error_never_free_text(llm, monkeypatch, temperature):
    g = llm.grammars.get(json_schema=SCHEMA)
    monkeypatch.setattr(Grammar, "fresh_matcher", lambda self: GivesUp(self._matcher.deep_copy(), 3))
    with pytest.raises(GrammarError) as e:
        llm.generate(PROMPT, max_tokens=24, grammar=g, temperature=temperature, seed=3)
    assert str(e.value) == ("json_schema: the grammar engine gave up after 3 generated tokens: lexer error: too many "
                            "expressions constructed")


def test_a_sentencepiece_vocabulary_follows_the_grammar(stories):
    """Its tokens carry SentencePiece's space: the engine sees the GGUF's bytes, and forced
    text is tokenized without a space it never had (it allowed " a" for "a", issue 44)."""
    with lever.load(target=stories, draft=stories, n_ctx=256) as s:
        assert s.generate("Once upon a time", max_tokens=12, grammar='root ::= "a"{5,5}').text == "aaaaa"
        c = s.generate("Once upon a time", max_tokens=24, json_schema={
            "type": "object", "properties": {"done": {"type": "boolean"}}, "required": ["done"],
            "additionalProperties": False})
        assert json.loads(c.text).keys() == {"done"}


def constrained_ar(model: Model, ids: list[int], grammar: Grammar, n: int, eos: frozenset[int]) -> list[int]:
    """Constrained autoregressive greedy decoding, written out: mask, argmax, consume."""
    m = llguidance.LLMatcher(Adapter.of(grammar.tok).ll, grammar.text)
    cache = model.new_cache(len(ids) + n + 1)
    hidden = prefill(model, cache, ids)
    out = []
    for _ in range(n):
        logits = model.logits(hidden[None])[0]
        allowed = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little").view(bool)
        logits = np.where(allowed[: logits.size], logits, -np.inf)
        tok = int(np.argmax(logits))
        out.append(tok)
        if tok in eos:
            break
        assert m.consume_token(tok)
        hidden = prefill(model, cache, [tok])
    return out


@pytest.mark.parametrize("which", ["lark", "json_schema"])
def test_speculative_output_under_a_grammar_is_constrained_autoregressive_output(llm, which):
    kw = {"grammar": DIGITS} if which == "lark" else {"json_schema": SCHEMA}
    spec = llm.generate(PROMPT, max_tokens=40, **kw)
    grammar = llm.grammars.get(**kw)
    model = Model(load_config(shipped("default.toml")).model.target)
    ref = constrained_ar(model, llm.tokenizer.encode(PROMPT), grammar, 40, frozenset(llm.tokenizer.eos_ids))
    assert list(spec.tokens) == ref
    assert spec.stats.output.tokens_per_pass > 1  # it speculated
    flash_ar = lever.load(shipped("default.toml"), kind="flash-ar", overrides=['pipeline.baseline=""'])
    with flash_ar:
        assert flash_ar.generate(PROMPT, max_tokens=40, **kw).tokens == spec.tokens
    free = llm.generate(PROMPT, max_tokens=40)
    assert free.tokens != spec.tokens  # the grammar changed the text


def test_sampled_output_follows_the_grammar(llm):
    for seed in range(4):
        c = llm.generate(PROMPT, max_tokens=24, grammar=DIGITS, temperature=1.0, seed=seed)
        text = c.text
        assert text.startswith("x = ") and all(ch.isdigit() or ch == "+" for ch in text[4:]), text


def test_draft_children_are_only_tokens_the_grammar_allows(llm):
    from lever.stages.draft import Drafter

    calls = []
    grammar = Grammar.lark(llm.tokenizer, DIGITS)
    original = Drafter.expand

    def spy(self, req):
        exp = original(self, req)
        if self.constraint is not None:
            calls.append((self, exp))
        return exp

    Drafter.expand = spy
    try:
        llm.generate(PROMPT, max_tokens=20, grammar=grammar)
    finally:
        Drafter.expand = original
    assert calls
    digits_or_plus = {i for i in range(llm.tokenizer.vocab_size)
                      if llm.tokenizer.token_bytes(i) and all(ch in b"0123456789+x =" for ch in
                                                               llm.tokenizer.token_bytes(i))}
    for _, exp in calls:
        proposed = exp.child_tokens[exp.child_probs > 0]
        assert set(proposed.tolist()) <= digits_or_plus | set(llm.tokenizer.eos_ids)


@pytest.mark.parametrize("kw, words", [
    ({"grammar": "start: (("}, "^grammar: "), ({"grammar": ""}, "^grammar: must be a non-empty string"),
    ({"json_schema": "{not json"}, "^json_schema: not valid JSON"),
    ({"json_schema": [1]}, "^json_schema: a JSON Schema is an object"),
    ({"grammar": DIGITS, "json_schema": SCHEMA}, "^grammar: give a grammar or a json_schema, not both"),
])
def test_a_bad_grammar_is_one_line_naming_it(llm, kw, words):
    with pytest.raises(LeverError, match=words) as e:
        llm.generate(PROMPT, max_tokens=4, **kw)
    assert "\n" not in str(e.value)


def test_without_grammars_a_grammar_is_refused_and_the_plan_holds_none(llm):
    """lever.load(grammars=False) (lever serve --no-grammars): no grammar's bytes in the memory
    plan, a call bringing one refused in one line naming the flag, a plain call as with them."""
    assert llm.memory_plan().grammar_bytes > 0
    with lever.load(shipped("default.toml"), grammars=False) as plain:
        assert plain.memory_plan().grammar_bytes == 0
        assert plain.memory_plan().total_bytes < llm.memory_plan().total_bytes
        for kw in ({"grammar": DIGITS}, {"json_schema": SCHEMA}):
            with pytest.raises(LeverError, match="^grammar: structured output is off here .*--no-grammars") as e:
                plain.generate(PROMPT, max_tokens=4, **kw)
            assert "\n" not in str(e.value)
        assert plain.generate(PROMPT, max_tokens=8).tokens == llm.generate(PROMPT, max_tokens=8).tokens


def test_a_gbnf_grammar_is_read_too(llm):
    c = llm.generate(PROMPT, max_tokens=12, grammar='root ::= "x = " [0-9]+')
    assert c.text.startswith("x = ") and c.text[4:].isdigit()


@pytest.mark.parametrize("n_gen", [64])
def test_qwen_json_schema_is_valid_json_and_constrained_greedy(qwen_target, qwen_draft, n_gen):
    with lever.load(target=qwen_target, draft=qwen_draft, n_ctx=512) as q:
        messages = [{"role": "user", "content": "Give a name and a number as JSON."}]
        c = q.chat(messages, max_tokens=n_gen, json_schema=SCHEMA)
        data = json.loads(c.text)
        assert set(data) == {"name", "n"} and isinstance(data["n"], int)
        model = Model(qwen_target)
        ids = q.encode_chat(messages)
        ref = constrained_ar(model, ids, q.grammars.get(json_schema=SCHEMA), n_gen, frozenset(q.tokenizer.eos_ids))
        assert list(c.tokens) == ref
