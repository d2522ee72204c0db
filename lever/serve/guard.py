"""Who may talk to the server: API keys, Host and Origin, JSON bodies (ASGI middleware).

Around lever.serve.server's routes. A server on loopback is still reachable by every web page the
user visits: a page can POST to 127.0.0.1 (a "simple" cross-site request needs no preflight when
its content type is a form's or text/plain), and through DNS rebinding a page's own host name
can resolve to 127.0.0.1 and read the answers. So, before any route runs:
- the Host header must name this server: a loopback name, the address it is bound to, an IP
  literal when bound to every interface, or one of `allowed_hosts` (a rebound name is none of
  these) -> 421 otherwise;
- an Origin header, which browsers send on cross-site requests, must be this server's own or one
  of `allowed_origins` -> 403; an allowed origin's page gets CORS headers, so it can read the
  answers. A preflight (OPTIONS with an Origin) is answered as llama-server answers it, before
  any key: 200, the Origin echoed, credentials true, its methods and any header. It runs
  nothing; the request it clears is checked as every other (403 for an origin not allowed);
- a POST's body must be declared JSON (a form or text/plain is a cross-site request) -> 415;
- with API keys (`--api-key`, `--api-key-file`), every route but /health and the page's files
  (the live page's, and those llama-server's web UI asks: lever.serve.webui) needs
  `Authorization: Bearer KEY` (or Anthropic's x-api-key) -> 401, llama-server's
  authentication_error; the key also names the client whose prefix cache a request
  may use (lever.serve.server: one client's prompts are never measured by another's);
- with several keys, one key has at most `max_requests` requests under way (half the server's
  connections) -> 429 past them: the connection cap (lever.serve.protocol) makes room by closing
  idle connections, and once every connection serves a request a new one gets 503, so a key
  that kept the cap busy (held streams, slow bodies, bursts) would lock every other key out.
Refusals are OpenAI-style JSON errors, as the routes' own are.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import hmac
import ipaddress
import json

import attrs

from lever.serve import PAGE_FILES
from lever.serve.webui import WEB_UI_FILES

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
# a load balancer's probe, and the live page's files (lever.serve.page) and the web UI's
# (lever.serve.webui): static, nothing secret; a browser cannot send a key when it opens a
# page. The page's own /live needs the key
OPEN_PATHS = frozenset({"/health", "/v1/health", "/", *(f"/page/{name}" for name in PAGE_FILES), *WEB_UI_FILES})
# llama-server's answer to a preflight: its methods, any header, credentials (its names' case: some
# clients read headers as a plain dict)
PREFLIGHT_HEADERS = ((b"Access-Control-Allow-Credentials", b"true"),
                     (b"Access-Control-Allow-Methods", b"GET, POST, DELETE, OPTIONS"),
                     (b"Access-Control-Allow-Headers", b"*"), (b"Access-Control-Max-Age", b"600"))


@attrs.frozen
class Access:
    """The server's access rules, made once from the command line (lever.cli.serve)."""

    bound_host: str = "127.0.0.1"  # the addresses listened on (comma-separated)
    api_keys: tuple[str, ...] = ()
    allowed_hosts: frozenset[str] = frozenset()
    allowed_origins: frozenset[str] = frozenset()

    def host_ok(self, host_header: str) -> bool:
        name = _hostname(host_header)
        if name in LOOPBACK_HOSTS or name in self.allowed_hosts or "*" in self.allowed_hosts:
            return True
        bound = {h.strip().strip("[]").lower() for h in self.bound_host.split(",")}
        if bound & WILDCARD_HOSTS and _is_ip(name):
            return True  # reached by address: no name a page could rebind
        return name in bound

    def origin_ok(self, origin: str, host_header: str) -> bool:
        origin = origin.rstrip("/").lower()
        if origin in self.allowed_origins or "*" in self.allowed_origins:
            return True
        scheme, _, rest = origin.partition("://")
        return scheme in ("http", "https") and rest == host_header.lower()  # same origin (the page at /)

    def cross_origin_ok(self, origin: str) -> bool:
        """An origin named by --allowed-origins: its pages may read the answers (CORS)."""
        origin = origin.rstrip("/").lower()
        return origin in self.allowed_origins or "*" in self.allowed_origins

    def client_key(self, authorization: str) -> str | None:
        """The key a request presents, if it is one of ours, compared in constant time: every key
        is compared, and as SHA-256 digests of one length (hmac.compare_digest returns at once on
        inputs of different lengths, which would tell a key's length)."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        # the header's own bytes (Guard decodes headers as Latin-1, which maps every byte and back),
        # less HTTP's spaces and tabs (str.strip would also take U+00A0 and \x1c-\x1f)
        presented = _digest(token.encode("latin-1", errors="replace").strip(b" \t"))
        found = None
        for k, digest in zip(self.api_keys, self._key_digests, strict=True):
            if hmac.compare_digest(digest, presented):  # no early exit: the time says nothing of which matched
                found = k
        return found

    @functools.cached_property
    def _key_digests(self) -> tuple[bytes, ...]:
        # lever.cli.serve admits printable ASCII keys only; UTF-8 so any other key is compared, not raised on
        return tuple(_digest(k.encode("utf-8", errors="replace")) for k in self.api_keys)


def _digest(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


@attrs.define
class Guard:
    """The ASGI middleware: checks each HTTP request against `access` before `app` sees it; the
    key it presented is left in scope["state"]["client"] (None without keys)."""

    app: object
    access: Access
    max_requests: int | None = None  # one key's requests under way at once (None: no bound but the server's)
    refused: int = 0
    _under_way: collections.Counter = attrs.field(factory=collections.Counter)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        refusal = None
        if not self.access.host_ok(host):
            refusal = (421, "misdirected_request", f"Host: {host[:60]!r} is not this server's name "
                                                   "(--allowed-hosts adds names)")
        elif scope["method"] == "OPTIONS" and "origin" in headers:  # a preflight: no key (browsers send none)
            await _preflight(send, headers["origin"])
            return
        elif "origin" in headers and not self.access.origin_ok(headers["origin"], host):
            refusal = (403, "forbidden", f"Origin: {headers['origin'][:60]!r} may not call this server "
                                         "(--allowed-origins adds origins)")
        elif scope["method"] == "POST" and not _is_json(headers.get("content-type", "")):
            refusal = (415, "invalid_request_error", "Content-Type: must be application/json")
        client = None
        if refusal is None and self.access.api_keys and scope["path"] not in OPEN_PATHS:
            # Anthropic's clients send their key as x-api-key (lever.serve.anthropic), not Authorization
            auth = headers.get("authorization") or (f"Bearer {headers['x-api-key']}" if "x-api-key" in headers else "")
            client = self.access.client_key(auth)
            if client is None:  # llama-server's type
                refusal = (401, "authentication_error", "Authorization: a valid 'Bearer KEY' is required")
            elif self.max_requests is not None and self._under_way[client] >= self.max_requests:
                refusal = (429, "rate_limit_exceeded", f"this key has {self._under_way[client]} requests under way, "
                                                       f"its share of the server's connections; try again")
        origin = headers.get("origin")
        cors = origin is not None and refusal is None and self.access.cross_origin_ok(origin)
        if refusal is not None:
            self.refused += 1
            await _refuse(send, *refusal)
            return
        scope.setdefault("state", {})["client"] = client
        if cors:  # let the allowed page read the answer
            inner = send

            async def send(message):
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), *_cors_headers(origin)]}
                await inner(message)
        if client is None:
            await self.app(scope, receive, send)
            return
        self._under_way[client] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._under_way[client] -= 1
            if not self._under_way[client]:
                del self._under_way[client]


def _hostname(host_header: str) -> str:
    h = host_header.strip().lower()
    if h.startswith("["):  # [::1]:8080
        return h[1 : h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_json(content_type: str) -> bool:
    return content_type.split(";")[0].strip().lower() == "application/json"


async def _refuse(send, status: int, kind: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"Access-Control-Allow-Origin", origin.encode("latin-1")), (b"Vary", b"Origin")]


async def _preflight(send, origin: str) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [
        *_cors_headers(origin), *PREFLIGHT_HEADERS, (b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})
