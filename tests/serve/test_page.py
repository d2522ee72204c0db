"""The live page (lever.serve.page): served from the package with nothing from elsewhere, its
/live events following each generation, keyed per client, bounded, and, in a real headless
chromium, a request made through the page streams its answer (the same text the API gives)
while the tree, the charts and the timeline follow the run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import threading
import time
from importlib import resources

import httpx
import pytest

import lever
from lever.gguf.chat_template import CHATML
from lever.serve import PAGE_FILES
from lever.serve.dialect import public
from lever.serve.page import MAX_READERS
from lever.shipped import shipped
from tests.serve.browser import chrome, severe_logs
from tests.serve.live import JSON, TEMPLATE, start_server, stderr_text, stop

SVG_NAMESPACE = "http://www.w3.org/2000/svg"  # a name in the script, never fetched
READY_S = 60  # a deadline for what takes well under a second on an idle machine (waited on, never slept)


def test_the_page_is_the_packages_own_files_under_a_strict_policy(server):
    url = server[1]
    r = httpx.get(url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    assert set(re.findall(r'(?:src|href)="([^"]+)"', r.text)) == {"/page/lever.js", "/page/lever.css", "data:,"}
    for name in PAGE_FILES:
        text = resources.files("lever.serve").joinpath("static", name).read_text()
        assert httpx.get(f"{url}/page/{name}").text == text
        assert not re.findall(r"(?:https?:)?//[\w.-]+\.\w+/", text.replace(SVG_NAMESPACE, "")), name  # no CDN
        assert "innerHTML" not in text  # token text reaches the page as textContent only
    for bad in ("server.py", "..%2Fserver.py", "lever.jsx"):
        assert httpx.get(f"{url}/page/{bad}").status_code == 404


def test_props_tells_the_page_whether_to_chat(server):
    props = httpx.get(server[1] + "/props").json()
    assert props["chat_template"] == TEMPLATE and props["total_slots"] == 1
    assert props["default_generation_settings"]["n_ctx"] > 0
    proc, url = start_server("--set", 'model.chat_template=""', template=None)  # the GGUF's own: none
    try:  # llama-server's fallback: ChatML, so the page chats
        assert httpx.get(url + "/props").json()["chat_template"] == CHATML
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        r = httpx.post(url + "/apply-template", json={"messages": [{"role": "user", "content": "x"}]}, timeout=60)
        assert r.json() == {"prompt": "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"}
    finally:
        stop(proc)
    said = [ln for ln in stderr_text(proc).splitlines() if "no chat template" in ln]
    assert len(said) == 1 and "stdlib-target-q4_0.gguf: no chat template; chats use ChatML" in said[0]  # once, at start


def test_a_message_to_a_client_names_a_file_never_where_it_sits():
    assert public("/srv/models/m.gguf: no chat template; /etc/lever/a.toml: [model] x") == \
        "m.gguf: no chat template; a.toml: [model] x"
    for kept in ("Content-Type: must be application/json", "see http://host/a/b", "a/b/c relative", "/v1"):
        assert public(kept) == kept


def test_the_shipped_pair_chats_out_of_the_box():
    """No config, no template given: examples/default.toml's, which the page's chat box uses."""
    proc, url = start_server(template=None)
    try:
        with lever.load(shipped("default.toml")) as llm:
            template = llm.chat_template.text
            want = llm.chat([{"role": "user", "content": "import os"}], max_tokens=8).text
        assert httpx.get(url + "/props").json()["chat_template"] == template
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "import os"}],
                                                           "max_tokens": 8}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
    finally:
        stop(proc)


def read_live(url: str, until, headers=None, since: int | None = None, timeout_s: float = 60,
              reading: threading.Event | None = None, events: list | None = None) -> list[dict]:
    """The /live events until `until(event)` is true (or the stream or the time runs out), in
    `events` as they come when given. `reading` is set once the server has answered, that is,
    once it counts this reader."""
    events = [] if events is None else events
    q = f"?since={since}" if since is not None else ""
    with httpx.stream("GET", f"{url}/live{q}", headers=headers, timeout=timeout_s) as r:
        assert r.status_code == 200, r.read()
        if reading is not None:
            reading.set()
        deadline = time.monotonic() + timeout_s
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:], parse_constant=lambda c: pytest.fail(f"{c} in an event")))
                if until(events[-1]):
                    break
            assert time.monotonic() < deadline, "the events stopped before the end"
    return events


class Follower(threading.Thread):
    """read_live in a thread of its own, started by `follow`, which returns only once the server
    counts the reader: a Watch builds a cycle's event only while someone reads /live, so a
    generation asked for before the reader is in would lose its first cycles (and on a loaded
    machine the reader thread may well come in late)."""

    def __init__(self, url: str, until, **kw) -> None:
        super().__init__(daemon=True)
        self.args, self.reading = (url, until, kw), threading.Event()
        self.events: list[dict] = []  # as they come
        self.error: BaseException | None = None

    def run(self) -> None:
        url, until, kw = self.args
        try:
            read_live(url, until, reading=self.reading, events=self.events, **kw)
        except BaseException as e:  # raised in the test's thread, by follow or result
            self.error = e
        finally:
            self.reading.set()

    def follow(self) -> Follower:
        self.start()
        assert self.reading.wait(READY_S), f"/live did not answer within {READY_S} s"
        if self.error is not None:
            raise self.error
        return self

    def result(self) -> list[dict]:
        self.join(READY_S + self.args[2].get("timeout_s", 60))
        assert not self.is_alive(), "the /live reader did not end"
        if self.error is not None:
            raise self.error
        return self.events


def newest(url: str, headers=None) -> int:
    with httpx.stream("GET", url + "/live", headers=headers, timeout=READY_S) as r:
        for line in r.iter_lines():
            if m := re.match(r": lever live, newest (\d+)", line):
                return int(m.group(1))
    raise AssertionError("no 'newest' line")


def test_live_events_follow_a_generation(server):
    url = server[1]
    start = newest(url)
    reader = Follower(url, lambda e: e["type"] == "end", since=start).follow()
    body = httpx.post(url + "/v1/completions", headers=JSON, timeout=60,
                      json={"prompt": "def parse_args(argv):", "max_tokens": 32, "temperature": 0}).json()
    got = reader.result()
    assert got and got[0]["type"] == "run" and got[-1]["type"] == "end"
    usage = body["usage"]  # (the prompt's head may be cached from an earlier run on this server)
    assert got[0]["n_past"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert got[0]["n_prompt"] + got[0]["n_past"] == usage["prompt_tokens"]
    cycles = [e for e in got if e["type"] == "cycle"]
    assert len(cycles) == body["timings"]["passes"]
    assert sum(len(c["emitted"]) for c in cycles) == body["usage"]["completion_tokens"] == got[-1]["n_tokens"]
    assert sum(c["drafted_kept"] for c in cycles) == body["timings"]["draft_n_accepted"]
    assert all(c["nodes"] and c["spans"] for c in cycles[1:])


def test_a_reader_past_the_bound_is_refused(server):
    url = server[1]
    with httpx.Client(timeout=READY_S) as c:
        streams = [c.stream("GET", url + "/live") for _ in range(MAX_READERS)]
        opened = [s.__enter__() for s in streams]
        try:
            lines = [r.iter_lines() for r in opened]  # kept: a line iterator dropped closes its response
            for it in lines:  # each has started: its first line came
                next(it)
            extra = httpx.get(url + "/live", timeout=READY_S)
            assert extra.status_code == 503 and "/live" in extra.json()["error"]["message"]
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    deadline = time.monotonic() + READY_S  # the readers gone (each notices at its next write), a new one is let in
    while time.monotonic() < deadline:
        with httpx.stream("GET", url + "/live", timeout=READY_S) as again:
            if again.status_code == 200:
                return
        time.sleep(0.1)
    pytest.fail("a reader was refused after the others left")


def test_readers_that_never_read_hold_up_nothing_but_their_places(server):
    """A page that stops reading its socket: the server's writes to it wait, the ring does not
    grow for it, and generations and /health go on."""
    url = server[1]
    port = int(url.rsplit(":", 1)[1])
    socks = []
    try:
        for _ in range(MAX_READERS):
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(b"GET /live?since=0 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            socks.append(s)
        deadline = time.monotonic() + READY_S
        while True:  # each stalled reader holds its place
            with httpx.stream("GET", url + "/live", timeout=READY_S) as r:
                if r.status_code == 503:
                    break
            assert time.monotonic() < deadline, "the stalled readers were never counted"
            time.sleep(0.1)
        for _ in range(3):  # every cycle of these is an event the stalled readers never take
            r = httpx.post(url + "/v1/completions", headers=JSON, timeout=60,
                           json={"prompt": "def f(x):", "max_tokens": 48})
            assert r.status_code == 200
        assert httpx.get(url + "/health", timeout=READY_S).status_code == 200
    finally:
        for s in socks:
            s.close()


def test_no_page_serves_neither_the_page_nor_its_events():
    proc, url = start_server("--no-page")
    try:
        assert httpx.get(url + "/").status_code == 404
        assert httpx.get(url + "/live").status_code == 404
        assert "live page 0" in stderr_text(proc)
    finally:
        stop(proc)


def test_with_keys_the_page_opens_but_each_client_sees_only_its_own_trees():
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    proc, url = start_server("--api-key", "key-a", "--api-key", "key-b", headers=a)
    try:
        assert httpx.get(url + "/").status_code == 200  # a browser opens a page without a key
        assert httpx.get(url + "/page/lever.js").status_code == 200
        assert httpx.get(url + "/live").status_code == 401
        # B reads until the server ends its stream: it never leaves of itself (pings keep it in)
        reader_b = Follower(url, lambda e: False, headers=b, timeout_s=120).follow()
        reader_a = Follower(url, lambda e: e["type"] == "end", headers=a, since=newest(url, a)).follow()
        r = httpx.post(url + "/v1/completions", headers={**JSON, **a}, timeout=60,
                       json={"prompt": "import os", "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 2
        assert any(e["type"] == "cycle" for e in reader_a.result())
        # then B's own run (told from A's by its length): once B's reader has had that run's end,
        # its polls have gone past all of A's events, which were older
        r = httpx.post(url + "/v1/completions", headers={**JSON, **b}, timeout=60,
                       json={"prompt": "import sys", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
        usage_b = r.json()["usage"]
        deadline = time.monotonic() + READY_S
        while not any(e["type"] == "end" and e["n_tokens"] == usage_b["completion_tokens"] for e in reader_b.events):
            assert time.monotonic() < deadline and reader_b.is_alive(), "B's reader never saw its own run end"
            time.sleep(0.05)
        # a reader connected does not hold the server open on SIGTERM
        assert stop(proc, signal.SIGTERM, timeout_s=30) == 143
        seen_by_b = reader_b.result()  # all B read, to the end of its stream
        runs = [e for e in seen_by_b if e["type"] in ("run", "end")]
        assert [e["type"] for e in runs] == ["run", "end"] and seen_by_b[0] is runs[0]  # B's own run, nothing else
        assert runs[0]["n_prompt"] + runs[0]["n_past"] == usage_b["prompt_tokens"]
        assert runs[1]["n_tokens"] == usage_b["completion_tokens"]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_request_through_the_page_streams_and_the_tree_follows(server, llm, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, prompt, n = server[1], "def parse_args(argv):", 48
    d = chrome()
    try:
        d.get(url + "/")
        WebDriverWait(d, READY_S).until(lambda d: d.find_element(By.ID, "status").get_attribute("data-state") == "live")
        assert d.find_element(By.ID, "chat").is_selected()  # the server has a chat template (/props says)
        box = d.find_element(By.ID, "prompt")
        box.clear()
        box.send_keys(prompt)
        field = d.find_element(By.ID, "max-tokens")
        field.clear()
        field.send_keys(str(n))
        d.find_element(By.ID, "send").click()
        out = d.find_element(By.ID, "output")
        WebDriverWait(d, READY_S).until(lambda d: out.get_attribute("data-state") == "streaming")
        WebDriverWait(d, 120).until(lambda d: out.get_attribute("data-state") != "streaming")
        result = d.find_element(By.ID, "result").text
        assert out.get_attribute("data-state") == "done", result
        text = d.execute_script("return document.getElementById('output').textContent")
        assert text == llm.chat([{"role": "user", "content": prompt}], max_tokens=n).text  # what the API gives
        passes = int(re.search(r"(\d+) passes", result).group(1))
        tree = d.find_element(By.ID, "tree")
        # the tree follows to the run's last pass (a pass id counts from the prefill's 0)
        WebDriverWait(d, READY_S).until(lambda d: tree.get_attribute("data-pass") == str(passes - 1))
        assert tree.get_attribute("data-state") == "accepted"  # its cycle came after its "verifying" tree
        assert len(d.find_elements(By.CSS_SELECTOR, "#tree g.node")) >= 2
        assert d.find_elements(By.CSS_SELECTOR, "#tree g.node.root")
        for chart in ("chart-tpp", "chart-acc", "chart-flash"):
            assert int(d.find_element(By.ID, chart).get_attribute("data-points")) >= passes - 1
        assert int(d.find_element(By.ID, "timeline").get_attribute("data-spans")) > 0
        d.find_element(By.ID, "prev").click()  # one cycle back: the tree before it
        WebDriverWait(d, READY_S).until(lambda d: tree.get_attribute("data-pass") == str(passes - 2))
        assert not d.find_element(By.ID, "follow").is_selected()
        shot = tmp_path / "page.png"
        assert d.save_screenshot(str(shot)) and shot.stat().st_size > 20_000
        if os.environ.get("LEVER_SCREENSHOT"):
            shutil.copy(shot, os.environ["LEVER_SCREENSHOT"])
        assert severe_logs(d) == []
    finally:
        d.quit()


def test_on_a_server_with_keys_the_page_asks_for_one_and_then_follows():
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    key = {"Authorization": "Bearer page-key"}
    proc, url = start_server("--api-key", "page-key", headers=key)
    d = chrome()
    try:
        d.get(url + "/")
        status = d.find_element(By.ID, "status")
        WebDriverWait(d, READY_S).until(lambda d: status.get_attribute("data-state") == "key")
        assert d.find_element(By.ID, "key-row").is_displayed()
        d.find_element(By.ID, "key").send_keys("page-key")
        d.find_element(By.ID, "key-use").click()
        WebDriverWait(d, READY_S).until(lambda d: status.get_attribute("data-state") == "live")
        assert not d.find_element(By.ID, "key-row").is_displayed()
        d.find_element(By.ID, "send").click()
        out = d.find_element(By.ID, "output")
        WebDriverWait(d, 120).until(lambda d: out.get_attribute("data-state") in ("done", "error"))
        assert out.get_attribute("data-state") == "done", d.find_element(By.ID, "result").text
        WebDriverWait(d, READY_S).until(lambda d: d.find_element(By.ID, "tree").get_attribute("data-pass") != "")
        assert [m for m in severe_logs(d) if "401" not in m] == []  # the page's first calls, before the key
    finally:
        d.quit()
        stop(proc)
