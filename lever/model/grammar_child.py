"""Grammars compiled first in a child process: a compile's time, memory and crashes bounded.

Beside lever.model.grammar, which asks `CompileProcess.check` before it compiles a grammar
itself. The bounds (lever.model.bounds) keep out what is known to overflow the engine's stack,
exhaust its lexer or take it seconds; this keeps out what they miss. A compile that takes
longer than its time bound gets the child killed (SIGTERM and Ctrl-C stop the parent at once,
its compile is the child's), one that allocates past the child's data limit or crashes kills
only the child; the grammar is refused in one line, and the next compile starts a fresh child.

The child runs llguidance alone (no lever package beyond this file, no numpy), over a
vocabulary of the model's size whose tokens are the 256 bytes and the model's special tokens by
name and id (a grammar may name them; `<[151657]>`), the rest empty: what a grammar costs to
compile does not depend on the model's text tokens, whose trie the parent keeps once for all
grammars. It measures the bytes the compiled matcher holds (glibc's count of bytes in use,
before and after, the matcher alive), which the grammar cache and the memory plan count.

    with CompileProcess(n_vocab=tok.vocab_size, specials=tok.specials) as c:
        n_bytes = c.check(engine_text, timeout_s=3.0)  # CompileRefused(why) when it is not to be compiled

The protocol is one JSON line each way: the grammar (llguidance's text) and its limits in, the
bytes and seconds, or the engine's error, out.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import subprocess
import sys
import threading
import time

import attrs

DATA_LIMIT_BYTES = 512 << 20  # what a compile may allocate beyond the child's start
TIMEOUT_S = 3.0  # a compile's time bound (bounded grammars compile in under 0.5 s here)
START_TIMEOUT_S = 30.0
EXIT_WAIT_S = 10.0  # a child whose pipe closed is reaped within this


def child_bytes(n_vocab: int) -> int:
    """The child's own footprint, for the memory plan: the interpreter and the engine (~30 MB),
    and its vocabulary (34 MB RSS at 4,096 tokens, 51 MB at Qwen's 151,936, measured)."""
    return (32 << 20) + 128 * n_vocab


class CompileRefused(Exception):
    """The grammar is not to be compiled: the one line says why."""


@attrs.define
class CompileProcess:
    """The parent's end: one compile at a time (a lock), the child restarted after a kill."""

    n_vocab: int = 256
    specials: dict[str, int] = attrs.field(factory=dict)  # special-token text -> id (Tokenizer.specials)
    eos_id: int | None = None
    data_limit_bytes: int = DATA_LIMIT_BYTES
    limits: dict = attrs.field(factory=dict)  # llguidance's LLParserLimits, by keyword
    _proc: subprocess.Popen | None = None
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _closed: bool = False
    compiles: int = 0
    kills: int = 0  # compiles past their time bound

    def check(self, text: str, timeout_s: float = TIMEOUT_S) -> int:
        """The bytes `text` (llguidance's grammar) holds once compiled, found by compiling it in
        the child; CompileRefused when the engine refuses it, or it takes longer than
        `timeout_s`, runs out of the child's memory, or crashes it."""
        request = json.dumps({"text": text, "limits": self.limits}).encode() + b"\n"
        with self._lock:
            if self._closed:
                raise CompileRefused("the grammar compiler is closed (the server is stopping)")
            proc = self._child()
            self.compiles += 1
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
                line = _read_line(proc, time.monotonic() + timeout_s)
            except (OSError, ValueError):  # its pipe is gone: so is the child
                line = b""
            if not line:  # past its time (None), or the child died (b"": its memory bound, a crash, close())
                timed_out = line is None
                code = proc.poll() if timed_out else _exit_code(proc)
                self._kill()
                if self._closed:
                    raise CompileRefused("the grammar compiler is closed (the server is stopping)")
                if timed_out:
                    self.kills += 1
                    raise CompileRefused(f"took over {timeout_s:g} s to compile; refused")
                raise CompileRefused(f"the grammar engine died compiling it (exit {code}: over its "
                                     f"{self.data_limit_bytes >> 20} MiB memory bound, or a crash); refused")
        answer = json.loads(line)
        if answer.get("error"):
            raise CompileRefused(answer["error"])
        return int(answer["bytes"])

    def close(self) -> None:
        """Kills the child; a compile in progress (another thread) fails at once. Safe from any
        thread, more than once."""
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def __enter__(self) -> CompileProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        with self._lock:
            self._kill()

    def _child(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "lever.model.grammar_child", str(self.data_limit_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                # a group of its own: a terminal's Ctrl-C is the parent's to take (`lever chat` cancels a
                # reply with it and goes on); the parent ends the child, by EOF or kill
                process_group=0, env={**os.environ, "RAYON_NUM_THREADS": "1"})
            vocab = {"n_vocab": self.n_vocab, "specials": {str(i): t for t, i in self.specials.items()},
                     "eos": self.eos_id}
            try:
                self._proc.stdin.write(json.dumps(vocab).encode() + b"\n")
                self._proc.stdin.flush()
            except OSError:
                pass
            if _read_line(self._proc, time.monotonic() + START_TIMEOUT_S) != b"ready\n":
                self._kill()
                raise CompileRefused("the grammar compiler did not start")
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


def _exit_code(proc: subprocess.Popen) -> int | None:
    """A child whose output ended: its exit code (it closes its pipe a moment before it can be
    reaped; on a busy machine that moment is long enough for poll() to say "running")."""
    try:
        return proc.wait(timeout=EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        return None


def _read_line(proc: subprocess.Popen, deadline: float) -> bytes | None:
    """One line from the child by `deadline`; None when late, b"" when the child is gone."""
    fd, buf = proc.stdout.fileno(), bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b""
        buf += chunk
        if buf.endswith(b"\n"):
            return bytes(buf)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _bytes_in_use():
    """glibc's bytes allocated and not freed (heap and mmapped), or None where there is no
    mallinfo2 (another libc): then RSS stands in."""
    try:
        libc = ctypes.CDLL(None)
        f = libc.mallinfo2
        f.restype = _MallInfo2
    except (OSError, AttributeError):
        return lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return lambda: (lambda m: m.uordblks + m.hblkhd)(f())


def _serve(data_limit_bytes: int) -> None:
    """The child: caps its data segment, then compiles one grammar per line until EOF."""
    import llguidance as llg

    vocab = json.loads(sys.stdin.buffer.readline())
    n = max(vocab["n_vocab"], 257)
    specials = {int(i): t.encode() for i, t in vocab["specials"].items() if 256 <= int(i) < n}
    eos = vocab["eos"] if vocab["eos"] in specials else max(set(range(256, n)) - set(specials), default=256)
    specials.setdefault(eos, b"<eos>")

    class Vocabulary:  # the 256 bytes, the model's special tokens at their ids, the rest empty
        eos_token_id = eos
        bos_token_id = None
        tokens = [bytes([i]) for i in range(256)] + [b"\xff" + specials[i] if i in specials else b""
                                                     for i in range(256, n)]
        special_token_ids = sorted(specials)

        def __call__(self, text):
            return list(text if isinstance(text, bytes) else text.encode())

    tok = llg.LLTokenizer(llg.TokenizerWrapper(Vocabulary()))
    del Vocabulary.tokens
    in_use = _bytes_in_use()
    used = _data_bytes()
    resource.setrlimit(resource.RLIMIT_DATA, (used + data_limit_bytes, used + data_limit_bytes))
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        try:
            r = json.loads(line)
            before, t0 = in_use(), time.perf_counter()
            m = llg.LLMatcher(tok, r["text"], log_level=0, limits=llg.LLParserLimits(**r["limits"]))
            if not m.is_error():
                m.compute_bitmask()
            error = m.get_error() if m.is_error() else None
            answer = {"error": error and " ".join(error.split()).split(" <state>")[0][:300],
                      "bytes": max(in_use() - before, 0), "s": time.perf_counter() - t0}
            del m
        except MemoryError:
            answer = {"error": "the grammar engine ran out of memory compiling it"}
        except Exception as e:  # noqa: BLE001 -- whatever the engine raises is the grammar's failure: one line
            answer = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}
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
