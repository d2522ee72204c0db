"""lever.serve.protocol against requests HTTP cannot parse, over raw sockets to a live `lever serve`:
each malformed head (a bad method, a header line without a colon, a control character in a header,
a bad HTTP version, a line past h11's bound) is answered with an OpenAI-style JSON error naming
what was wrong, a 4xx (505 for a version other than 1.x), and the connection closed; a
well-formed request on a fresh connection is answered after each."""

from __future__ import annotations

import json
import re
import signal
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.live import start_server, stderr_text, stop
from tests.sizes import cases

MAX_HEAD = 16384  # h11's bound on a request's line and headers, as uvicorn configures it
TCHAR = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
# bytes no method or header name may hold; CR and LF left out (they would end the line, and a
# line they end early may be well-formed)
NOT_TCHAR = bytes(b for b in range(256) if b not in TCHAR and b not in b"\r\n")
# bytes no header value may hold: controls but \t (obs-text, 0x80-0xff, is taken)
VALUE_CONTROL = bytes(b for b in [*range(32), 127] if b not in b"\t\r\n")


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--timeout", "5")
    yield proc, url
    assert stop(proc) == 128 + signal.SIGINT
    assert "Traceback" not in stderr_text(proc), stderr_text(proc)


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def exchange(url: str, data: bytes) -> bytes:
    """Sends `data` on a fresh connection and reads until the server closes it (a timeout here
    means the connection was left open)."""
    with socket.create_connection(address(url), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def parse(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    status = int(re.fullmatch(r"HTTP/1\.1 (\d{3}) .*", status_line).group(1))
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    return status, headers, body


def assert_json_error(response: bytes, *, statuses, words: str) -> None:
    status, headers, body = parse(response)
    assert status in statuses, response
    assert headers["content-type"] == "application/json" and headers["connection"] == "close", response
    assert int(headers["content-length"]) == len(body), response  # nothing after: the connection closed
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert words in error["message"], error["message"]


def well_formed_works(url: str) -> None:
    status, _, body = parse(exchange(url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"))
    assert status == 200 and "admitted" in json.loads(body)


def head(request_line: bytes, *header_lines: bytes, end: bytes = b"\r\n") -> bytes:
    return request_line + b"\r\n" + b"".join(h + b"\r\n" for h in header_lines) + end


GOOD_LINE = b"GET /health HTTP/1.1"
HOST = b"Host: 127.0.0.1"


@pytest.mark.parametrize("data, status, words", [
    (head(b"G@T /health HTTP/1.1", HOST), 400, "the request line is malformed"),
    (head(GOOD_LINE, HOST, b"Accept application/json"), 400, "a header line is malformed"),
    (head(GOOD_LINE, HOST, b"X-Trace: a\x00b"), 400, "no control characters): 'X-Trace: a\\x00b'"),
    (head(GOOD_LINE, HOST, b"X\x00Trace: ab"), 400, "a header line is malformed"),
    (head(GOOD_LINE, HOST, b"X-Trace: a\x1bb"), 400, "a header value holds a control character: 'x-trace: a\\x1bb'"),
    (head(GOOD_LINE), 400, "Host: the header is missing"),
    (head(b"GET /health HTTP/11", HOST), 400, "the request line is malformed"),
    (head(b"GET /health HTTP/2.0", HOST), 505, "the HTTP version 2.0 is not supported"),
    (b"GET /" + b"a" * (MAX_HEAD + 10), 431, f"over {MAX_HEAD} bytes"),
    (head(GOOD_LINE, HOST, b"Transfer-Encoding: gzip"), 501, "Transfer-Encoding: only chunked"),
    (head(GOOD_LINE, HOST, b"Content-Length: ten"), 400, "Content-Length: not a length"),
], ids=["method", "no colon", "NUL in value", "NUL in name", "ESC in value", "no Host", "HTTP/11", "HTTP/2.0",
        "long line", "gzip", "bad length"])
def test_a_request_http_cannot_parse_gets_a_json_error_naming_it(server, data, status, words):
    url = server[1]
    assert_json_error(exchange(url, data), statuses={status}, words=words)
    well_formed_works(url)


@st.composite
def malformed_heads(draw) -> tuple[bytes, set[int], str]:
    """(a request head with one thing wrong, the statuses it may get, words its message has)."""
    names = st.binary(min_size=1, max_size=12).map(lambda b: b"X-" + bytes(TCHAR[x % len(TCHAR)] for x in b))
    valid = draw(st.lists(st.builds(lambda n, v: n + b": " + v, names, st.sampled_from([b"1", b"a b", b"x\x80"])),
                          max_size=3))
    line = GOOD_LINE
    bad_header = None
    kind = draw(st.sampled_from(["method", "no colon", "name control", "value control", "version", "oversized"]))
    if kind == "method":
        method = draw(st.binary(max_size=6)) + draw(st.sampled_from(NOT_TCHAR)).to_bytes(1, "big") \
            + draw(st.binary(max_size=6))
        line = method.replace(b"\r", b"").replace(b"\n", b"") + b" /health HTTP/1.1"
        words = "request line"
    elif kind == "no colon":  # a first byte that is not space or tab: that would fold onto the last line
        rest = draw(st.binary(max_size=20)).translate(None, b":\r\n")
        bad_header = draw(st.sampled_from(TCHAR)).to_bytes(1, "big") + rest
        words = "a header line is malformed"
    elif kind == "name control":
        bad = draw(st.sampled_from(NOT_TCHAR.replace(b":", b""))).to_bytes(1, "big")  # ":" ends a name
        bad_header = b"X-" + bad + b"Name: v"
        words = "a header line is malformed"
    elif kind == "value control":
        bad_header = b"X-Value: a" + draw(st.sampled_from(VALUE_CONTROL)).to_bytes(1, "big") + b"b"
        words = "a header"  # its line (h11: NUL, \v, \f) or its value (the rest)
    elif kind == "version":
        version = draw(st.text("HTPS/012.9x ", min_size=1, max_size=10).map(str.encode))
        if re.fullmatch(rb"HTTP/1\.\d", version):  # a 1.x version is one the server speaks
            version = b"HTTP/1.1.1"
        line = b"GET /health " + version
        unsupported = re.fullmatch(rb"HTTP/\d\.\d", version) is not None
        words = "HTTP version" if unsupported else "request line"
        return head(line, *valid, HOST), {505} if unsupported else {400}, words
    else:  # a line past the bound, never ended: refused once the bound is passed
        where = draw(st.sampled_from(["request line", "header"]))
        long = b"a" * draw(st.integers(MAX_HEAD + 1, MAX_HEAD + 4096))
        data = b"GET /" + long if where == "request line" else head(GOOD_LINE, HOST, end=b"") + b"X-Long: " + long
        return data, {431}, f"over {MAX_HEAD} bytes"
    at = draw(st.integers(0, len(valid)))
    headers = [HOST, *valid[:at], *([bad_header] if bad_header is not None else []), *valid[at:]]
    return head(line, *headers), {400}, words


@settings(max_examples=cases(200), derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=malformed_heads())
def test_every_malformed_head_is_a_json_4xx_and_the_next_connection_is_served(server, case):
    data, statuses, words = case
    url = server[1]
    assert_json_error(exchange(url, data), statuses=statuses, words=words)
    well_formed_works(url)


def test_a_request_after_a_good_one_on_the_same_connection_is_refused_alone(server):
    """Keep-alive: the first request is answered as ever, the malformed second gets the JSON
    error, then the connection closes."""
    url = server[1]
    out = exchange(url, head(GOOD_LINE, HOST) + head(b"G@T /health HTTP/1.1", HOST))
    status, headers, rest = parse(out)
    assert status == 200
    assert_json_error(rest[int(headers["content-length"]):], statuses={400}, words="the request line is malformed")


def test_a_body_refused_after_its_route_answered_closes_the_connection_quietly(server):
    """/health answers without reading a chunked body; the bad chunk that comes after finds the
    response sent: the connection closes with nothing more written (a second response there
    would answer no request: a client reads it as the next request's answer)."""
    with socket.create_connection(address(server[1]), timeout=10) as s:
        s.sendall(head(GOOD_LINE, HOST, b"Transfer-Encoding: chunked"))
        first = s.recv(65536)
        while b"\r\n\r\n" not in first or len(parse(first)[2]) < int(parse(first)[1].get("content-length", 0)):
            more = s.recv(65536)  # the head and the body may come in separate segments
            assert more, first
            first += more
        status, headers, body = parse(first)
        assert status == 200 and int(headers["content-length"]) == len(body)
        s.sendall(b"zz\r\n")
        assert s.recv(65536) == b""
    well_formed_works(server[1])
    assert "Traceback" not in stderr_text(server[0])
