"""A `lever serve` process on the shipped pair for the tests: started on a free port, waited
for on /health, stopped by the caller."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
QUEUE = 4
JSON = {"Content-Type": "application/json"}
START_S = 180  # a server answers /health in 2-5 s on an idle machine; waited for, so a busy one may take longer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str, queue: int = QUEUE, template: str | None = TEMPLATE, headers: dict | None = None,
                 wrap=None):
    """(the process, its base URL); its stderr goes to a file (a pipe nobody reads could fill
    and stall it), read with `stderr_text(proc)`. `wrap`: the command line as it should run
    (lever.cli.bench.cgroup.Group.joined: inside a memory cgroup)."""
    port = _free_port()
    sets = ["--set", f"model.chat_template={json.dumps(template)}"] if template else []
    err = tempfile.TemporaryFile("w+")
    cmd = [sys.executable, "-m", "lever", "serve", "--port", str(port), "--queue", str(queue), *sets, *extra]
    proc = subprocess.Popen(wrap(cmd) if wrap else cmd, stderr=err, stdin=subprocess.DEVNULL, text=True)
    proc.err_file = err
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1, headers=headers).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            if proc.poll() is not None:
                raise AssertionError(f"lever serve exited: {stderr_text(proc)}")
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"lever serve did not answer /health within {START_S} s")




def stderr_text(proc: subprocess.Popen) -> str:
    proc.err_file.seek(0)
    return proc.err_file.read()


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout_s: float = 20) -> int:
    """Signals the server and waits; kills it and fails when it does not stop in time."""
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"lever serve did not stop within {timeout_s} s of {signal.Signals(sig).name}") from None
