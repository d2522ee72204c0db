"""lever.serve.guard: Host, Origin, content type and keys checked before any route, refusals as
OpenAI-style JSON; a route behind it sees the key the request presented. Whatever bytes a client
puts in those headers get an answer or a JSON refusal, never an error, and keys are compared in
constant time."""

from __future__ import annotations

import asyncio
import hmac
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from lever.serve import guard
from lever.serve.guard import Access, Guard
from lever.serve.webui import WEB_UI_FILES
from tests.sizes import cases


async def echo(request: Request):
    return JSONResponse({"client": request.scope["state"]["client"]})


def client(access: Access) -> TestClient:
    app = Starlette(routes=[Route("/health", echo), Route("/v1/x", echo, methods=["GET", "POST"])])
    return TestClient(Guard(app, access), base_url="http://127.0.0.1:8080")


@pytest.mark.parametrize("host, bound, allowed, ok", [
    ("127.0.0.1:8080", "127.0.0.1", (), True), ("localhost:8080", "127.0.0.1", (), True),
    ("[::1]:8080", "::1", (), True), ("evil.example:8080", "127.0.0.1", (), False),
    ("rebind.attacker.net", "127.0.0.1", (), False), ("192.168.1.5:8080", "0.0.0.0", (), True),
    ("phone.local:8080", "0.0.0.0", (), False), ("phone.local:8080", "0.0.0.0", ("phone.local",), True),
    ("10.0.0.2:8080", "10.0.0.2", (), True), ("10.0.0.3:8080", "10.0.0.2", (), False),
    # several addresses (--host 127.0.0.1,::1,10.0.0.2): any of them
    ("10.0.0.2:8080", "127.0.0.1,::1,10.0.0.2", (), True), ("[::1]:8080", "127.0.0.1,[::1]", (), True),
    ("10.0.0.3:8080", "127.0.0.1,10.0.0.2", (), False),
])
def test_the_host_must_name_this_server(host, bound, allowed, ok):
    assert Access(bound_host=bound, allowed_hosts=frozenset(allowed)).host_ok(host) is ok


