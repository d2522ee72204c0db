"""Tool-call formats (lever.model.tools): each family's template detected as its family; in every
format, the calls a reply holds (random names, nested arguments, text around them, several calls)
come back as written, and streamed in any pieces the reply gives the same text and calls as read
at once, its text never handed on before it is final; what may begin a call is held and released
as soon as it cannot; a required call's grammar, in each format, compiles and takes what the model
would write."""

from __future__ import annotations

import json
import re

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lever.gguf.tokenizer import Tokenizer
from lever.model.grammar import Grammar
from lever.model.tool_calls import BY_NAME, FORMATS, CallStream, ToolCall, check_tools, detect, parse_calls, required
from lever.model.tools.lexing import WS, Pattern
from lever.pipelines.text import TextStream
from lever.shipped import shipped
from tests.llama_templates import templates
from tests.sizes import cases

FAMILIES = {
    "hermes": ["NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
               "Qwen-Qwen2.5-7B-Instruct", "Qwen-QwQ-32B", "Qwen-Qwen3-0.6B", "MiMo-VL", "ibm-granite-granite-4.0"],
    "llama3": ["meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
               "meta-llama-Llama-3.3-70B-Instruct"],
    "mistral": ["mistralai-Mistral-Nemo-Instruct-2407"],
    "mistral-args": ["unsloth-mistral-Devstral-Small-2507", "mistralai-Ministral-3-14B-Reasoning-2512"],
    "mistral-ids": ["Mistral-Small-3.2-24B-Instruct-2506"],
    "firefunction": ["fireworks-ai-llama-3-firefunction-v2"],
    # tools offered in markup Lever does not read (XML calls, functionary): fenced or bare JSON
    "json": ["Qwen3-Coder", "meetkai-functionary-medium-v3.1", "meetkai-functionary-medium-v3.2", "GLM-4.6"],
    "generic": ["google-gemma-2-2b-it", "microsoft-Phi-3.5-mini-instruct"],  # no tools in the template
}
ONE_BLOCK_EACH = {"hermes", "llama3", "json"}  # formats whose calls are one block each, text between them
NAMES = st.from_regex(r"[A-Za-z0-9_.-]{1,16}", fullmatch=True)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12)
ARGS = st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4)
# text a model may write around calls: near misses of every format's markers among plain words
FRAGMENTS = ["<tool", "<tool_call", "</tool_call>", "[TOOL_CALLS", "[ARGS]", "functool", "```", "```js", "{", "}",
             "[", "]", '"name": ', "<|python_tag", "\n", " ", "ok", "Sure.", "é", "\\", '"']
TEXT = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=6).map("".join)


@pytest.mark.parametrize("family, files", FAMILIES.items())
def test_each_familys_template_is_detected_as_its_format(family, files):
    for f in files:
        assert detect((templates() / f"{f}.jinja").read_text()).name == family, f
    assert detect(None).name == "generic"


def calls_of(draw, names, ids) -> list[ToolCall]:
    return [ToolCall(next(ids), draw(st.sampled_from(names)), json.dumps(draw(ARGS)))
            for _ in range(draw(st.integers(1, 3)))]


def text_of(draw, fmt) -> str:
    """Text that holds no opener and begins no bare call (a bracket first would be a call cut)."""
    t = draw(TEXT)
    while fmt.opener and fmt.opener in t:  # (a cut may join two halves into one)
        t = t.replace(fmt.opener, "")
    return re.sub(r"^(\s*)([{\[<])", r"\1x\2", t) if fmt.bare else t


@st.composite
def replies(draw, fmt):
    """(reply, its text, its calls, the functions offered): text and groups of calls in turn."""
    names = draw(st.lists(NAMES, min_size=1, max_size=4, unique=True))
    ids = iter(f"id{k:07d}" for k in draw(st.lists(st.integers(0, 10**7 - 1), min_size=9, max_size=9, unique=True)))
    parts, text, calls = [], [], []
    n_groups = 1 if fmt.name == "generic" else draw(st.integers(0, 3))
    for _ in range(n_groups):
        before = "" if fmt.name == "generic" else text_of(draw, fmt)
        group = calls_of(draw, names, ids)
        # a call may stand bare at the reply's start or after a call (Llama, fenced JSON); Llama's
        # call after text follows <|python_tag|>
        bare = fmt.chain and not "".join([*text, before]).strip() and draw(st.booleans())
        if fmt.name in ONE_BLOCK_EACH:
            written = [json.dumps({"name": c.name, "arguments": json.loads(c.arguments)}) if bare and fmt.name == "json"
                       else fmt.render([c]) for c in group]
            seps = [draw(st.sampled_from(["\n", "", " \n "])) for _ in group[1:]]
            block = written[0] + "".join(s + w for s, w in zip(seps, written[1:]))
            text += [before, *seps]
        else:
            block, text = fmt.render(group), [*text, before]
        parts += [before, "<|python_tag|>" + block if fmt.name == "llama3" and not bare else block]
        calls += group
    after = text_of(draw, fmt)
    parts.append(after)
    text.append(after)
    return "".join(parts), "".join(text).strip(), calls, names


