"""`lever serve` with clients that would crowd others out (issue 46's second review): one key's
slow bodies, a burst of /live readers, one key's many conversations, one key's runs seen from
another's /live; and fat bodies queued behind a slow generation in a cgroup of the server's own
--mem. Each on a live server over the shipped pair, with two keys: the attacker's and the one
that must still be served."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time

import httpx
import pytest

from lever.serve.page import MAX_READERS
from tests.serve.live import JSON, start_server, stderr_text, stop
from tests.serve.test_page import newest

KEYS = ("key-mallory", "key-bob")
DECLARED = 4 << 20  # each slow body's Content-Length: the body bound


def auth(key: str) -> dict:
    return {**JSON, "Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--api-key", KEYS[0], "--api-key", KEYS[1], "--timeout", "30", "--cache-ram", "4",
                             "--max-connections", "64", headers=auth(KEYS[1]))
    yield proc, url
    assert stop(proc) == 128 + signal.SIGINT
    assert "Traceback" not in stderr_text(proc), stderr_text(proc)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def test_slow_bodies_of_one_key_leave_another_key_served(server):
    """Six bodies of one key declare 4 MiB and send 12 bytes (once they held the whole pool of
    bodies): they hold what they sent, so the other key's completion and /tokenize are served."""
    url = server[1]
    slow = []
    try:
        for _ in range(6):
            s = _connect(url)
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      f"Authorization: Bearer {KEYS[0]}\r\nContent-Length: {DECLARED}\r\n\r\n"
                      '{"prompt": "'.encode())
            slow.append(s)
        time.sleep(0.5)  # their 12 bytes read
        r = httpx.post(url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 2}, headers=auth(KEYS[1]),
                       timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(url + "/tokenize", json={"content": "def f(x):"}, headers=auth(KEYS[1]), timeout=60)
        assert r.status_code == 200 and r.json()["tokens"], r.text
        for s in slow:  # they were being read all along: the server cuts each once it stalls (5 s)
            assert s.recv(64).split(b" ")[1] == b"408"
    finally:
        for s in slow:
            s.close()


def test_one_keys_requests_under_way_take_at_most_half_the_connections(server):
    """Forty slow bodies of one key on a server of 64 connections: 32 are read (slowly), the rest
    get 429 at once, and the other key, whose keep-alive the cap could close to make room, is
    served."""
    url = server[1]
    slow, statuses = [], []
    try:
        for _ in range(40):
            s = _connect(url)
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      f"Authorization: Bearer {KEYS[0]}\r\nContent-Length: 100\r\n\r\n{{".encode())
            slow.append(s)
        time.sleep(1.0)  # the refused answered at once; the rest still read (cut only after 5 s of nothing)
        for s in slow:
            s.setblocking(False)
            try:
                statuses.append(s.recv(64).split(b" ")[1])
            except BlockingIOError:
                statuses.append(b"reading")
        assert statuses.count(b"429") == 40 - 32 and statuses.count(b"reading") == 32, b" ".join(statuses)
        r = httpx.post(url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 2}, headers=auth(KEYS[1]),
                       timeout=60)
        assert r.status_code == 200, r.text
    finally:
        for s in slow:
            s.close()


def test_a_burst_of_live_readers_meets_the_bound(server):
    """Forty readers arriving together: at most MAX_READERS are answered 200, the rest 503, and
    once they leave their places come back."""
    url = server[1]
    socks = [_connect(url) for _ in range(40)]
    statuses = []
    try:
        for s in socks:  # all sent before any is answered: a burst
            s.sendall(f"GET /live HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS[1]}\r\n\r\n".encode())
        for s in socks:
            statuses.append(s.recv(64).split(b" ")[1])
    finally:
        for s in socks:
            s.close()
    assert statuses.count(b"200") == MAX_READERS and statuses.count(b"503") == 40 - MAX_READERS, statuses
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the places come back as the server sees the readers gone
        with httpx.stream("GET", url + "/live", headers=auth(KEYS[1]), timeout=30) as r:
            if r.status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError("the readers' places did not come back")


def test_an_idle_keys_live_sequence_does_not_move_with_anothers_runs(server):
    url = server[1]
    before = newest(url, auth(KEYS[1]))
    for n in (4, 16):
        r = httpx.post(url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": n}, headers=auth(KEYS[0]),
                       timeout=120)
        assert r.status_code == 200
    assert newest(url, auth(KEYS[1])) == before and newest(url, auth(KEYS[0])) > 0