def test_refusals_come_before_the_route_as_json():
    c = client(Access())
    r = c.get("/v1/x", headers={"Host": "evil.example"})
    assert r.status_code == 421 and r.json()["error"]["type"] == "misdirected_request"
    r = c.post("/v1/x", headers={"Origin": "https://evil.example"}, json={})
    assert r.status_code == 403 and "Origin" in r.json()["error"]["message"]
    assert c.post("/v1/x", headers={"Origin": "http://127.0.0.1:8080"}, json={}).status_code == 200  # same origin
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        r = c.post("/v1/x", content=b"{}", headers={"Content-Type": ctype})
        assert r.status_code == 415, ctype
    r = c.post("/v1/x", content=b"{}", headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_keys_guard_every_route_but_health_and_name_the_client():
    c = client(Access(api_keys=("k-one", "k-two")))
    assert c.get("/health").status_code == 200
    for auth in (None, "Bearer", "Bearer nope", "Basic k-one", "Bearer k-one2"):
        r = c.get("/v1/x", headers={"Authorization": auth} if auth else {})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", auth
    assert c.get("/v1/x", headers={"Authorization": "Bearer k-two"}).json() == {"client": "k-two"}
    assert client(Access()).get("/v1/x").json() == {"client": None}


def test_the_web_uis_files_need_no_key_as_llama_servers_do():
    routes = [Route(path, echo) for path in WEB_UI_FILES]
    c = TestClient(Guard(Starlette(routes=routes), Access(api_keys=("k",))), base_url="http://127.0.0.1:8080")
    assert all(c.get(path).status_code == 200 for path in WEB_UI_FILES)
    assert {"/sw.js", "/manifest.webmanifest", "/_app/version.json"} <= set(WEB_UI_FILES) <= guard.OPEN_PATHS


def test_allowed_origins_admit_a_named_page_and_let_it_read_the_answer():
    c = client(Access(allowed_origins=frozenset({"http://localhost:3000"}), api_keys=("k",)))
    page = {"Origin": "http://localhost:3000"}
    pre = c.options("/v1/x", headers={**page, "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert pre.headers["access-control-allow-headers"] == "*"
    assert pre.headers["access-control-allow-credentials"] == "true"
    assert pre.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"  # llama-server's
    r = c.post("/v1/x", headers={**page, "Authorization": "Bearer k"}, json={})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert c.post("/v1/x", headers={**page}, json={}).status_code == 401  # the key is still needed
    r = c.post("/v1/x", headers={"Origin": "http://localhost:3001", "Authorization": "Bearer k"}, json={})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    # a preflight is answered as llama-server answers it, whatever the origin and without a key: it
    # runs nothing, and the request it clears is refused above
    pre = c.options("/v1/x", headers={"Origin": "http://localhost:3001", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://localhost:3001"
    assert c.options("/v1/x", headers={"Origin": "x", "Host": "evil.example"}).status_code == 421  # the Host first


KEYS = ("k-one", "k-two-longer", "K3")
ASCII_KEYS = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=256)
ANSWERS = {200, 204, 401, 403, 415, 421}  # the route's, a preflight's, and each refusal's


def ask(access: Access, headers: list[tuple[bytes, bytes]], *, method: str = "GET") -> tuple[int, dict]:
    """One request straight through the ASGI app, headers as raw bytes (no client library to
    check them first): the status and the JSON body."""
    app = Guard(Starlette(routes=[Route("/v1/x", echo, methods=["GET", "POST", "OPTIONS"])]), access)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": "/v1/x", "raw_path": b"/v1/x", "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8080)}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body) if body else {}


def presents(raw: bytes) -> bytes | None:
    """The token an Authorization header's bytes present, as HTTP reads it: `Bearer` (any case),
    one space, the token less spaces and tabs around it."""
    scheme, _, token = raw.partition(b" ")
    return token.strip(b" \t") if scheme.lower() == b"bearer" and token else None


@settings(max_examples=cases(500), derandomize=True, deadline=None, database=None)
@given(raw=st.one_of(
    st.binary(max_size=40),
    st.builds(lambda scheme, pad, key, tail: scheme + b" " + pad + key.encode() + tail,
              st.sampled_from([b"Bearer", b"bearer", b"BEARER", b"Basic", b"Bearer\t"]),
              st.sampled_from([b"", b" ", b"\t", b"\xa0", b"\x1c"]), st.sampled_from(KEYS),
              st.one_of(st.just(b""), st.binary(max_size=3)))))
def test_any_authorization_bytes_get_200_or_401_never_an_error(raw):
    """Whatever bytes a client sends as the key (past Latin-1, NULs, CR/LF, nothing), Guard
    answers 200 for one of its keys exactly and 401 for everything else; never a 500."""
    status, body = ask(Access(api_keys=KEYS), [(b"host", b"127.0.0.1:8080"), (b"authorization", raw)])
    want = presents(raw)
    if want is not None and want in {k.encode() for k in KEYS}:
        assert status == 200 and body == {"client": want.decode()}, raw
    else:
        assert status == 401 and body["error"]["type"] == "authentication_error", raw


HEADER_BYTES = st.one_of(st.binary(max_size=30), st.sampled_from([
    b"127.0.0.1:8080", b"localhost", b"[::1]:8080", b"[::1", b"http://127.0.0.1:8080", b"http://localhost:3000",
    b"application/json", b"Bearer k-one", b"\xff\xfe", b"\x00", b"[", b":", b"*"]))


@settings(max_examples=cases(500), derandomize=True, deadline=None, database=None)
@given(fields=st.dictionaries(st.sampled_from([b"host", b"origin", b"content-type", b"authorization"]),
                              HEADER_BYTES),
       method=st.sampled_from(["GET", "POST", "OPTIONS"]), keys=st.sampled_from([(), KEYS]))
def test_any_header_bytes_get_an_answer_or_a_json_refusal_never_an_error(fields, method, keys):
    access = Access(api_keys=keys, allowed_origins=frozenset({"http://localhost:3000"}))
    status, body = ask(access, list(fields.items()), method=method)
    assert status in ANSWERS, (fields, status)
    if status >= 400:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body


@settings(max_examples=cases(300), derandomize=True, deadline=None, database=None)
@given(keys=st.lists(ASCII_KEYS, min_size=1, max_size=6, unique=True), data=st.data())
def test_every_key_is_compared_as_digests_of_one_length(keys, data):
    """Constant time over the keys: client_key compares the presented token with every key,
    whichever matches (or none), and each comparison is of two 32-byte digests, so neither the
    matching key's place nor its length shows in the time (hmac.compare_digest itself returns at
    once on inputs of different lengths)."""
    assert hmac.compare_digest(b"k", b"k-longer") is False  # no error, but at once: why digests
    token = data.draw(st.one_of(st.sampled_from(keys), ASCII_KEYS), label="token")
    calls = []

    def recording(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    real = hmac.compare_digest
    with pytest.MonkeyPatch.context() as m:
        m.setattr(guard.hmac, "compare_digest", recording)
        found = Access(api_keys=tuple(keys)).client_key(f"Bearer {token}")
    assert found == (token if token in keys else None)
    assert calls == [(32, 32)] * len(keys)


@settings(max_examples=cases(50), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["start", "end"])), max_size=40),
       st.integers(1, 4))
def test_a_key_has_at_most_its_share_under_way_and_another_key_is_let_through(ops, share):
    """Requests of two keys start and end in any order: one past its key's share under way gets 429
    before its route runs, whatever the other key holds; one within it always reaches its route."""
    keys = {"a": "k-one", "b": "k-two"}

    async def main():
        open_, reached = {"a": [], "b": []}, []

        async def route(scope, receive, send):
            done = asyncio.Event()
            open_[{v: k for k, v in keys.items()}[scope["state"]["client"]]].append(done)
            reached.append(scope["state"]["client"])
            await done.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        g = Guard(route, Access(api_keys=tuple(keys.values())), max_requests=share)
        tasks = {"a": [], "b": []}
        for who, op in ops:
            if op == "end":
                if open_[who]:
                    open_[who].pop(0).set()
                    await asyncio.wait_for(tasks[who].pop(0), 5)
                continue
            statuses = []

            async def send(message, statuses=statuses):
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])

            scope = {"type": "http", "method": "GET", "path": "/v1/x", "query_string": b"",
                     "headers": [(b"host", b"127.0.0.1"), (b"authorization", f"Bearer {keys[who]}".encode())]}
            before, held = len(reached), len(open_[who])
            task = asyncio.create_task(g(scope, None, send))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            if held >= share:
                await asyncio.wait_for(task, 5)
                assert statuses == [429] and len(reached) == before
            else:
                assert len(reached) == before + 1 and not statuses
                tasks[who].append(task)
        for who in open_:
            for done in open_[who]:
                done.set()
        await asyncio.gather(*tasks["a"], *tasks["b"])

    asyncio.run(main())
