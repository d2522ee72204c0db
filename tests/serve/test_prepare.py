"""lever.serve.prepare without a live server: a chat renders through the LLM's own renderer (one
child process for the library's calls and the server's), held to the LLM's byte rule, given the
request's add_generation_prompt and chat_template_kwargs (an empty tools list offers none, a last
assistant message is continued), and a
fault inside a schema is named by the field the request gave it in."""

from __future__ import annotations

import json

import pytest

import lever
from lever.errors import LeverError
from lever.serve.prepare import Preparer, named
from lever.serve.request import BadRequest
from lever.shipped import shipped


def test_the_server_renders_through_the_llms_renderer(llm):
    prep = Preparer(llm, timeout_s=5.0)
    messages = [{"role": "user", "content": "a<|endoftext|>b"}]
    rendered = prep.render(messages)
    assert llm.renderer.process.pid is not None  # the LLM's child did it
    own = llm.chat_template.render_marked(messages, specials=tuple(llm.tokenizer.specials))
    assert rendered == llm.renderer.bos_first(own)  # the BOS the vocabulary adds, first (llama-server's)
    assert prep.max_prompt_bytes == llm.renderer.max_prompt_bytes == 2 * llm.n_ctx * llm.tokenizer.max_token_bytes
    with pytest.raises(BadRequest, match=r"^messages: \d+ characters of text is more than the context") as e:
        prep.render([{"role": "user", "content": "x" * (prep.max_prompt_bytes + 1)}])
    assert e.value.param == "messages" and e.value.status == 400
    with pytest.raises(BadRequest, match=r"^prompt: \d+ bytes of text") as e:
        prep.check_bytes(prep.max_prompt_bytes + 1, "prompt")
    assert e.value.param == "prompt"


def test_a_chats_template_inputs_are_the_requests_as_llama_server_reads_them():
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}" \
               "<assistant>{% if not enable_thinking %}/{% endif %}{% endif %}{{ tag }}"
    with lever.load(shipped("default.toml"), chat_template=template) as llm:
        prep = Preparer(llm, timeout_s=5.0)
        body = {"messages": [{"role": "user", "content": "a"}], "tools": [], "add_generation_prompt": False}
        data, _, messages, offer = prep.parse(json.dumps(body).encode(), "chat")
        assert offer.tools is None and offer.grammar is None  # an empty list offers no function, as no list
        assert prep.render(messages, offer.tools, data).text == "<|endoftext|><user>a"  # no assistant's turn
        assert prep.render(messages).text == "<|endoftext|><user>a<assistant>"  # thinks: its mode is on
        kwargs = {"chat_template_kwargs": {"enable_thinking": False, "tag": "!"}}
        data, _, messages, offer = prep.parse(json.dumps({**body, "add_generation_prompt": True, **kwargs}).encode(),
                                              "chat")
        assert prep.render(messages, offer.tools, data).text == "<|endoftext|><user>a<assistant>/!"
        prefill = {"messages": [*body["messages"], {"role": "assistant", "content": "Wh"}]}
        data, _, messages, offer = prep.parse(json.dumps(prefill).encode(), "chat")  # llama-server's prefill
        assert prep.render(messages, offer.tools, data).text == "<|endoftext|><user>a<assistant>Wh"
        with pytest.raises(LeverError, match="^continue_final_message: cannot be given with add_generation_prompt"):
            prep.parse(json.dumps({**prefill, "continue_final_message": True}).encode(), "chat")
        for bad, field in (({"messages": "x"}, "chat_template_kwargs.messages"),
                           ({"enable_thinking": "no"}, "chat_template_kwargs.enable_thinking")):
            with pytest.raises(LeverError, match=rf"^{field}: "):
                prep.parse(json.dumps({**body, "chat_template_kwargs": bad}).encode(), "chat")


@pytest.mark.parametrize("message, field, want", [
    ("json_schema: a chain of 3002 $refs", "response_format", "response_format: a chain of 3002 $refs"),
    ("json_schema.properties.n.maximum: nan is not a finite number", "response_format",
     "response_format.json_schema.schema.properties.n.maximum: nan is not a finite number"),
    ("json_schema[0]: x", "response_format", "response_format.json_schema.schema[0]: x"),
    ("json_schema.properties.a: x", "json_schema", "json_schema.properties.a: x"),
    ("json_schemata: x", "response_format", "json_schemata: x"),
    ("grammar: x", "response_format", "grammar: x"),
])
def test_a_schemas_fault_is_named_by_the_field_it_came_in(message, field, want):
    assert named(message, field) == want