def same_calls(fmt, got: list[ToolCall], want: list[ToolCall]) -> bool:
    def key(c: ToolCall):
        return c.name, json.loads(c.arguments), c.id if fmt.writes_ids else None
    return [key(c) for c in got] == [key(c) for c in want]


@st.composite
def streamed(draw):
    fmt = draw(st.sampled_from(FORMATS))
    reply, text, calls, names = draw(replies(fmt))
    cuts = sorted(draw(st.lists(st.integers(0, len(reply)), max_size=12)))
    return fmt, reply, text, calls, names, [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]


@settings(max_examples=cases(400), deadline=None)
@given(streamed())
def test_calls_come_back_as_written_and_any_streaming_is_the_reply_read_at_once(case):
    fmt, reply, text, calls, names, pieces = case
    got_text, got = parse_calls(reply, names, fmt)
    assert got_text == text and same_calls(fmt, got, calls), (fmt.name, reply)
    s, sent = CallStream(names, fmt), ""
    for p in pieces:
        sent += s.push(p)
        assert got_text.startswith(sent), (fmt.name, reply, pieces)  # nothing handed on that is not final
    rest, streamed_calls = s.finish()
    assert sent + rest == got_text and [(c.name, c.arguments) for c in streamed_calls] == \
        [(c.name, c.arguments) for c in got]
    if fmt.writes_ids:
        assert [c.id for c in streamed_calls] == [c.id for c in got]


@pytest.mark.parametrize("fmt, pieces, sent", [
    ("hermes", ["a <tool", "box>"], ["a", " <toolbox>"]),
    ("hermes", ["<tool_call>\n", '{"name": "get_w', 'ind"'], ["", "", '<tool_call>\n{"name": "get_wind"']),
    ("hermes", ["<tool_call> hi"], ["<tool_call> hi"]),
    ("llama3", ["{", '"name": "get_weather", ', '"parameters": {}}'], ["", "", ""]),
    ("llama3", ["{", '"x'], ["", '{"x']),
    ("llama3", ["Hi {", '"name"'], ['Hi {', '"name"']),  # after text, a bare object is text
    ("llama3", ["<|python_tag|>", '{"name": "get_time", "parameters": {}}'], ["", ""]),
    ("mistral", ["[TOOL_CALLS]", '[{"name": "get_time"', ', "arguments": {}}] ok'], ["", "", "ok"]),
    ("mistral-args", ["[TOOL_CALLS]get_w", "eather[AR", "GS]{}"], ["", "", ""]),
    ("mistral-args", ["[TOOL_CALLS]get_w", "x"], ["", "[TOOL_CALLS]get_wx"]),
    ("firefunction", ["functools", "."], ["", "functools."]),
    ("json", ["``", "`py"], ["", "```py"]),
    ("json", ["```json\n", '{"name": "get_time", "arguments": {}}\n', "```"], ["", "", ""]),
    ("generic", ['{"respon', 'se": "hi"', "}"], ["", "", "hi"]),
    ("generic", ['{"respond'], ['{"respond']),
])
def test_what_may_begin_a_call_is_held_and_released_as_soon_as_it_cannot(fmt, pieces, sent):
    s = CallStream({"get_weather", "get_time"}, BY_NAME[fmt])
    assert [s.push(p) for p in pieces] == sent


