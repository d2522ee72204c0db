"""Chat templates rendered in a child process: a template's time and memory bounded.

A Jinja2 template is a program. The sandbox (lever.gguf.chat_template) keeps it from reaching
anything, but not from running long (nested loops) or allocating without end (`'a' * 10**10`),
and a Python thread cannot be stopped from outside. So every chat renders in one child process
(an LLM's, lever.api; `lever serve` renders through its LLM's), started on first use: its data
segment is capped (RLIMIT_DATA) and a render that takes longer than its time bound gets the
child killed, the call a one-line refusal, and the next render a fresh child. The child is the
only place a template's code runs; it holds no model.

    with RenderProcess() as r:
        rendered = r.render(template, messages, specials=..., timeout_s=2.0)

The protocol is one JSON line each way: the template and messages in, the text and the offsets
of special-token text that came from the messages (ChatTemplate.render_marked) out.
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import attrs

from lever.gguf.chat_template import MAX_RENDER_CHARS, ChatTemplate, Rendered, TemplateError

DATA_LIMIT_BYTES = 256 << 20  # what a render may allocate beyond the child's start
START_TIMEOUT_S = 30.0
RENDER_TIMEOUT_S = 10.0  # a render in the library (a server gives its request timeout): a chat's takes ms
CLOSED = "chat template: the renderer is closed (its LLM or server is stopping)"


@attrs.define
class RenderProcess:
    """The parent's end: one render at a time (a lock), the child restarted after a kill."""

    data_limit_bytes: int = DATA_LIMIT_BYTES
    _proc: subprocess.Popen | None = None
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _closed: bool = False
    renders: int = 0
    kills: int = 0  # renders past their time bound

    def render(self, template: ChatTemplate, messages: Sequence[dict], add_generation_prompt: bool = True, *,
               specials: Sequence[str], timeout_s: float, max_chars: int = MAX_RENDER_CHARS,
               tools: list[dict] | None = None, variables: dict | None = None,
               continue_final: bool = False) -> Rendered:
        """`template.render_marked(...)` in the child; TemplateError on any failure of the
        template, on its time bound, or when the renderer was closed."""
        request = json.dumps({"text": template.text, "source": template.source, "bos": template.bos_token,
                              "eos": template.eos_token, "messages": list(messages),
                              "add_generation_prompt": add_generation_prompt, "specials": list(specials),
                              "max_chars": max_chars, "tools": tools, "variables": variables,
                              "continue_final": continue_final}).encode() + b"\n"
        with self._lock:
            if self._closed:
                raise TemplateError(CLOSED)
            proc = self._child()
            self.renders += 1
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
                line = _read_line(proc, time.monotonic() + timeout_s)
            except (OSError, ValueError):
                line = None
            if line is None:  # past its time, or the child died (its memory cap, or close())
                timed_out = proc.poll() is None
                self._kill()
                if self._closed:
                    raise TemplateError(CLOSED)
                if timed_out:
                    self.kills += 1
                    raise TemplateError(f"{template.source}: chat template: took over {timeout_s:g} s to render; "
                                        "refused")
                raise TemplateError(f"{template.source}: chat template: the renderer died (over its "
                                    f"{self.data_limit_bytes >> 20} MiB memory bound?)")
        answer = json.loads(line)
        if "error" in answer:
            raise TemplateError(answer["error"])
        return Rendered(answer["text"], tuple(answer["foreign"]))

    @property
    def pid(self) -> int | None:
        """The child's process id; None before the first render and once it is gone."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def close(self) -> None:
        """Kills the child; a render in progress (another thread) fails at once. Safe to call
        from any thread, more than once."""
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def stop(self) -> None:
        """close(), then the child reaped (waits for a render in another thread to fail)."""
        self.close()
        with self._lock:
            self._kill()

    def __enter__(self) -> RenderProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _child(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "lever.gguf.render_child", str(self.data_limit_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                # a group of its own: a terminal's Ctrl-C is the parent's to take (`lever chat` cancels a
                # reply with it and goes on); the parent ends the child, by EOF or kill
                process_group=0, env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
            if _read_line(self._proc, time.monotonic() + START_TIMEOUT_S) != b"ready\n":
                self._kill()
                raise TemplateError("chat template: the renderer did not start")
        return self._proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass


def _read_line(proc: subprocess.Popen, deadline: float) -> bytes | None:
    """One line from the child by `deadline`, or None (late, or the child is gone)."""
    fd, buf = proc.stdout.fileno(), bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        buf += chunk
        if buf.endswith(b"\n"):
            return bytes(buf)


def _serve(data_limit_bytes: int) -> None:
    """The child: caps its own data segment, then renders one request per line until EOF."""
    used = _data_bytes()
    resource.setrlimit(resource.RLIMIT_DATA, (used + data_limit_bytes, used + data_limit_bytes))
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        try:
            r = json.loads(line)
            t = ChatTemplate(r["text"], r["source"], r["bos"], r["eos"])
            rendered = t.render_marked(r["messages"], r["add_generation_prompt"], specials=r["specials"],
                                       max_chars=r["max_chars"], tools=r["tools"], variables=r["variables"],
                                       continue_final=r["continue_final"])
            answer = {"text": rendered.text, "foreign": list(rendered.foreign)}
        except TemplateError as e:
            answer = {"error": str(e)}
        except MemoryError:
            answer = {"error": "chat template: ran out of memory"}
        except Exception as e:  # noqa: BLE001 -- anything else is the template's failure too: one line
            answer = {"error": f"chat template: {type(e).__name__}: {str(e)[:200]}"}
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()


def _data_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
