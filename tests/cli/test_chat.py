"""`lever chat` fed from a pipe: turns stream through the template in one session; /save, /reset."""

from __future__ import annotations

import json
import subprocess
import sys

import lever
from lever.shipped import shipped
from tests.conftest import ROOT

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


def chat(stdin: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lever", "chat", "-n", "16", "--set",
                           f"model.chat_template={json.dumps(TEMPLATE)}", *args], input=stdin, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_two_turns_are_one_conversation(tmp_path):
    p = chat(f"import os\nimport sys\n/save {tmp_path / 's.msgpack'}\n/reset\nimport sys\n/exit\n")
    assert p.returncode == 0, p.stderr
    with lever.load(shipped("default.toml"), chat_template=TEMPLATE) as llm, llm.session() as s:
        a = s.chat([{"role": "user", "content": "import os"}], max_tokens=16).text
        b = s.chat([{"role": "user", "content": "import sys"}], max_tokens=16).text
        c = llm.chat([{"role": "user", "content": "import sys"}], max_tokens=16).text
    assert p.stdout == f"{a}\n{b}\n{c}\n"
    assert "saved 4 messages" in p.stderr and "starts over" in p.stderr
    assert (tmp_path / "s.msgpack").is_file()


def test_a_model_without_a_template_is_refused_before_the_first_turn():
    p = subprocess.run([sys.executable, "-m", "lever", "chat"], input="hi\n", capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert p.returncode == 1 and "no chat template" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_a_template_that_fails_on_one_turn_costs_that_turn_only(tmp_path):
    picky = "{% if 'boom' in messages[-1].content %}{{ messages[-1].content.nope() + 1 }}{% endif %}" + TEMPLATE
    p = subprocess.run([sys.executable, "-m", "lever", "chat", "-n", "16", "--set",
                        f"model.chat_template={json.dumps(picky)}"], input=f"import os\nboom\nimport sys\n/save "
                       f"{tmp_path / 's.msgpack'}\n/exit\n", capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("lever: error:")]
    assert len(errors) == 1 and "chat template" in errors[0]
    with lever.load(shipped("default.toml"), chat_template=TEMPLATE) as llm, llm.session() as s:
        a = s.chat([{"role": "user", "content": "import os"}], max_tokens=16).text
        b = s.chat([{"role": "user", "content": "import sys"}], max_tokens=16).text
    assert p.stdout == f"{a}\n{b}\n"  # the conversation went on without the failed turn
    assert "saved 4 messages" in p.stderr
