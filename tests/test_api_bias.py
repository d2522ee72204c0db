"""A call's logit bias and penalties (lever.api.call, LLM.generate): llama-server's and OpenAI's
forms of logit_bias read over the model's tokenizer, ignore_eos as bans of the end tokens, the
refusals in one line naming the argument, llama-server's generation_settings; and through
lever.api on stories260K (its own draft), the text is the autoregressive loop's."""

from __future__ import annotations

import math

import pytest

import lever
from lever.api.call import MAX_BIAS_TEXT_CHARS, logit_bias, prepare_generate
from lever.config import GenerateConfig
from lever.errors import LeverError
from lever.gguf.tokenizer import Tokenizer
from lever.model.generate import generate
from lever.model.transformer import Model
from lever.serve.request import generation_settings

PROMPT = "Once upon a time"
N = 40


@pytest.fixture(scope="module")
def tok(stories):
    return Tokenizer.from_gguf(stories)


@pytest.fixture(scope="module")
def llm(stories):
    with lever.load(target=stories, draft=stories, n_ctx=256) as m:
        yield m


def prepared(tok, **args) -> GenerateConfig:
    return prepare_generate(args, GenerateConfig(), n_prompt=1, n_ctx=1024, n_ctx_source="test", tok=tok)[0]


def test_every_form_llama_server_reads(tok):
    the = tok.encode(" the", add_bos=False)
    assert logit_bias([[5, -1.5], [9, False]], tok).pairs == ((5, -1.5), (9, -math.inf))
    assert logit_bias([[" the", 2]], tok).pairs == tuple((i, 2.0) for i in the)  # each token of the text
    assert logit_bias({"5": -1.5, " the": False}, tok).pairs == ((5, -1.5), *((i, -math.inf) for i in the))  # OpenAI's
    assert logit_bias({5: 1}, tok).pairs == ((5, 1.0),)  # a Python caller's ids
    # a string in a pair is always text, as llama-server reads it; an object's key of digits is an id
    assert logit_bias([["12", 1]], tok).pairs == tuple((i, 1.0) for i in tok.encode("12", add_bos=False))
    assert logit_bias([], tok).pairs == () and logit_bias({}, tok).pairs == ()


def test_special_token_text_in_a_bias_is_text(tok):
    """As llama-server tokenizes a logit_bias text (no special tokens parsed): "</s>" is its
    characters, never the end token a caller could not otherwise name as text."""
    ids = [i for i, _ in logit_bias([["</s>", -5]], tok).pairs]
    assert ids and tok.eos_id not in ids and len(ids) > 1


def test_ignore_eos_bans_the_end_tokens_and_is_reported_as_llama_server_does(tok):
    gen = prepared(tok, ignore_eos=True, logit_bias=[[5, 1.0]], presence_penalty=0.5, frequency_penalty=-0.25)
    assert gen.ignore_eos and gen.logit_bias.pairs == ((5, 1.0),)
    eos = frozenset(tok.eos_ids)
    assert set(gen.params(eos).logit_bias.pairs) == {(5, 1.0), *((i, -math.inf) for i in eos)}
    s = generation_settings(gen, eos)
    assert s["logit_bias"] == [{"bias": 1.0, "token": 5}, *({"bias": None, "token": i} for i in sorted(eos))]
    assert s["ignore_eos"] is True and s["presence_penalty"] == 0.5 and s["frequency_penalty"] == -0.25
    assert s["n_predict"] == s["max_tokens"] == gen.n_predict
    assert generation_settings(prepared(tok, ignore_eos=False), eos)["logit_bias"] == []


@pytest.mark.parametrize("args, words", [
    ({"logit_bias": [[100000, 1.0]]}, "logit_bias: token id 100000 is not in the vocabulary of 512"),
    ({"logit_bias": [[1, 2.0, 3]]}, "logit_bias: each entry is a \\[token id, bias\\] pair"),
    ({"logit_bias": [[1, math.nan]]}, "logit_bias: a bias must be a finite number"),
    ({"logit_bias": [[1, True]]}, "logit_bias: a bias must be a number"),
    ({"logit_bias": {"-1": 1}}, "logit_bias: a token id must be an integer"),
    ({"logit_bias": "the"}, "logit_bias: must be a list of \\[token id, bias\\] pairs or an object"),
    ({"logit_bias": [["x" * (MAX_BIAS_TEXT_CHARS + 1), 1]]}, "logit_bias: a text is"),
    ({"logit_bias": [[i, False] for i in range(512)]}, "logit_bias: bans every token"),
    ({"ignore_eos": "yes"}, "ignore_eos: must be true or false"),
    ({"presence_penalty": 5000}, "presence_penalty: must be a finite number in \\[-1000, 1000\\]"),
    ({"frequency_penalty": math.inf}, "frequency_penalty: must be a finite number"),
])
def test_a_bad_call_is_one_line_naming_its_argument(tok, args, words):
    with pytest.raises(LeverError, match=f"^{words}") as e:
        prepared(tok, **args)
    assert "\n" not in str(e.value)


def test_a_text_needs_a_tokenizer():
    with pytest.raises(LeverError, match="logit_bias: 'the' is a text"):
        logit_bias([["the", 1]], None)


def test_the_api_generates_the_autoregressive_text_under_a_bias_and_penalties(llm, stories, tok):
    """Speculative (stories as its own draft: long accepted paths), greedy: the plain loop's
    tokens; the biased word comes, the banned never, and the session's cached text counts as
    the text before, as a fresh call's prompt does."""
    knobs = {"logit_bias": {" dog": 4.0, " the": False}, "presence_penalty": 0.6, "frequency_penalty": 0.3,
             "repeat_penalty": 1.1, "repeat_last_n": 32}
    c = llm.generate(PROMPT, max_tokens=N, **knobs)
    call = llm.prepare(PROMPT, max_tokens=N, **knobs)
    ref = generate(Model(stories), tok.encode(PROMPT), N, call.generate.params(frozenset(tok.eos_ids)),
                   eos_ids=frozenset(tok.eos_ids))
    assert list(c.tokens) == ref.tokens and " dog" in c.text
    assert not set(i for i, _ in logit_bias([[" the", 1]], tok).pairs) & set(c.tokens)
    assert c.tokens != llm.generate(PROMPT, max_tokens=N).tokens  # it changes the text
    with llm.session() as s:
        a = s.generate(PROMPT, max_tokens=N, **knobs)
        text = PROMPT + a.text + "\n"
        b = s.generate(text, max_tokens=16, **knobs)
        assert b.usage.cached_tokens > 0 and b.tokens == llm.generate(text, max_tokens=16, **knobs).tokens


def test_ignore_eos_runs_past_the_end_token_whatever_its_bias(llm, tok):
    """stories260K's end token is far down its logits: a bias brings it up within a sentence;
    ignore_eos bans it all the same (a ban is -inf, whatever is added to it)."""
    up = {tok.eos_id: 24.0}
    short = llm.generate(PROMPT, max_tokens=60, logit_bias=up)
    assert short.finish_reason == "eos" and short.tokens[-1] == tok.eos_id and len(short.tokens) < 60
    long = llm.generate(PROMPT, max_tokens=60, logit_bias=up, ignore_eos=True)
    assert long.finish_reason == "length" and len(long.tokens) == 60 and tok.eos_id not in long.tokens
    assert long.tokens[: len(short.tokens) - 1] == short.tokens[:-1]  # the same text up to where it ended