def test_one_keys_conversations_do_not_push_out_anothers(server):
    """--cache-ram 4 with two keys: 2 MiB each (3,840 bytes a token on the shipped pair). Bob's
    170-token conversation comes back cached after Mallory's 14 conversations filled hers."""
    url = server[1]
    bob = [{"role": "user", "content": "def parse_args(argv): " * 24}]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": bob, "max_tokens": 4}, headers=auth(KEYS[1]),
                   timeout=120).json()
    n_bob = r["usage"]["prompt_tokens"]
    assert n_bob > 150
    for i in range(14):
        mallory = [{"role": "user", "content": f"class Thing{i}: " * 40}]
        assert httpx.post(url + "/v1/chat/completions", json={"messages": mallory, "max_tokens": 2},
                          headers=auth(KEYS[0]), timeout=120).status_code == 200
    bob2 = [*bob, {"role": "assistant", "content": r["choices"][0]["message"]["content"]},
            {"role": "user", "content": "more"}]
    again = httpx.post(url + "/v1/chat/completions", json={"messages": bob2, "max_tokens": 2}, headers=auth(KEYS[1]),
                       timeout=120).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= n_bob - 8, again["usage"]


# -- a server in a memory cgroup of its own --mem

MEM = 640 << 20


@pytest.fixture(scope="module")
def capped():
    from lever.cli.bench.cgroup import memory_group
    from lever.errors import LeverError

    try:
        group = memory_group(MEM)
        g = group.__enter__()
    except LeverError as e:
        pytest.skip(f"needs a writable memory cgroup (root): {e}")
    try:
        proc, url = start_server("--mem", str(MEM), "--cache-ram", "64", "--api-key", KEYS[0], "--api-key", KEYS[1],
                                 "--timeout", "30", headers=auth(KEYS[1]), wrap=g.joined)
        yield proc, url
        code = stop(proc)
        assert code == 128 + signal.SIGINT, (code, stderr_text(proc)[-2000:])
    finally:
        group.__exit__(None, None, None)


def _fat_body(n_objects: int) -> bytes:
    """A completion whose `metadata` (a field the server does not read) holds n empty objects."""
    return (b'{"prompt": "def f(x):", "max_tokens": 2, "metadata": [' + b",".join([b"{}"] * n_objects) + b"]}")


def test_fat_bodies_queued_behind_a_slow_generation_never_get_the_server_killed(capped):
    """A slow stream runs while ten 4 MiB bodies arrive, each a field of 1.4 million empty
    objects (100 MB each once parsed), and ten that parse (60,000 objects: 11 MiB by the parse
    bound, 150,000 would be over it) and queue: the
    server, in a cgroup of its own --mem, stays alive and within its printed plan."""
    proc, url = capped
    plan_mib = int(re.search(r"memory plan (\d+) MiB", stderr_text(proc)).group(1))
    statuses, lock = {"slow": [], "fat": [], "parsed": []}, threading.Lock()

    def post(kind: str, body: bytes) -> None:
        deadline = time.monotonic() + 120
        while True:  # as a client told 503 "try again" would (the fat ones too: they stay refused)
            try:
                status = httpx.post(url + "/v1/completions", content=body, headers=auth(KEYS[0]),
                                    timeout=300).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            if status != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        with lock:
            statuses[kind].append(status)

    slow = threading.Thread(target=post, args=("slow", json.dumps({"prompt": "def f(x):", "max_tokens": 400}).encode()))
    slow.start()
    posts = [threading.Thread(target=post, args=(kind, _fat_body(n)))
             for kind, n in [("fat", 1_398_000)] * 10 + [("parsed", 60_000)] * 10]
    for t in posts:
        t.start()
    for t in [slow, *posts]:
        t.join(600)
    assert proc.poll() is None, f"the server died: {stderr_text(proc)[-1000:]}"
    assert statuses["slow"] == [200], statuses
    assert statuses["fat"] == [413] * 10, statuses  # each refused by the parse bound once it got in
    assert set(statuses["parsed"]) <= {200, 429} and 200 in statuses["parsed"], statuses  # 429: the queue full
    peak_mib = int(re.search(r"VmHWM:\s+(\d+) kB", open(f"/proc/{proc.pid}/status").read()).group(1)) / 1024
    assert peak_mib <= plan_mib, f"peak RSS {peak_mib:.0f} MiB over the plan's {plan_mib}"
