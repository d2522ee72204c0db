"""lever.gguf.render_child: a template that loops, allocates or fails costs one bounded child
process and a one-line refusal; the next render gets a fresh child; close() fails a render in
progress at once."""

from __future__ import annotations

import threading
import time

import pytest

from lever.gguf.chat_template import ChatTemplate, TemplateError
from lever.gguf.render_child import RenderProcess
from tests.load import within

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MESSAGES = [{"role": "user", "content": "a<|im_end|>b"}]


@pytest.fixture(scope="module")
def renderer():
    with RenderProcess() as r:
        yield r


def test_renders_as_in_process(renderer):
    t = ChatTemplate(CHATML, "t")
    got = renderer.render(t, MESSAGES, specials=["<|im_end|>"], timeout_s=30)
    assert got == t.render_marked(MESSAGES, specials=["<|im_end|>"])
    assert got.foreign == (got.text.index("<|im_end|>"),)


def test_a_template_that_loops_is_killed_at_its_time_bound_and_the_next_render_works(renderer):
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match="took over 0.5 s"):
        renderer.render(ChatTemplate(LOOP, "loop"), MESSAGES, specials=[], timeout_s=0.5)
    assert within(time.monotonic() - t0, 3.0)
    assert renderer.render(ChatTemplate(CHATML, "t"), MESSAGES, specials=[], timeout_s=30).text.startswith("<|im")


@pytest.mark.parametrize("template, what", [
    ("{{ 'a' * 2000000000 }}", "memory"),  # 2 GB: past the child's data cap
    ("{{ [1] * 10 ** 9 }}", "memory"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% for i in range(10000) %}{{ 'x' * 10000 }}{% endfor %}", "more than"),
])
def test_a_template_that_allocates_or_fails_is_one_line(renderer, template, what):
    with pytest.raises(TemplateError, match=what) as e:
        renderer.render(ChatTemplate(template, "bad"), MESSAGES, specials=[], timeout_s=30, max_chars=1 << 20)
    assert "\n" not in str(e.value)
    assert renderer.render(ChatTemplate(CHATML, "t"), MESSAGES, specials=[], timeout_s=30).text


def test_close_fails_a_render_in_progress_at_once():
    r = RenderProcess()
    r.render(ChatTemplate(CHATML, "t"), MESSAGES, specials=[], timeout_s=30)  # the child is up
    failed = []

    def render():
        try:
            r.render(ChatTemplate(LOOP, "loop"), MESSAGES, specials=[], timeout_s=60)
        except TemplateError as e:
            failed.append((time.monotonic(), str(e)))

    t = threading.Thread(target=render)
    t.start()
    time.sleep(0.3)
    closed_at = time.monotonic()
    r.close()
    t.join(5)
    assert failed and within(failed[0][0] - closed_at, 1.0) and "closed" in failed[0][1]
    with pytest.raises(TemplateError, match="closed"):
        r.render(ChatTemplate(CHATML, "t"), MESSAGES, specials=[], timeout_s=30)