@pytest.mark.parametrize("fmt, reply, text, names", [
    ("hermes", '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_time"}]</tool_call>', "",
     ["get_time", "get_time"]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"a\\": 1}"}</tool_call>', "", ["get_time"]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{oops"}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": "{oops"}</tool_call>', []),  # arguments not JSON: text
    ("hermes", '<tool_call>{"name": "get_time", "arguments": 3}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": 3}</tool_call>', []),
    ("llama3", '{"name": "get_time", "parameters": {}}{"name": "get_weather", "parameters": {"city": "Oslo"}} fine',
     "fine", ["get_time", "get_weather"]),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]',
     '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]', []),
    ("generic", '{"response": "Hello\\nthere"}', "Hello\nthere", []),
    ("generic", '{"tool_call": {"name": "get_time", "arguments": {}}}', "", ["get_time"]),
    ("generic", 'Hello {"tool_calls": []}', 'Hello {"tool_calls": []}', []),
    ("json", '{"name": "get_time", "arguments": {}}', "", ["get_time"]),
    ("json", 'See ```json\n[{"name": "get_time", "arguments": {}}]\n``` done', "See  done", ["get_time"]),
    ("mistral-args", "[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Rome\"", "",
     ["get_time"]),  # the second call cut by the token limit: neither call nor text
])
def test_replies_read_in_each_format(fmt, reply, text, names):
    got_text, calls = parse_calls(reply, {"get_weather", "get_time"}, BY_NAME[fmt])
    assert got_text == text and [c.name for c in calls] == names
    assert all(isinstance(json.loads(c.arguments), dict) for c in calls)


def test_mistral_ids_are_the_models_when_they_have_the_shape_else_nine_letters_and_digits():
    fmt = BY_NAME["mistral"]
    _, calls = parse_calls('[TOOL_CALLS][{"name": "f", "arguments": {}, "id": "abc123XYZ"}, '
                           '{"name": "f", "arguments": {}, "id": "abc123XYZ"}, {"name": "f", "arguments": {}}]',
                           None, fmt)
    assert calls[0].id == "abc123XYZ" and calls[1].id != calls[0].id  # a repeated id is not kept
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in calls)
    _, (call,) = parse_calls("[TOOL_CALLS]f[ARGS]{}", None, BY_NAME["mistral-args"])
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(shipped("models/stdlib-target-q4_0.gguf"))


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_a_required_calls_grammar_is_the_formats_own(tok, fmt):
    """It compiles, takes the calls as the model writes them (the template shows them so), and
    not a call of a function left out, nor text before the call."""
    tools = check_tools([WEATHER, TIME])
    g = Grammar.lark(tok, required(tok, tools, fmt=fmt).text, "tool_choice")
    calls = [ToolCall("a1b2c3d4e", "get_weather", json.dumps({"city": "Paris"})),
             ToolCall("f5g6h7i8j", "get_time", "{}")]
    several = len(calls) if fmt.name != "llama3" else 1  # Llama's templates take one call a message
    if fmt.name == "generic":  # the grammar asks for no ids (llama.cpp's generic shape)
        written = json.dumps({"tool_calls": [{"name": c.name, "arguments": json.loads(c.arguments)}
                                             for c in calls]})
    else:
        written = fmt.render(calls[:several])
    assert g.accepts(tok.encode(written, add_bos=False)), written
    assert not g.accepts(tok.encode("Sure. " + written, add_bos=False))
    only_time = Grammar.lark(tok, required(tok, tools, "get_time", fmt=fmt).text, "tool_choice")
    assert not only_time.accepts(tok.encode(fmt.render(calls[:1]), add_bos=False))
    one = Grammar.lark(tok, required(tok, tools, parallel=False, fmt=fmt).text, "tool_choice")
    if several > 1:
        assert not one.accepts(tok.encode(written, add_bos=False))


def test_a_formats_markers_are_read_where_the_vocabulary_has_them_as_control_tokens(qwen_target):
    """Control tokens decode to nothing (Mistral's [TOOL_CALLS], Llama's <|python_tag|>): a format's
    markers are decoded as their text all the same, as llama.cpp's preserved tokens are. Shown on
    Qwen's vocabulary with a format whose markers are two of its control tokens."""
    tok = Tokenizer.from_gguf(qwen_target)
    fmt = attrs.evolve(BY_NAME["hermes"], opener="<|fim_prefix|>", trailer=Pattern([WS, "<|fim_suffix|>"]),
                       preserved=("<|fim_prefix|>", "<|fim_suffix|>"))
    call = '\n{"name": "get_time", "arguments": {}}\n'
    ids = tuple(tok.encode(f"Sure. é<|fim_prefix|>{call}<|fim_suffix|>", add_bos=False))
    assert tok.decode(ids) == "Sure. é" + call  # the markers alone: nothing
    blind = attrs.evolve(fmt, preserved=())  # without: the call's markers are lost, its JSON left as text
    for f, want in ((fmt, ("Sure. é", ["get_time"])), (blind, (("Sure. é" + call).strip(), []))):
        s = TextStream(tok, offered=frozenset({"get_time"}), tool_format=f)
        for i in ids:  # one token at a time, as a generation gives them
            s((i,))
        s.finish()
        text, calls = s.reply()
        assert (text, [c.name for c in calls]) == want
