"""Structured output holds on any schema, through every pipeline, for both vocabulary families.

Schemas from a seeded generator (tests/model/schemas.py: objects, arrays, enums, patterns,
nesting, optional fields) x prompts x pipelines (Flash-AR, Chain-SD, EdgeLLM-like, Lever, Lever
drafting ahead, Lever with the free sources, the free sources alone) x greedy and seeded
sampling, on the shipped pair (byte-level BPE) and on stories260K with a two-block copy of
itself as its draft (SentencePiece). Each reply:

- greedy: token for token the constrained autoregressive decoding of an independent loop (the
  target's logits one position at a time, masked by a fresh llguidance matcher);
- sampled: the same text on a second call with the same seed;
- ended by its end token: JSON the `jsonschema` validator accepts under the schema;
- cut by max_tokens: a prefix the grammar accepts.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import jsonschema
import llguidance
import numpy as np
import pytest

import lever
from lever.model.generate import prefill
from lever.model.grammar import Adapter, Grammar
from lever.model.stop import StopReason
from lever.model.transformer import Model
from lever.shipped import shipped
from tests.deep_target import write_shallow_copy
from tests.model.schemas import schemas

MAX_TOKENS = 40
PIPELINES = {  # name -> lever.load's settings and overrides
    "flash-ar": ({"kind": "flash-ar"}, []),
    "chain": ({"policy": "chain"}, []),
    "confidence": ({"policy": "confidence"}, []),
    "gain-cost": ({}, []),
    "gain-cost+ahead": ({}, ["tree_expand.lookahead_nodes=32", "tree_expand.lookahead_min_gain=0.3"]),
    "gain-cost+free": ({}, ['tree_expand.sources=["model", "prompt-lookup", "ngram"]']),
    "free-only": ({}, ['tree_expand.sources=["prompt-lookup", "ngram"]']),
}
TALLY: collections.Counter = collections.Counter()  # what the cases ended by, for the last test's floor


def open_pipelines(**where) -> dict[str, lever.LLM]:
    out = {}
    for name, (settings, sets) in PIPELINES.items():
        out[name] = lever.load(**where, **settings, overrides=['pipeline.baseline=""', *sets])
    return out


@pytest.fixture(scope="module")
def shipped_pair():
    llms = open_pipelines(config=shipped("default.toml"))
    yield llms, Model(shipped("models/stdlib-target-q4_0.gguf"))
    for m in llms.values():
        m.close()


@pytest.fixture(scope="module")
def spm_pair(stories, tmp_path_factory):
    draft = write_shallow_copy(stories, tmp_path_factory.mktemp("spm") / "stories-2-blocks.gguf", 2)
    llms = open_pipelines(target=str(stories), draft=str(draft), n_ctx=256)
    yield llms, Model(Path(stories))
    for m in llms.values():
        m.close()


def constrained_ar(model: Model, ids: list[int], grammar: Grammar, n: int, eos: frozenset[int]) -> list[int]:
    """Constrained autoregressive greedy decoding, written out: mask, argmax, consume (never an
    end token: it ends the text)."""
    m = llguidance.LLMatcher(Adapter.of(grammar.tok).ll, grammar.text, log_level=0)
    cache = model.new_cache(len(ids) + n + 1)
    hidden = prefill(model, cache, ids)
    out: list[int] = []
    for _ in range(n):
        logits = model.logits(hidden[None])[0]
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little").view(bool)
        allowed = np.zeros(logits.size, bool)
        k = min(logits.size, grammar.tok.vocab_size)
        allowed[:k] = bits[:k]
        tok = int(np.argmax(np.where(allowed, logits, -np.inf)))
        out.append(tok)
        if tok in eos:
            break
        assert m.consume_token(tok), m.get_error()
        hidden = prefill(model, cache, [tok])
    return out


def check_reply(c, schema: dict, grammar: Grammar, where: str) -> None:
    """An end token: valid under the schema; the token limit: a prefix the grammar accepts."""
    if c.finish_reason is StopReason.EOS:
        TALLY["eos"] += 1
        jsonschema.validate(json.loads(c.text), schema)  # raises, naming the path, when it is not
    else:
        assert c.finish_reason is StopReason.LENGTH and len(c.tokens) == MAX_TOKENS, (where, c.finish_reason)
        TALLY["length"] += 1
        m = grammar.fresh_matcher()
        assert m.consume_tokens(list(c.tokens)), (where, c.text, m.get_error())


def run_cases(llms: dict[str, lever.LLM], target: Model, prompts: list[str], seed: int, n_schemas: int,
              sampled_every: int) -> None:
    any_llm = next(iter(llms.values()))
    tok = any_llm.tokenizer
    for i, schema in enumerate(schemas(seed, n_schemas)):
        grammar = any_llm.grammars.get(json_schema=schema)
        for prompt in prompts:
            where = f"schema {i} {json.dumps(schema)[:200]} prompt {prompt!r}"
            want = constrained_ar(target, any_llm.engine.encode(prompt), grammar, MAX_TOKENS, frozenset(tok.eos_ids))
            for name, llm in llms.items():
                c = llm.generate(prompt, max_tokens=MAX_TOKENS, json_schema=schema)
                assert list(c.tokens) == want, (name, where, tok.decode(want), c.text)
                check_reply(c, schema, grammar, f"{name} greedy {where}")
                TALLY["greedy"] += 1
                if i % sampled_every:
                    continue
                kw = {"max_tokens": MAX_TOKENS, "json_schema": schema, "temperature": 1.0, "seed": 1000 + i}
                a, b = llm.generate(prompt, **kw), llm.generate(prompt, **kw)
                assert a.tokens == b.tokens, (name, where, a.text, b.text)
                check_reply(a, schema, grammar, f"{name} sampled {where}")
                TALLY["sampled"] += 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_schema_through_any_pipeline_byte_level_bpe(shipped_pair, seed):
    llms, target = shipped_pair
    run_cases(llms, target, ["def f(x):\n    return ", 'config = {"'], seed, n_schemas=10, sampled_every=2)


@pytest.mark.parametrize("seed", [10, 11])
def test_any_schema_through_any_pipeline_sentencepiece(spm_pair, seed):
    llms, target = spm_pair
    run_cases(llms, target, ["Once upon a time", "Lily had a"], seed, n_schemas=8, sampled_every=2)


def test_the_cases_were_not_vacuous():
    """Most replies ended by their end token and were validated, not only cut and prefix-checked
    (runs after the cases above, in file order)."""
    if not TALLY:
        pytest.skip("run with the cases above")
    print("structured output cases:", dict(TALLY))
    assert TALLY["greedy"] >= len(PIPELINES) * (3 * 10 * 2 + 2 * 8 * 2), dict(TALLY)
    assert TALLY["eos"] > TALLY["length"], dict(TALLY)
