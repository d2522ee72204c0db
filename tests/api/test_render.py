"""lever.api.render.ChatRenderer: a chat's prompt as llama-server tokenizes it (the BOS a
vocabulary adds first, once), /apply-template's view without it, and the template's inputs
(add_generation_prompt, enable_thinking as [model] reasoning says) carried to the child."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lever.api.render import ChatRenderer
from lever.gguf.chat_template import ChatTemplate
from lever.gguf.tokenizer import Tokenizer
from lever.shipped import shipped
from tests.sizes import cases

EOT = "<|endoftext|>"  # the shipped models' BOS (their vocabulary adds one)
PLAIN = "{% for m in messages %}{{ m.content }}{% endfor %}"
THINKING = "{{ messages[-1].content }}{% if add_generation_prompt %}<a>{% if not enable_thinking %}/{% endif %}" \
           "{% endif %}"


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer.from_gguf(shipped("models/stdlib-target-q4_0.gguf"))
    assert t.add_bos and t.token_text(t.bos_id) == EOT
    return t


@pytest.fixture(scope="module")
def renderer(tok):
    r = ChatRenderer(tok, 512, "test")
    yield r
    r.close()


@settings(max_examples=cases(40), deadline=None)
@given(content=st.lists(st.sampled_from([EOT, "x", " def", "\n"]), min_size=1, max_size=6).map("".join),
       writes_bos=st.booleans())
def test_a_chat_starts_with_one_bos_whatever_the_template_or_the_message(renderer, tok, content, writes_bos):
    t = ChatTemplate(("{{ bos_token }}" if writes_bos else "") + PLAIN, "t", bos_token=EOT)
    messages = [{"role": "user", "content": content}]
    r = renderer.render(t, messages)
    ids = tok.encode_chat(r)
    assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:]  # the message's text never is one
    assert tok.decode(ids[1:]) == content
    # /apply-template shows what the template wrote, less the BOS the tokenizing adds
    assert renderer.shown(r) == t.render(messages)[len(EOT) if writes_bos else 0:]


def test_the_template_is_given_add_generation_prompt_and_the_models_reasoning(tok):
    t = ChatTemplate(THINKING, "t")
    messages = [{"role": "user", "content": "q"}]
    for reasoning, thinks in (("auto", True), ("on", True), ("off", False)):  # auto: the template has the mode
        r = ChatRenderer(tok, 512, "test", reasoning=reasoning)
        try:
            assert r.shown(r.render(t, messages)) == ("q<a>" if thinks else "q<a>/")
            # a request's chat_template_kwargs say otherwise: theirs wins
            told = r.render(t, messages, variables={"enable_thinking": not thinks})
            assert r.shown(told) == ("q<a>/" if thinks else "q<a>")
            assert r.shown(r.render(t, messages, add_generation_prompt=False)) == "q"
        finally:
            r.close()
