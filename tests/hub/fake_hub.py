"""A stand-in for the Hugging Face hub on 127.0.0.1, serving what huggingface_hub's HEAD and
lever.hub.download's GETs ask of it, with faults on demand.

`HEAD|GET /{owner}/{repo}/resolve/{revision}/{file}` answers as the hub does: a file kept in
LFS is a 302 to its storage URL on another host name (`localhost`, so the client stops there
and reads X-Linked-Etag = its sha256, X-Linked-Size, X-Repo-Commit from the redirect itself), a
file kept in git is a 200 with its git blob id as ETag; a missing file is a 404 with
X-Error-Code: EntryNotFound, a missing repository a 401 with RepoNotFound. `GET /cdn/{sha256}`
serves the bytes, honouring Range. Faults: `drops` (each GET of the bytes, in turn, closes the
connection after that many body bytes), `statuses` (once the drops are used up, the next GETs of
the bytes answer this HTTP status instead), `lie` (a file whose advertised sha256 is not its bytes').
"""

from __future__ import annotations

import hashlib
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self):
        self.files: dict[str, bytes] = {}  # "owner/repo/revision/file" -> bytes
        self.in_git: set[str] = set()  # keys of files kept in git (not LFS)
        self.lie: set[str] = set()
        self.drops: list[int] = []
        self.statuses: list[int] = []
        self.gets: list[str | None] = []  # the Range header of each GET of the bytes, in order
        self.served = 0  # body bytes sent by GETs of the bytes
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.hub = self
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, repo: str, filename: str, data: bytes, *, revision: str = "main", lfs: bool = True,
            lie: bool = False) -> str:
        key = f"{repo}/{revision}/{filename}"
        self.files[key] = data
        if not lfs:
            self.in_git.add(key)
        if lie:
            self.lie.add(key)
        return f"{repo}/{filename}"

    def sha256(self, key: str) -> str:
        data = self.files[key]
        return hashlib.sha256(data + (b"x" if key in self.lie else b"")).hexdigest()

    def blob(self, sha: str) -> bytes | None:
        return next((d for k, d in self.files.items() if self.sha256(k) == sha), None)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        hub: FakeHub = self.server.hub
        if self.path.startswith("/cdn/"):
            return self._bytes(hub, hub.blob(self.path.removeprefix("/cdn/")), body)
        m = RESOLVE.match(self.path)
        key = f"{m[1]}/{m[2]}/{m[3]}" if m else None
        if key not in hub.files:
            known = m and any(k.startswith(m[1] + "/") for k in hub.files)
            return self._empty(404 if known else 401, {"X-Error-Code": "EntryNotFound" if known else "RepoNotFound"})
        data = hub.files[key]
        if key in hub.in_git:
            git = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            return self._bytes(hub, data, body, {"ETag": f'"{git}"', "X-Repo-Commit": COMMIT})
        sha = hub.sha256(key)
        self._empty(302, {"Location": f"http://localhost:{hub.port}/cdn/{sha}", "X-Linked-Etag": f'"{sha}"',
                          "X-Linked-Size": str(len(data)), "X-Repo-Commit": COMMIT, "ETag": '"not-a-hash"'})

    def _empty(self, status: int, headers: dict) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _bytes(self, hub: FakeHub, data: bytes | None, body: bool, headers: dict | None = None) -> None:
        if data is None:
            return self._empty(404, {})
        with hub.lock:
            drop = hub.drops.pop(0) if body and hub.drops else None
            status = hub.statuses.pop(0) if body and hub.statuses and drop is None else None
            if body:
                hub.gets.append(self.headers.get("Range"))
        if status is not None:
            return self._empty(status, {})
        start = int(m[1]) if (m := re.match(r"bytes=(\d+)-$", self.headers.get("Range") or "")) else 0
        if start > len(data):
            return self._empty(416, {"Content-Range": f"bytes */{len(data)}"})
        self.send_response(206 if start else 200)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if body:
            self._send(hub, data[start:] if drop is None else data[start:start + drop], drop is not None)

    def _send(self, hub: FakeHub, chunk: bytes, cut: bool) -> None:
        with hub.lock:  # counted before it goes: a client may have it all, and be asserting, before write returns
            hub.served += len(chunk)
        self.wfile.write(chunk)
        self.wfile.flush()
        if cut:  # the connection dies mid-body
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The stand-in hub with $HF_ENDPOINT pointing at it, and $LEVER_MODELS a fresh folder, so
    nothing reaches a network or the developer's models (a command run as a child inherits both)."""
    with FakeHub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
        monkeypatch.setenv("LEVER_MODELS", str(tmp_path / "models"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield h
