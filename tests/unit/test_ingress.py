"""``container.core.ingress.read_request``: what it takes, gunicorn reads the same way (the same
route, headers as the frontend's WSGI environ names them, body), and what it cannot be sure of
it leaves to gunicorn."""

import socket

import pytest
from gunicorn.config import Config
from gunicorn.http import wsgi
from gunicorn.http.parser import RequestParser
from werkzeug.datastructures import EnvironHeaders

from container.core.ingress import (
    Partial,
    head_ready,
    is_bare_ping,
    may_be_read,
    read_request,
    request_path,
    request_properties,
)

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
        request(
            b"Host: x\r\nX-Amzn-SageMaker-Inference-Id: abc\r\n",
            b'{"inputs": "a", "stream":true}',
            b"POST /invocations HTTP/1.1",
        ),
    ],
)
def test_what_it_takes_gunicorn_reads_the_same(data: bytes) -> None:
    taken = read_request(data + b"POST /next", 1 << 20)  # the next request's start is not this one's
    assert taken is not None
    method, path, headers, body = gunicorn_reads(data)
    assert (method, path, body) == ("POST", taken.path, taken.body)
    assert sorted(headers) == sorted(taken.headers)
    assert request_properties(headers, "r") == request_properties(taken.headers, "r")
    assert taken.size == len(data)
    assert taken.close == (b"onnection: close" in data)


@pytest.mark.parametrize(
    ("why", "data"),
    [
        ("no stream asked", request(b"Host: x\r\n", b'{"prompt": "hi"}')),
        ("stream false", request(b"Host: x\r\n", b'{"prompt": "hi", "stream": false}')),
        ("another route", request(b"Host: x\r\n", line=b"POST /v1/embeddings HTTP/1.1")),
        ("a query", request(b"Host: x\r\n", line=b"POST /invocations?x=1 HTTP/1.1")),
        ("another method", request(b"Host: x\r\n", line=b"PUT /v1/completions HTTP/1.1")),
        ("HTTP/1.0", request(b"Host: x\r\n", line=b"POST /v1/completions HTTP/1.0")),
        ("chunked", b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
        ("no length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n" + BODY),
        ("two lengths", request(b"Content-Length: 3\r\n")),
        ("a repeated header", request(b"Accept: a\r\nAccept: b\r\n")),
        ("a folded header", request(b"X-A: a\r\n b\r\n")),
        ("an underscore", request(b"X_A: a\r\n")),
        ("a control byte", request(b"X-A: a\x01b\r\n")),
        ("a non-ASCII value", request("X-A: é\r\n".encode())),
        ("a line without a colon", request(b"X-A\r\n")),
        ("a session", request(b"X-Amzn-SageMaker-Session-Id: s\r\n")),
        ("an interim answer asked", request(b"Expect: 100-continue\r\n")),
        ("an upgrade", request(b"Connection: Upgrade\r\nUpgrade: h2c\r\n")),
        ("a signed length", request(b"", line=b"POST /v1/completions HTTP/1.1").replace(b"Length: ", b"Length: +")),
        ("too long a field", request(b"X-A: " + b"a" * 5000 + b"\r\n")),
        ("too many fields", request(b"".join(b"X-%d: a\r\n" % i for i in range(70)))),
    ],
)
def test_what_it_leaves_to_gunicorn(why: str, data: bytes) -> None:
    assert read_request(data, 1 << 20) is None, why


@pytest.mark.parametrize(
    ("why", "data", "need"),
    [
        ("the body not all there", request(b"Host: x\r\n")[:-3], len(request(b"Host: x\r\n"))),
        ("the head not all there", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 41),
        ("the request line not all there", b"POST /v1/chat", 14),
        ("nothing yet", b"", 1),
    ],
)
def test_the_start_of_a_request_it_may_take_says_how_much_it_needs(why: str, data: bytes, need: int) -> None:
    assert read_request(data, 1 << 20) == Partial(need), why


def test_the_start_of_another_request_is_left_to_gunicorn() -> None:
    assert read_request(b"POST /v1/embeddings", 1 << 20) is None
    assert read_request(b"GET /ping HTTP/1.1\r\n", 1 << 20) is None


def test_a_body_over_the_limit_is_left_to_gunicorn() -> None:
    data = request(b"Host: x\r\n")
    assert read_request(data, len(BODY)) is not None
    assert read_request(data, len(BODY) - 1) is None


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (request(b"Host: x\r\n"), True),
        (request(b"host: x\r\ncontent-type: a\r\n").replace(b"Content-Length", b"content-length"), True),
        (request(b"Host: x\r\n", b'{"prompt": "hi"}'), False),
        (request(b"Host: x\r\n", line=b"POST /v1/embeddings HTTP/1.1"), False),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n" + BODY, False),  # no length: gunicorn's
        (b"POST /v1/comp", Partial(14)),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", Partial(41)),
        (request(b"Host: x\r\n")[: -len(BODY)], Partial(len(request(b"Host: x\r\n")))),
        (request(b"Host: x\r\n")[:-3], Partial(len(request(b"Host: x\r\n")))),
        (request(b"Host: x\r\n", b"x" * (1 << 16)), False),  # larger than what is peeked
    ],
)
def test_the_main_loops_look_hands_over_only_what_is_there_and_asks_for_a_stream(data, expected) -> None:
    """``may_be_read``: gthread's main loop hands a connection to rank 0 unread only for a request
    all there that asks for a stream (rank 0's ``read_request`` then decides); it waits for one not
    all there, as ``read_request`` would."""
    assert may_be_read(data) == expected
    if expected is True:
        assert read_request(data, 1 << 20) is not None


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
