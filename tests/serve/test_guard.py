"""lever.serve.guard: Host, Origin, content type and keys checked before any route, refusals as
OpenAI-style JSON; a route behind it sees the key the request presented."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from lever.serve.guard import Access, Guard


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
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_api_key", auth
    assert c.get("/v1/x", headers={"Authorization": "Bearer k-two"}).json() == {"client": "k-two"}
    assert client(Access()).get("/v1/x").json() == {"client": None}


def test_allowed_origins_admit_a_named_page_and_let_it_read_the_answer():
    c = client(Access(allowed_origins=frozenset({"http://localhost:3000"}), api_keys=("k",)))
    page = {"Origin": "http://localhost:3000"}
    pre = c.options("/v1/x", headers={**page, "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = c.post("/v1/x", headers={**page, "Authorization": "Bearer k"}, json={})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert c.post("/v1/x", headers={**page}, json={}).status_code == 401  # the key is still needed
    r = c.post("/v1/x", headers={"Origin": "http://localhost:3001", "Authorization": "Bearer k"}, json={})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert c.options("/v1/x", headers={"Origin": "http://localhost:3001"}).status_code == 403
