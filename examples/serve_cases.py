"""Issue 34's cases against a `lever serve` on the shipped pair, one line each:

    python examples/serve_cases.py python -m lever

LAUNCHER (the arguments) is how to start `lever`: another checkout's, to compare before and
after. Each case is what a hostile client or template does; its line says what the server
answered and how fast, and whether /health and SIGTERM still worked (docs/measurements.md, 'A
server among hostile clients', has a run before and after issue 34).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
RAISING = "{% for m in messages %}{{ m.role + 1 }}{% endfor %}"
ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
JSON = {"Content-Type": "application/json"}


class Server:
    def __init__(self, launcher: list[str], template: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([*launcher, "serve", "--port", str(self.port), "--set",
                                      f"model.chat_template={json.dumps(template)}"], stderr=self.err,
                                     stdin=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(300):
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise SystemExit("the server did not start")

    def post(self, path: str, body, headers=JSON, timeout: float = 60) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body)
        return httpx.post(self.url + path, content=content, headers=headers, timeout=timeout)

    def stop(self, sig=signal.SIGINT, timeout_s: float = 20) -> str:
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            return f"exit {self.proc.wait(timeout_s)} after {time.monotonic() - t0:.1f} s"
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return f"still running after {timeout_s:g} s (killed)"

    def tracebacks(self) -> int:
        self.err.seek(0)
        return self.err.read().count("Traceback")


def kind(r: httpx.Response) -> str:
    return f"{r.status_code} {r.headers.get('content-type', '').split(';')[0]}"


def big_bodies(s: Server) -> dict[str, str]:
    """A 3.5 MB prompt beside /health, a declared 500 MB body, JSON nested 50,000 deep."""
    rows = {}
    big, out = json.dumps({"prompt": "x = 1\n" * 500_000, "max_tokens": 4}).encode(), {}

    def send_big():
        t0 = time.monotonic()
        out["big"] = (s.post("/v1/completions", big).status_code, time.monotonic() - t0)

    t, worst = threading.Thread(target=send_big), 0.0
    t.start()
    while t.is_alive():
        t0 = time.monotonic()
        httpx.get(s.url + "/health", timeout=60)
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    rows["3.5 MB prompt: status, time; worst /health"] = f"{out['big'][0]} after {out['big'][1]:.2f} s; " \
                                                         f"{worst * 1000:.0f} ms"
    with socket.create_connection(("127.0.0.1", s.port), timeout=5) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 524288000\r\n\r\n")
        try:
            rows["declared 500 MB body"] = c.recv(64).split(b"\r\n")[0].decode()
        except TimeoutError:
            rows["declared 500 MB body"] = "no answer in 5 s (reading the body)"
    rows["JSON nested 50,000 deep"] = kind(s.post("/v1/completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000
                                                  + b"}"))
    return rows


def odd_requests(s: Server) -> dict[str, str]:
    """Requests a browser, a forger or an impatient client sends, and what the server leaves behind."""
    rows = {}
    rows["404"] = kind(httpx.get(s.url + "/nope"))
    rows["echo: true"] = kind(s.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "echo": True}))
    rows["text/plain POST (a cross-site form)"] = kind(s.post("/v1/completions", {"prompt": "x", "max_tokens": 2},
                                                              {"Content-Type": "text/plain"}))
    rows["a rebound Host"] = kind(s.post("/v1/completions", {"prompt": "x", "max_tokens": 2},
                                         {**JSON, "Host": "attacker.example"}))
    forged = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "a<|endoftext|>b"}],
                                             "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    near = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "a<|endoftext|b"}],
                                           "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    rows["<|endoftext|> inside a message: prompt tokens (a near-miss text's)"] = f"{forged} ({near})"
    with httpx.stream("POST", s.url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 400,
                                                               "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        for _ in range(3):
            try:
                s.post("/v1/completions", {"prompt": "x", "max_tokens": 2}, timeout=0.2)
            except httpx.TimeoutException:
                pass
        time.sleep(1)
    s.stop()
    rows["tracebacks after 3 clients left the queue"] = str(s.tracebacks())
    return rows


def bad_templates(launcher: list[str]) -> dict[str, str]:
    """A chat template that raises, and one that never ends: /health and SIGTERM beside it."""
    rows, out = {}, {}
    s = Server(launcher, RAISING)
    rows["a template raising TypeError"] = kind(s.post("/v1/chat/completions", {"messages": [{"role": "user",
                                                                                              "content": "x"}]}))
    s.stop()
    s = Server(launcher, ENDLESS)

    def chat():
        try:
            out["chat"] = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                                 timeout=30).status_code
        except httpx.HTTPError as e:
            out["chat"] = type(e).__name__

    t = threading.Thread(target=chat)
    t.start()
    time.sleep(1)
    t0 = time.monotonic()
    try:
        httpx.get(s.url + "/health", timeout=3)
        rows["/health during an endless render"] = f"{(time.monotonic() - t0) * 1000:.0f} ms"
    except httpx.HTTPError:
        rows["/health during an endless render"] = "no answer in 3 s"
    rows["SIGTERM during an endless render"] = s.stop(signal.SIGTERM, 15)
    t.join(30)
    rows["that chat's client got"] = str(out.get("chat"))
    return rows


def main(launcher: list[str]) -> None:
    s = Server(launcher, TEMPLATE)
    rows = big_bodies(s) | odd_requests(s)
    rows |= bad_templates(launcher)
    for k, v in rows.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main(sys.argv[1:] or [sys.executable, "-m", "lever"])
