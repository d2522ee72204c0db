"""INT, TERM and HUP at random moments of `lever run`, `convert`, `calibrate` and `serve`: one
line, exit 128 + n, no temp file, thread or descriptor left; a signal during the imports ends
the command before it starts; a second one is a forced quit.

The commands run in a child process that sends itself the signal from a timer thread after a
delay drawn from a seeded generator, so each moment is reproducible from the printed seed. The
child then reports the threads and descriptors still there once `main` has returned (the
process's exit would hide them). The server runs as `python -m lever serve`, with a streamed
request in flight when the signal lands.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from lever import signals
from lever.shipped import shipped
from tests.conftest import ROOT
from tests.load import within

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SEED = int(os.environ.get("LEVER_SIGNAL_SEED", "18"))
MOMENTS = int(os.environ.get("LEVER_SIGNAL_MOMENTS", "1"))  # random moments per command and signal

DRIVER = r"""
from lever import signals
signals.install()  # as the console script's entry() does, before anything else
import json, os, sys, threading, time
from lever.cli.main import main
sig, delay, slow = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
if slow:  # convert's tensor writes slowed down, so a signal lands mid-write of a small file
    import lever.gguf.convert as cv
    write = cv._Writer.write_tensor_data
    def slow_write(self, *a, **k):
        time.sleep(slow)
        return write(self, *a, **k)
    cv._Writer.write_tensor_data = slow_write
fds0 = set(os.listdir("/proc/self/fd"))
threads0 = {t.ident for t in threading.enumerate()}
timer = threading.Timer(delay, os.kill, (os.getpid(), sig))
timer.start()
t0 = time.monotonic()
rc = main(sys.argv[4:])
ended_s = time.monotonic() - t0
timer.cancel(); timer.join()
deadline = time.monotonic() + 30  # executor threads wind down just after their last task (a loaded machine: later)
while time.monotonic() < deadline and [t for t in threading.enumerate() if t.ident not in threads0]:
    time.sleep(0.02)
