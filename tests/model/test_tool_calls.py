"""Tool calls (lever.model.tool_calls): found in a reply's text, held whole in a stream, checked
on the way in, and enforced by a grammar when required: a required call on the shipped pair is
a valid call of a named function, the same under speculation as in constrained Flash-AR; on the
Qwen pair, its own template offers the tools, its reply's call comes back parsed, and the call
and a tool's result go back into the conversation as its template writes them."""

from __future__ import annotations

import json

import pytest

import lever
from lever.errors import LeverError
from lever.model.tool_calls import CallStream, check_tools, parse_calls, plan
from lever.shipped import shipped

TEMPLATE = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\n"
            "{% endfor %}<assistant>")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def llm():
    with lever.load(shipped("default.toml"), chat_template=TEMPLATE) as m:
        yield m


def test_calls_are_parsed_out_of_the_text():
    text, calls = parse_calls('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                              '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert text == "Let me look." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and calls[0].id != calls[1].id
    assert parse_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_calls("no call") == ("no call", [])


def test_only_offered_functions_become_calls_and_a_cut_call_is_neither_call_nor_text():
    offered = {"get_weather"}
    other = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    text, calls = parse_calls("ok " + other, offered)
    assert calls == [] and text == "ok " + other  # the model wrote it: text, not a call of a function never offered
    cut = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    assert parse_calls(cut, offered) == ("Sure.", [])
    whole = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
    text, calls = parse_calls(whole + cut[6:], offered)  # one call, then a second begun and cut
    assert text == "" and [c.name for c in calls] == ["get_weather"]
    stream = CallStream(frozenset(offered))
    assert stream.push("Sure.\n") == "Sure." and stream.push(cut[6:]) == "" and stream.finish() == ("", [])


@pytest.mark.parametrize("depth", [65, 100_000])
def test_arguments_nested_past_the_bound_are_no_call_and_no_crash(depth):
    args = "[" * depth + "]" * depth
    text = f'<tool_call>{{"name": "get_weather", "arguments": {args}}}</tool_call>'
    assert parse_calls(text, {"get_weather"}) == (text, [])


def test_a_stream_holds_a_call_whole_and_sends_the_text_before_it():
    s = CallStream()
    pieces = ["Sure", ", one moment.<tool", "_call>\n{\"name\": \"get_time\", ", "\"arguments\": {}}\n</tool_call>"]
    sent = [s.push(p) for p in pieces]
    assert "".join(sent) == "Sure, one moment." and sent[1] == ", one moment."  # "<tool" held back
    rest, calls = s.finish()
    assert rest == "" and [c.name for c in calls] == ["get_time"]
    plain = CallStream()
    # blank too: the reply's text is stripped at its ends, as a one-shot reply's is
    assert plain.push("a <tool") == "a" and plain.push("box>") == " <toolbox>" and plain.finish() == ("", [])


@pytest.mark.parametrize("tools, choice, words", [
    ([], None, "^tools: must be a non-empty list"), ([{"type": "function"}], None, r"^tools\[0\]: must be"),
    ([{"type": "function", "function": {"name": "a b"}}], None, r"^tools\[0\]\.function\.name"),
    ([WEATHER, WEATHER], None, "^tools: two functions share a name"),
    ([{"type": "function", "function": {"name": "deep", "parameters": json.loads('{"a":' * 500 + "1" + "}" * 500)}}],
     None, r"^tools\[0\]\.function\.parameters(\.a){6}\.\.\.\(54 more\)(\.a){4}: nests deeper than 64 levels$"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "^tool_choice: no function named 'nope'"),
    ([WEATHER], "sometimes", "^tool_choice: must be none, auto, required"),
    (None, "required", "^tool_choice: needs tools"),
])
def test_bad_tools_and_choices_are_one_line_naming_them(llm, tools, choice, words):
    with pytest.raises(LeverError, match=words):
        plan(llm.tokenizer, tools, choice)


def test_a_required_call_is_a_valid_call_and_lossless(llm):
    c = llm.chat(ASK, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 max_tokens=48)
    assert [t.name for t in c.tool_calls] == ["get_weather"]
    assert set(json.loads(c.tool_calls[0].arguments)) == {"city"}
    flash_ar = lever.load(shipped("default.toml"), chat_template=TEMPLATE, kind="flash-ar",
                          overrides=['pipeline.baseline=""'])
    with flash_ar:
        same = flash_ar.chat(ASK, tools=[WEATHER, TIME],
                             tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=48)
    assert same.tokens == c.tokens
    any_call = llm.chat(ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=48)
    assert any_call.tool_calls and {t.name for t in any_call.tool_calls} <= {"get_weather", "get_time"}
    none = llm.chat(ASK, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert none.tokens == llm.chat(ASK, max_tokens=8).tokens  # "none": the tools are not shown


def test_streamed_and_session_calls_are_the_one_shot_calls(llm):
    named = {"type": "function", "function": {"name": "get_weather"}}
    one = llm.chat(ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=48)
    chunks = list(llm.stream_chat(ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=48))
    assert chunks[-1].tool_calls and all(not c.tool_calls for c in chunks[:-1])
    assert [(t.name, t.arguments) for t in chunks[-1].tool_calls] == [(t.name, t.arguments) for t in one.tool_calls]
    assert "".join(c.text for c in chunks) == one.text  # the text around the calls, none of the call's
    with llm.session() as s:
        c = s.chat(ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=48)
        assert c.tokens == one.tokens and [t.name for t in c.tool_calls] == ["get_weather"]
        kept = s.messages[-1]  # the call joins the conversation as the template renders it back
        assert kept["tool_calls"][0]["function"]["name"] == "get_weather" and kept["content"] == (c.text or None)
        result = {"role": "tool", "tool_call_id": c.tool_calls[0].id, "content": '{"celsius": 21}'}
        streamed = list(s.stream_chat([result], tools=[WEATHER, TIME], max_tokens=12))
        assert s.last_cached > len(llm.encode_chat(ASK, tools=check_tools([WEATHER, TIME]))) - 2  # the call reused
        fresh = llm.chat([*s.messages[:2], result], tools=[WEATHER, TIME], max_tokens=12)
        assert "".join(x.text for x in streamed) + "".join(t.name for t in streamed[-1].tool_calls) == \
            fresh.text + "".join(t.name for t in fresh.tool_calls)


def test_a_cut_required_call_finishes_by_length_with_no_markup(llm):
    for stream in (False, True):
        kw = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 6}
        if stream:
            chunks = list(llm.stream_chat(ASK, **kw))
            text, finish, calls = "".join(c.text for c in chunks), chunks[-1].finish_reason, chunks[-1].tool_calls
        else:
            c = llm.chat(ASK, **kw)
            text, finish, calls = c.text, c.finish_reason, c.tool_calls
        assert finish == "length" and calls == () and "<tool_call>" not in text, (stream, text)


def test_check_tools_keeps_a_default_parameters_schema():
    (t,) = check_tools([{"type": "function", "function": {"name": "ping"}}])
    assert t["function"]["parameters"] == {"type": "object"}


def test_qwen_offers_the_tools_and_its_call_comes_back_parsed(qwen_target, qwen_draft):
    with lever.load(target=qwen_target, draft=qwen_draft, n_ctx=1024) as q:
        prompt_ids = q.encode_chat(ASK, tools=check_tools([WEATHER]))
        assert "<tools>" in q.tokenizer.decode(prompt_ids)  # its own template shows them
        c = q.chat(ASK, tools=[WEATHER], tool_choice="required", max_tokens=48)
        assert [t.name for t in c.tool_calls] == ["get_weather"]
        assert "paris" in json.loads(c.tool_calls[0].arguments)["city"].lower()
        follow = [*ASK, {"role": "assistant", "content": None, "tool_calls": [c.tool_calls[0].as_openai()]},
                  {"role": "tool", "tool_call_id": c.tool_calls[0].id, "content": '{"celsius": 21}'}]
        shown = q.tokenizer.decode(q.encode_chat(follow, tools=check_tools([WEATHER])))
        call = json.dumps({"city": json.loads(c.tool_calls[0].arguments)["city"]})
        assert f'<tool_call>\n{{"name": "get_weather", "arguments": {call}}}\n</tool_call>' in shown
        assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in shown  # the result, as its template puts it
