"""`lever chat` fed from a pipe: turns stream through the template in one session; /save, /reset,
/set; the shipped pair chats with no config. On a pseudo-terminal: lines edited with readline (the
arrow keys move, up recalls), history kept in a file, Ctrl-C cancels a reply and the chat goes on,
drops a line being typed, and at an empty prompt stops the chat; cut and cancelled replies are marked."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time

import lever
from lever.gguf.chat_template import CHATML
from lever.pipelines import saved_session
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


def test_a_model_without_a_template_chats_in_chatml_and_says_so_once():
    p = subprocess.run([sys.executable, "-m", "lever", "chat", "-n", "8", "--set", 'model.chat_template=""'],
                       input="import os\n/exit\n", capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    said = [ln for ln in p.stderr.splitlines() if "no chat template" in ln]
    assert len(said) == 1 and said[0].startswith("lever chat: ") and "chats use ChatML" in said[0]
    with lever.load(shipped("default.toml"), overrides=['model.chat_template=""']) as llm:  # llama-server's fallback
        assert llm.chat_template.text == CHATML
        assert p.stdout == llm.chat([{"role": "user", "content": "import os"}], max_tokens=8).text + "\n"


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


def test_the_shipped_pair_chats_with_no_config(tmp_path):
    """Its template is examples/default.toml's: the conversation as one Python file; a reply cut by
    -n is marked on stderr, stdout holds the replies alone."""
    p = subprocess.run([sys.executable, "-m", "lever", "chat", "-n", "12"], capture_output=True, text=True,
                       input=f"import os\n/save {tmp_path / 's'}\n", timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    with lever.load(shipped("default.toml")) as llm:
        c = llm.chat([{"role": "user", "content": "import os"}], max_tokens=12)
    assert p.stdout == f"{c.text}\n" and c.finish_reason == "length"
    assert "[cut at 12 tokens: /set n N or -n N for longer replies]" in p.stderr
    assert [m["role"] for m in saved_session.load(tmp_path / "s").messages] == ["user", "assistant"]


def test_set_changes_a_knob_for_the_replies_after_it_and_a_bad_one_is_one_line():
    p = chat("/set n 3\nimport os\n/set temp hot\n/set nope 1\n/set n 0\n/set\n/exit\n")
    assert p.returncode == 0, p.stderr
    assert "[cut at 3 tokens" in p.stderr and "(n = 3)" in p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("lever: error:")]
    assert len(errors) == 3 and "/set temp: expected a number" in errors[0] and "no knob 'nope'" in errors[1]
    assert errors[2].startswith("lever: error: /set n: must be")
    assert "(n 3 · temp 0 · " in p.stderr


# --- on a pseudo-terminal ------------------------------------------------------------------------

DEADLINE_S = 120  # for what takes a second or two on an idle machine: waited on, never slept


class Terminal:
    """`lever chat` on a pseudo-terminal (its controlling terminal: Ctrl-C is the terminal's
    SIGINT), keys in, everything it shows out."""

    def __init__(self, tmp_path, *args: str):
        env = {**os.environ, "XDG_STATE_HOME": str(tmp_path), "TERM": "dumb", "NO_COLOR": "1"}
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: nothing but exec, and never back into pytest
            try:
                os.chdir(ROOT)
                os.execve(sys.executable, [sys.executable, "-m", "lever", "chat", *args], env)
            except BaseException as e:
                os.write(2, f"exec failed: {e!r}\n".encode())
            finally:
                os._exit(127)
        self.seen = b""  # all output so far
        self.at = 0  # output before this was waited for

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def wait_for(self, text: bytes) -> bytes:
        """The output from where the last wait ended up to and including `text`."""
        deadline = time.monotonic() + DEADLINE_S
        while (i := self.seen.find(text, self.at)) < 0:
            assert self._read(deadline), f"no {text!r} in {self.seen[self.at:]!r}"
        got, self.at = self.seen[self.at : i + len(text)], i + len(text)
        return got

    def _read(self, deadline: float) -> bool:
        r, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            return False
        try:
            data = os.read(self.fd, 4096)
        except OSError:  # the child is gone (EIO)
            return False
        self.seen += data
        return bool(data)

    def exit_code(self) -> int:
        deadline = time.monotonic() + DEADLINE_S
        while self._read(deadline):
            pass
        while (done := os.waitpid(self.pid, os.WNOHANG))[0] == 0:  # bounded: a chat that never ends fails
            assert time.monotonic() < deadline + DEADLINE_S, f"lever chat did not exit: {self.seen[-500:]!r}"
            time.sleep(0.05)
        status = done[1]
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def shown(output: bytes) -> str:
    """Terminal output as the text written (the terminal's \\r\\n is the program's \\n)."""
    return output.decode().replace("\r\n", "\n")


def test_arrow_keys_edit_the_line_up_recalls_it_and_the_history_is_kept(tmp_path):
    t = Terminal(tmp_path, "-n", "4")
    try:
        t.wait_for(b"> ")
        t.type(b"abc\x1b[D\x1b[DX\r")  # left, left, X: "aXbc"
        t.wait_for(b"> ")
        t.type(b"\x1b[A\r")  # up: the last line again
        t.wait_for(b"> ")
        t.type(f"/save {tmp_path / 's'}\r".encode())
        t.wait_for(b"saved")
        t.type(b"\x04")  # Ctrl-D: the end
        assert t.exit_code() == 0, t.seen
    finally:
        t.kill()
    assert b"^[[" not in t.seen  # the keys edited the line, none was printed
    turns = [m["content"] for m in saved_session.load(tmp_path / "s").messages if m["role"] == "user"]
    assert turns == ["aXbc", "aXbc"]
    assert shown(t.seen).count("[cut at 4 tokens: /set n N or -n N for longer replies]\n") == 2
    history = (tmp_path / "lever" / "chat_history").read_text().splitlines()
    assert history == ["aXbc", f"/save {tmp_path / 's'}"]  # a line the same as the one before is kept once


def test_ctrl_c_cancels_the_reply_and_the_conversation_keeps_what_was_shown(tmp_path):
    t = Terminal(tmp_path, "-n", "500")  # fitted to the context: a reply of seconds
    try:
        t.wait_for(b"> ")
        t.type(b"def f():\r")
        t.wait_for(b"def f():\r\n")
        while len(t.seen) == t.at:  # until the reply has begun
            assert t._read(time.monotonic() + DEADLINE_S), t.seen
        t.type(b"\x03")
        reply = shown(t.wait_for(b" [cancelled]\r\n> ")).removesuffix(" [cancelled]\n> ").replace("^C", "")
        t.type(b"/set n 3\rimport os\r")
        t.wait_for(b"[cut at 3 tokens")  # the chat went on: the next turn was answered
        t.wait_for(b"> ")
        t.type(f"/save {tmp_path / 's'}\r".encode())
        t.wait_for(b"saved")
        t.type(b"/exit\r")
        assert t.exit_code() == 0, t.seen
    finally:
        t.kill()
    messages = saved_session.load(tmp_path / "s").messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert reply and messages[1]["content"] == reply


def test_ctrl_c_drops_a_line_being_typed_and_at_an_empty_prompt_stops_the_chat(tmp_path):
    t = Terminal(tmp_path, "-n", "4")
    try:
        t.wait_for(b"> ")
        t.type(b"import os")
        t.wait_for(b"import os")  # read by the line editor before Ctrl-C (the terminal flushes what is not)
        t.type(b"\x03")
        t.wait_for(b"> ")
        t.type(b"\x03")
        t.wait_for(b"lever: interrupted (SIGINT)")
        assert t.exit_code() == 128 + signal.SIGINT
    finally:
        t.kill()
    assert b"[cut at" not in t.seen  # the dropped line was never a turn


def test_chat_points_at_a_model_with_no_config():
    """`lever chat -m TARGET -md DRAFT` as run's and serve's: no config, the model's own (here
    ChatML's fallback) template, the same replies as the API loaded the same way; without -md the
    free sources draft, said in one line; a draft without its target is one line naming -md."""
    from lever.pipelines.pairing import pair

    target, draft = (ROOT / "examples" / "models" / n for n in ("stdlib-target-q4_0.gguf", "stdlib-draft-q8_0.gguf"))
    for flags, note in [(["-md", str(draft)], None), ([], "no draft model given (-md)")]:
        p = subprocess.run([sys.executable, "-m", "lever", "chat", "-n", "8", "-m", str(target), *flags],
                           input="import os\n/exit\n", capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert p.returncode == 0, p.stderr
        assert (note in p.stderr) if note else "drafting from" not in p.stderr
        with lever.load(shipped("model.toml"), overrides=list(pair(str(target), str(draft) if flags else None).sets)
                        ) as llm:
            assert p.stdout == llm.chat([{"role": "user", "content": "import os"}], max_tokens=8).text + "\n"
    p = subprocess.run([sys.executable, "-m", "lever", "chat", "-md", str(draft)], input="", capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert p.returncode != 0 and len(p.stderr.strip().splitlines()) == 1 and "-md" in p.stderr