threads = [t.name for t in threading.enumerate() if t.ident not in threads0]
fds = sorted(set(os.listdir("/proc/self/fd")) - fds0)
leaks = [os.readlink(f"/proc/self/fd/{f}") for f in fds if os.path.exists(f"/proc/self/fd/{f}")]
print("REPORT " + json.dumps({"rc": rc, "s": ended_s, "threads": threads, "fds": leaks}), file=sys.__stderr__)
sys.exit(rc)
"""


def moments(command: str, lo: float, hi: float) -> list[tuple[int, float]]:
    rng = random.Random(f"{SEED}-{command}")
    return [(s, rng.uniform(lo, hi)) for s in SIGNALS for _ in range(MOMENTS)]


def drive(sig: int, delay: float, argv: list[str], slow: float = 0.0,
          cwd=ROOT) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(int(sig)), f"{delay:.3f}", str(slow), *argv],
                          capture_output=True, text=True, timeout=120, cwd=cwd, stdin=subprocess.DEVNULL)
    lines = proc.stderr.strip().splitlines()
    report = json.loads(lines[-1].removeprefix("REPORT ")) if lines and lines[-1].startswith("REPORT ") else {}
    return proc, report


def check_stopped(proc, report: dict, sig: int, what: str) -> None:
    lines = [x for x in proc.stderr.strip().splitlines() if x and not x.startswith("REPORT ")]
    assert "Traceback" not in proc.stderr, f"{what}: {proc.stderr[-2000:]}"
    if proc.returncode == 0:  # the command was done before the signal: nothing to stop
        return
    assert proc.returncode == 128 + sig, f"{what}: exit {proc.returncode}: {proc.stderr[-800:]}"
    assert lines[-1] == f"lever: interrupted ({signal.Signals(sig).name})", what
    assert report["threads"] == [], f"{what}: threads left {report['threads']}"
    assert report["fds"] == [], f"{what}: descriptors left {report['fds']}"


# --- the module itself, in this process ----------------------------------------------------------


@pytest.fixture
def installed():
    signals.install()
    yield
    signals.uninstall()


def test_a_signal_before_arming_is_remembered_not_raised(installed):
    os.kill(os.getpid(), signal.SIGHUP)
    time.sleep(0.01)  # the handler runs at the next bytecode boundary
    assert signals.pending() == signal.SIGHUP


def test_armed_a_signal_raises_interrupted_with_its_number(installed):
    signals.arm()
    with pytest.raises(signals.Interrupted) as e:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert e.value.signum == signal.SIGTERM and isinstance(e.value, KeyboardInterrupt)
    assert signals.exit_code(e.value.signum) == 143


def test_a_stop_callback_takes_the_signal_instead(installed):
    got = []
    signals.arm()
    with signals.on_stop(got.append):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
    assert got == [signal.SIGINT] and signals.pending() == signal.SIGINT


def test_an_interrupt_taker_keeps_sigint_from_stopping_the_command(installed):
    taken = []
    signals.arm()
    with signals.on_interrupt(lambda: taken.append(1) or True):  # a chat's reply cancelled: it goes on
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)  # taken again, never a forced quit
        time.sleep(0.01)
    assert taken == [1, 1] and signals.pending() is None
    with signals.on_interrupt(lambda: False), pytest.raises(signals.Interrupted):  # declined: the ordinary stop
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    assert signals.pending() == signal.SIGINT


def test_an_interrupt_taker_leaves_term_alone(installed):
    signals.arm()
    with signals.on_interrupt(lambda: True), pytest.raises(signals.Interrupted) as e:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert e.value.signum == signal.SIGTERM


def test_uninstall_gives_back_the_handlers_it_found():
    before = {s: signal.getsignal(s) for s in SIGNALS}
    signals.install()
    assert all(signal.getsignal(s) is not before[s] for s in SIGNALS)
    signals.uninstall()
    assert {s: signal.getsignal(s) for s in SIGNALS} == before


def test_run_async_turns_a_signal_into_interrupted_after_the_task_group_unwinds(installed):
    import anyio

    unwound = []

    async def long_run():
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.sleep, 30)
                await anyio.sleep(0.05)
                os.kill(os.getpid(), signal.SIGTERM)
                await anyio.sleep(30)
        finally:
            unwound.append(True)

    signals.arm()
    t0 = time.monotonic()
    with pytest.raises(signals.Interrupted) as e:
        signals.run_async(long_run)
    assert e.value.signum == signal.SIGTERM and unwound == [True] and within(time.monotonic() - t0, 2.0)


# --- the commands ---------------------------------------------------------------------------------


def test_a_signal_during_the_imports_ends_the_command_before_it_starts():
    """The signal lands while the command modules import (before any model opens)."""
    for sig in SIGNALS:
        proc, report = drive(sig, 0.0, ["run", "-n", "5"])
        assert proc.returncode == 128 + sig and "Traceback" not in proc.stderr, proc.stderr[-1500:]
        assert within(report["s"], 5.0) and report["threads"] == [] and report["fds"] == [], report


@pytest.mark.parametrize(("sig", "delay"), moments("run", 0.3, 3.0))
def test_lever_run_stops_on_every_signal(sig, delay):
    proc, report = drive(sig, delay, ["run", "-n", "400"])
    print(f"run, {signal.Signals(sig).name} at {delay:.2f} s: exit {proc.returncode}")
    assert proc.returncode != 0, "the run ended before the signal: the moment is too late"
    check_stopped(proc, report, sig, f"run {signal.Signals(sig).name} at {delay:.2f} s")


@pytest.mark.parametrize(("sig", "delay"), moments("convert", 0.3, 1.2))
def test_lever_convert_stops_and_leaves_no_temp_file(tmp_path, sig, delay):
    src = shipped("models/stdlib-target-q4_0.gguf")
    out = tmp_path / "out" / "aligned.gguf"
    out.parent.mkdir()
    proc, report = drive(sig, delay, ["convert", str(src), str(out)], slow=0.02)
    print(f"convert, {signal.Signals(sig).name} at {delay:.2f} s: exit {proc.returncode}")
    check_stopped(proc, report, sig, f"convert {signal.Signals(sig).name} at {delay:.2f} s")
    left = sorted(p.name for p in out.parent.iterdir())
    assert left == ([] if proc.returncode else ["aligned.gguf"]), left


@pytest.mark.parametrize(("sig", "delay"), moments("calibrate", 0.5, 4.0))
def test_lever_calibrate_stops_and_leaves_no_artifact_or_temp_file(tmp_path, sig, delay):
    out = tmp_path / "artifact.msgpack"
    argv = ["calibrate", "-c", str(shipped("default.toml")), "--corpus", argparse.__file__, "--out", str(out),
            "--n-prompts", "6", "--n-gen", "16"]
    proc, report = drive(sig, delay, argv)
    print(f"calibrate, {signal.Signals(sig).name} at {delay:.2f} s: exit {proc.returncode}")
    check_stopped(proc, report, sig, f"calibrate {signal.Signals(sig).name} at {delay:.2f} s")
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if proc.returncode else ["artifact.msgpack"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", SIGNALS)
def test_lever_serve_drains_then_exits_on_every_signal(sig):
    """A streamed request in flight when the signal lands finishes (it has the grace period);
    the server then exits 128 + n with one line."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lever", "serve", "--port", str(port)], cwd=ROOT,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(150):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        body = json.dumps({"prompt": "def main", "max_tokens": 120, "stream": True}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            first = resp.readline()
            proc.send_signal(sig)
            rest = resp.read().decode()
        assert first.startswith(b"data: ") and rest.rstrip().endswith("data: [DONE]")
        rc = proc.wait(timeout=30)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 128 + sig and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"lever: interrupted ({signal.Signals(sig).name})"


def test_a_second_signal_during_cleanup_is_a_forced_quit():
    """The first SIGTERM starts the cleanup; one sent from inside it quits at once."""
    driver = r"""
import os, signal, sys
from lever.cli.main import main
import lever.cli.run as run
def slow_cleanup_run(args):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        import time; time.sleep(5)
    finally:
        os.kill(os.getpid(), signal.SIGINT)  # the impatient user
        import time; time.sleep(5)
        print("cleanup finished", file=sys.stderr)
run.main = slow_cleanup_run
sys.exit(main(["run", "-n", "1"]))
"""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert within(time.monotonic() - t0, 4.0)  # not the 10 s the cleanup would sleep
    assert proc.returncode == 128 + signal.SIGTERM and "cleanup finished" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "lever: forced quit (SIGINT during cleanup)"
