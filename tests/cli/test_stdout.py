"""A stdout that is closed or goes away: `lever run --json >&-` is refused
before any work with one line (it used to exit 0 having written nothing), and a reader that
leaves mid-run (`lever run | head -c 20`) ends the command quietly with 141, 128 + SIGPIPE, as a
C tool killed by SIGPIPE ends (it used to print "error: : Broken pipe")."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT


def test_a_closed_stdout_is_refused_before_any_work():
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "lever", "run", "--json", "-n", "3"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=60, cwd=ROOT,
                          preexec_fn=lambda: __import__("os").close(1))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "lever: error: stdout is closed: what this command prints would be lost"
        " (redirect it to a file or to /dev/null)"]
    assert time.monotonic() - t0 < 10  # no model was opened (a run takes longer)


def test_a_reader_that_leaves_ends_the_run_quietly_with_141():
    for argv in (["run", "-n", "300"],
                 ["generate", "-m", "examples/models/stdlib-draft-q8_0.gguf", "-p", "def", "-n", "300"]):
        proc = subprocess.Popen([sys.executable, "-m", "lever", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=ROOT, stdin=subprocess.DEVNULL)
        assert len(proc.stdout.read(20)) == 20
        proc.stdout.close()  # the reader goes away, as `| head -c 20` does
        rc = proc.wait(timeout=60)
        err = proc.stderr.read().decode()
        assert rc == 141, (argv, rc, err)
        assert err == "", (argv, err)


NOISY = """
import ctypes, sys
import lever.cli.run as run
from lever.cli.main import entry
real = run.main
def noisy(args):  # what a backend's native library does (the QNN runtime logs to stdout)
    libc = ctypes.CDLL(None)
    libc.puts(b"native library noise")
    libc.fflush(None)
    return real(args)
run.main = noisy
sys.argv = ["lever", "run", "-n", "4", "--json"]
entry()
"""


def test_what_a_native_library_prints_goes_to_stderr_and_stdout_stays_one_json_object():
    import json

    proc = subprocess.run([sys.executable, "-c", NOISY], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # one object, nothing else
    assert len(out["tokens"]) == 4 and "native library noise" in proc.stderr


def test_a_term_while_the_result_waits_on_a_full_pipe_ends_the_run_at_once():
    # a reader that stops reading (a pipe of one page, never read): the run blocks writing its
    # JSON; one TERM must end it with 143, not leave the interpreter's last flush blocked again
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    cmd = [sys.executable, "-m", "lever", "run", "--json", "-n", "24", "--set", 'pipeline.baseline=""']
    proc = subprocess.Popen(cmd, stdout=w, stderr=subprocess.PIPE, cwd=ROOT, stdin=subprocess.DEVNULL)
    os.close(w)
    try:
        deadline = time.monotonic() + 240
        while "pipe_write" not in Path(f"/proc/{proc.pid}/wchan").read_text():  # blocked on the pipe
            assert proc.poll() is None and time.monotonic() < deadline, "the run never blocked on its pipe"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        assert rc == 128 + signal.SIGTERM, (rc, proc.stderr.read().decode())
        assert "interrupted (SIGTERM)" in proc.stderr.read().decode()
    finally:
        proc.kill()
        proc.wait()
        os.close(r)
