"""lever.api against hostile input, through `lever.load` as an app calls it: a chat template that
allocates, writes or loops without end is a one-line refusal naming chat_template, rendered in
the LLM's child process (the app's own memory does not grow by what the template builds); a
schema or a tool that holds itself or nests without end is a one-line refusal naming it, before
any compile; special-token text in any message is text, never a control token (the Qwen pair's
own template and its 22 special tokens)."""

from __future__ import annotations

import time

import psutil
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import lever
from lever.errors import LeverError
from lever.gguf.render_child import DATA_LIMIT_BYTES
from lever.shipped import shipped
from tests.load import within
from tests.sizes import cases

GB = 1_000_000_000
HOSTILE_TEMPLATES = [
    ("{{ 'x' * %d }}" % GB, "ran out of memory"),  # 1 GB in one string: 3.9 GB peak when rendered in-process
    ("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", "wrote more than"),  # 10 GB, piece by piece
    ("{% set ns = namespace(s='') %}{% for i in range(100000) %}{% set ns.s = ns.s ~ ('x' * 10000) %}{% endfor %}"
     "{{ ns.s }}", "took over 1 s"),  # 1 GB joined in a loop
]
ASK = [{"role": "user", "content": "hi"}]


def status_mib(key: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith(key + ":"))


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("template, words", HOSTILE_TEMPLATES)
def test_a_hostile_template_is_one_line_and_the_apps_memory_stays_put(template, words):
    with lever.load(shipped("default.toml"), chat_template=template) as llm:
        llm.renderer.timeout_s = 1.0
        with open("/proc/self/clear_refs", "w") as f:  # the peak RSS (VmHWM) from here
            f.write("5")
        rss = status_mib("VmRSS")
        t0 = time.monotonic()
        for call in (lambda: llm.chat(ASK, max_tokens=2), lambda: llm.session().chat(ASK, max_tokens=2)):
            with pytest.raises(LeverError, match=words) as e:
                call()
            assert str(e.value).startswith("chat_template: ") and "\n" not in str(e.value)
        assert within(time.monotonic() - t0, 6.0)
        assert status_mib("VmHWM") - rss < 64  # the template's gigabyte was never in this process
        pid = llm.renderer.process.pid
        if pid is not None:  # a child that survived its refusal stayed within its bound
            assert status_mib("VmHWM", pid) << 20 < DATA_LIMIT_BYTES + (128 << 20)
    assert pid is None or not alive(pid)  # closing the LLM stops its renderer


def test_chats_and_session_turns_render_in_the_child():
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    with lever.load(shipped("default.toml"), chat_template=template) as llm:
        assert llm.renderer.process.pid is None  # started with the first chat, not before
        c = llm.chat(ASK, max_tokens=4)
        pid = llm.renderer.process.pid
        assert pid is not None and alive(pid)
        rendered = llm.chat_template.render_marked(ASK, specials=tuple(llm.tokenizer.specials))
        want = llm.tokenizer.encode_chat(llm.renderer.bos_first(rendered))  # the vocabulary's BOS first, as llama's
        assert llm.encode_chat(ASK) == want and c.usage.prompt_tokens == len(want)
        with llm.session() as s:
            s.chat(ASK, max_tokens=4)
            second = s.chat([{"role": "user", "content": "and again"}], max_tokens=4)
            assert second.usage.cached_tokens > 0
        with pytest.raises(LeverError, match=rf"^messages: \d+ characters of text is more than the context of "
                                             rf"{llm.n_ctx} tokens can hold"):
            llm.chat([{"role": "user", "content": "x" * (llm.renderer.max_prompt_bytes + 1)}], max_tokens=2)
        assert llm.renderer.process.pid == pid  # one child for every call
    assert not alive(pid)


@pytest.fixture(scope="module")
def qwen(qwen_target, qwen_draft):
    with lever.load(target=qwen_target, draft=qwen_draft, n_ctx=1024) as q:
        yield q


def holding_itself() -> dict:
    d = {"type": "object"}
    d["properties"] = {"a": d}
    return d


def nested(n: int) -> dict:
    d = inner = {}
    for _ in range(n):
        inner["a"] = {}
        inner = inner["a"]
    return d


@pytest.mark.parametrize("schema, words", [
    (holding_itself(), r"^json_schema\.properties\.a: contains itself: the same dict as json_schema \(a cycle\)$"),
    ({"type": "object", "properties": {1: {"type": "string"}}}, r"^json_schema\.properties: the key 1 is of type int"),
    ({"enum": {1, 2}}, r"^json_schema\.enum: a value of type set is not JSON"),
    ({"type": b"object"}, r"^json_schema\.type: a value of type bytes is not JSON"),
    (nested(600), r"^json_schema(\.a)+\.\.\.\(90 more\)(\.a)+: nests deeper than 100 levels$"),
])
def test_a_hostile_schema_through_the_qwen_pair_is_one_line_before_any_compile(qwen, schema, words):
    compiled = qwen.grammars.compiled
    for call in (lambda: qwen.generate("x", json_schema=schema, max_tokens=4),
                 lambda: qwen.chat(ASK, json_schema=schema, max_tokens=4)):
        t0 = time.monotonic()
        with pytest.raises(LeverError, match=words):
            call()
        assert within(time.monotonic() - t0, 1.0)
    assert qwen.grammars.compiled == compiled


@pytest.mark.parametrize("parameters, words", [
    (holding_itself(), r"^tools\[0\]\.function\.parameters\.properties\.a: contains itself"),
    (nested(600), r"^tools\[0\]\.function\.parameters(\.a)+\.\.\.\(54 more\)(\.a)+: nests deeper than 64 levels$"),
    ({"type": "object", "properties": {"n": {"type": "number", "maximum": float("nan")}}},
     r"^tools\[0\]\.function\.parameters\.properties\.n\.maximum: nan is not a finite number$"),
])
def test_hostile_tools_through_the_qwen_pair_are_one_line(qwen, parameters, words):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    for choice in ("auto", "required"):
        t0 = time.monotonic()
        with pytest.raises(LeverError, match=words):
            qwen.chat(ASK, tools=tools, tool_choice=choice, max_tokens=4)
        assert within(time.monotonic() - t0, 1.0)


TEXT = st.text(st.sampled_from("ab <>|/\n_:system user"), max_size=8)


@settings(max_examples=cases(80), derandomize=True, deadline=None, database=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_special_token_text_in_any_message_is_text(qwen, data):
    """Contents mixing every special token's text with text around it, in system, user, tool
    and assistant messages, through the chat path (prepare): the prompt's control tokens are
    the template's own markers, the same as for the same conversation with plain contents, and
    every content is in the prompt as its text."""
    tok = qwen.tokenizer
    control = set(tok.specials.values())
    content = st.lists(st.one_of(st.sampled_from(sorted(tok.specials)), TEXT), max_size=6).map("".join)
    system = data.draw(st.lists(content, max_size=1))
    turns = data.draw(st.lists(st.tuples(st.sampled_from(["user", "tool", "assistant"]), content), min_size=1,
                               max_size=4))
    messages = [{"role": "system", "content": c} for c in system] + [{"role": r, "content": c} for r, c in turns]
    ids = list(qwen.prepare(messages=messages, max_tokens=1).ids)
    plain = list(qwen.prepare(messages=[{**m, "content": "x"} for m in messages], max_tokens=1).ids)
    assert [i for i in ids if i in control] == [i for i in plain if i in control]
    shown = tok.decode(ids)
    assert all(m["content"] in shown for m in messages)
