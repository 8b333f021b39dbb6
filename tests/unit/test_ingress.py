"""``container.core.ingress.parse_head``: what it takes, gunicorn reads the same way (the same
route, headers as the frontend's WSGI environ names them, body), and what it cannot be sure of
it leaves to gunicorn."""

import socket

import pytest
from gunicorn.config import Config
from gunicorn.http import wsgi
from gunicorn.http.parser import RequestParser
from werkzeug.datastructures import EnvironHeaders

from container.core.ingress import (
    framing,
    head_ready,
    is_bare_ping,
    parse_head,
    request_path,
    request_properties,
    response_head,
)
from container.core.protocol import ResponseHead

BODY = b'{"model": "m", "prompt": "hi", "stream": true}'


def request(head: bytes, body: bytes = BODY, line: bytes = b"POST /v1/completions HTTP/1.1") -> bytes:
    return line + b"\r\n" + head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def gunicorn_reads(data: bytes) -> tuple[str, str, list[tuple[str, str]], bytes]:
    """What the frontend's gunicorn makes of ``data``: method, path, headers (as the request
    thread sees them), body."""
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(data)
        theirs.shutdown(socket.SHUT_WR)
        cfg = Config()
        req = next(RequestParser(cfg, ours, ("127.0.0.1", 1)))
        _, environ = wsgi.create(req, ours, ("127.0.0.1", 1), ("127.0.0.1", 8080), cfg)
        body = environ["wsgi.input"].read()
        return environ["REQUEST_METHOD"], environ["PATH_INFO"], list(EnvironHeaders(environ).items()), body
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize(
    "data",
    [
        request(b"Host: x\r\nContent-Type: application/json\r\n"),
        request(b"Host: x\r\nX-Amzn-SageMaker-Custom-Attributes: a=1; b=2\r\nAccept: */*\r\n"),
        request(b"host: x\r\nconnection: keep-alive\r\nuser-agent: OpenAI/Python 1.0\r\n"),
        request(b"Host: x\r\nConnection: close\r\n", line=b"POST /v1/chat/completions HTTP/1.1"),
        request(b"Host: x\r\n", line=b"POST /invocations?x=1&y=%20 HTTP/1.1"),
        request(b"Host: x\r\n", b"", line=b"GET /v1/models HTTP/1.1"),
        request(
            b"Host: x\r\nX-Amzn-SageMaker-Inference-Id: abc\r\n",
            b'{"inputs": "a", "stream":true}',
            b"POST /invocations HTTP/1.1",
        ),
    ],
)
def test_a_head_it_takes_gunicorn_reads_the_same(data: bytes) -> None:
    head = parse_head(data + b"POST /next")  # the next request's start is not this one's
    assert head is not None
    method, path, headers, body = gunicorn_reads(data)
    assert (method, path) == (head.method, head.path)
    assert sorted(headers) == sorted(head.headers)
    assert request_properties(headers, "r") == request_properties(head.headers, "r")
    assert head.size + (head.length or 0) == len(data) and data[head.size :] == body
    assert head.keep_alive == (b"onnection: close" not in data)


@pytest.mark.parametrize(
    ("why", "data"),
    [
        ("two lengths", request(b"Content-Length: 3\r\n")),
        ("a repeated header", request(b"Accept: a\r\nAccept: b\r\n")),
        ("a folded header", request(b"X-A: a\r\n b\r\n")),
        ("an underscore", request(b"X_A: a\r\n")),
        ("a control byte", request(b"X-A: a\x01b\r\n")),
        ("a non-ASCII value", request("X-A: é\r\n".encode())),
        ("a line without a colon", request(b"X-A\r\n")),
        ("a bare LF", b"POST /v1/completions HTTP/1.1\nHost: x\r\n\r\n"),
        ("a signed length", request(b"", line=b"POST /v1/completions HTTP/1.1").replace(b"Length: ", b"Length: +")),
        ("too long a field", request(b"X-A: " + b"a" * 5000 + b"\r\n")),
        ("too many fields", request(b"".join(b"X-%d: a\r\n" % i for i in range(70)))),
        ("not whole", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"),
        ("an upgrade", request(b"Connection: Upgrade\r\nUpgrade: h2c\r\n")),
    ],
)
def test_a_head_it_leaves_to_gunicorn(why: str, data: bytes) -> None:
    assert parse_head(data) is None, why


def test_an_answers_head_frames_its_body_and_keeps_the_frontends_headers_last() -> None:
    given = ResponseHead("HTTP/1.1", "gunicorn", False, {"X-Sagelmi-Group": "0"})
    whole = response_head(given, 404, {"Content-Type": "application/json", "Content-Length": "9", "X-Bad": "a\r\nb"}, 7)
    lines = whole.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 404 NOT FOUND" and b"Connection: keep-alive" in lines
    assert lines.count(b"Content-Length: 7") == 1 and not any(line.startswith(b"X-Bad") for line in lines)
    assert lines[-3:] == [b"X-Sagelmi-Group: 0", b"", b""]
    stream = response_head(given, 200, {}, None)
    assert b"Transfer-Encoding: chunked\r\n" in stream and b"Content-Type: text/html; charset=utf-8\r\n" in stream
    old = response_head(ResponseHead("HTTP/1.0", "gunicorn", False, {}), 200, {"Content-Type": "a/b"}, None)
    assert b"Connection: close" in old and b"Transfer-Encoding" not in old  # a stream's end is the close
    assert framing(given, whole=False) == (True, False) and framing(given, whole=True) == (False, False)


@pytest.mark.parametrize(
    ("data", "ready"),
    [
        (b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n", True),
        (b"GET /ping HTTP/1.1\r\n\r\n", True),
        (b"POST /invocations HTTP/1.1\r\nContent-Length: 100\r\n\r\n{", True),  # the body is the thread's
        (b"GET /ping HTTP/1.1\r\nHost: x\r\n", False),
        (b"GET /ping HTT", False),
        (b"", False),
        (b"GET /ping HTTP/1.1\nHost: x", True),  # a bare LF: gunicorn refuses it without reading more
    ],
)
def test_a_head_is_ready_for_a_thread_once_whole(data: bytes, ready: bool) -> None:
    assert head_ready(data) is ready


def test_a_head_looked_at_again_is_looked_at_from_where_it_grew() -> None:
    first = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r"
    assert not head_ready(first)
    assert head_ready(first + b"\n", start=len(first))  # its empty line across the two looks
    assert not head_ready(first + b"\r\nX", start=len(first))


def test_the_path_is_known_once_the_request_line_is_whole() -> None:
    assert request_path(b"POST /v1/completions?x=1 HTTP/1.1\r\nHo") == "/v1/completions"
    assert request_path(b"POST /v1/completions HTT") == ""
    assert request_path(b"\r\nGET /ping HTTP/1.1\r\n") == "/ping"


def test_only_a_bodiless_ping_is_a_bare_ping() -> None:
    assert is_bare_ping(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    assert is_bare_ping(b"GET /ping?x=1 HTTP/1.0\r\n\r\n")
    assert not is_bare_ping(b"GET /ping HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc")
    assert not is_bare_ping(b"GET /ping HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n")
    assert not is_bare_ping(b"GET /pings HTTP/1.1\r\n\r\n")
    assert not is_bare_ping(b"GET /ping HTTP/1.1\r\nHost: x\r\n")
