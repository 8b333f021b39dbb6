"""``container.core.ingress.parse_head``: what it takes, gunicorn reads the same way (the same
route, headers as the frontend's WSGI environ names them, body), and what it cannot be sure of
it leaves to gunicorn."""

import socket

import pytest
from gunicorn.config import Config
from gunicorn.http import wsgi
from gunicorn.http.parser import RequestParser
from werkzeug.datastructures import EnvironHeaders

from container.core.errors import MalformedBody, PayloadTooLarge
from container.core.ingress import (
    ChunkedBody,
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


class Unconnected:
    """The client's socket, to gunicorn, where it answers ``Expect: 100-continue``."""

    def send(self, data: bytes) -> int:
        return len(data)


def gunicorn_takes(head: bytes) -> tuple[str, str, str, list[tuple[str, str]], bool] | None:
    """What the frontend's gunicorn makes of the request head ``head`` (its config's defaults),
    from a trusted proxy (127.0.0.1, ``forwarded_allow_ips``) and from any other client alike: the
    method, path, query, the headers a request thread sees and whether the body is chunked;
    ``None`` if it refuses the head from either or reads it differently."""
    seen = set()
    for peer in (("127.0.0.1", 1), ("10.0.0.1", 1)):
        cfg = Config()
        try:
            req = next(RequestParser(cfg, [head], peer))
            _, environ = wsgi.create(req, Unconnected(), peer, ("127.0.0.1", 8080), cfg)
        except Exception:  # gunicorn's 400, 417, 431, 501 ...
            return None
        chunked = type(req.body.reader).__name__ == "ChunkedReader"
        seen.add((req.method, req.path, req.query, tuple(EnvironHeaders(environ).items()), chunked))
    return seen.pop() if len(seen) == 1 else None


def line(method: bytes = b"POST", target: bytes = b"/invocations", version: bytes = b"HTTP/1.1") -> bytes:
    return b"%s %s %s\r\n" % (method, target, version)


def fields(count: int, name: bytes = b"X-F%d", size: int = 1) -> bytes:
    return b"".join(b"%s: %s\r\n" % (name % i if b"%d" in name else name, b"v" * size) for i in range(count))


def long_field(size: int) -> bytes:
    """A header whose line, with its CRLF, is ``size`` bytes."""
    return b"X-Long: " + b"v" * (size - 10) + b"\r\n"


POST = line()
HEADS = {
    "plain": POST + b"Host: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n",
    "lower-case names": POST + b"host: x\r\ncontent-type: a/b\r\nuser-agent: OpenAI/Python 1.0\r\n\r\n",
    "a query and an absolute target": line(target=b"http://h:1/v1/completions?a=1&b=%20") + b"\r\n",
    "a fragment": line(target=b"/invocations?x#f") + b"\r\n",
    "a leading empty line": b"\r\n" + POST + b"Host: x\r\n\r\n",
    "HTTP/1.0": line(version=b"HTTP/1.0") + b"Content-Length: 0\r\n\r\n",
    "a GET": line(b"GET", b"/v1/models") + b"Host: x\r\n\r\n",
    "a repeated header": POST + b"Accept: a\r\nX-A: 1\r\naccept: b\r\nACCEPT: c\r\n\r\n",
    "a repeated header with empty values": POST + b"X-A:\r\nX-A: \r\nX-A: b\r\n\r\n",
    "a repeated Connection": POST + b"Connection: keep-alive\r\nConnection: close\r\n\r\n",
    "repeated custom attributes": POST
    + b"X-Amzn-SageMaker-Custom-Attributes: a=1\r\nX-Amzn-SageMaker-Custom-Attributes: b=2\r\n\r\n",
    "an underscore": POST + b"X_A: a\r\nX-A: b\r\nx_a: c\r\n\r\n",
    "only underscores": POST + b"X_A: a\r\n\r\n",
    "an underscore Content_Length": POST + b"Content_Length: 5\r\n\r\n",
    "SCRIPT_NAME": POST + b"SCRIPT_NAME: /x\r\n\r\n",
    "path_info": POST + b"path_info: /x\r\n\r\n",
    "tabs and spaces around a value": POST + b"X-A:\t a\tb \t\r\n\r\n",
    "an empty value": POST + b"X-A:\r\n\r\n",
    "an empty Content-Type": POST + b"Content-Type: \r\n\r\n",
    "a non-ASCII value": POST + "X-A: é\r\n".encode("latin-1") + "X-B: \u20ac\r\n\r\n".encode(),
    "65 fields": POST + fields(65) + b"\r\n",
    "99 fields": POST + fields(99) + b"\r\n",
    "100 fields": POST + fields(100) + b"\r\n",
    "101 fields": POST + fields(101) + b"\r\n",
    "100 fields and an underscore after them": POST + fields(100) + b"X_A: a\r\n\r\n",
    "an underscore and 100 fields": POST + b"X_A: a\r\n" + fields(100) + b"\r\n",
    "100 repeated fields": POST + fields(100, b"X-Same") + b"\r\n",
    "101 repeated fields": POST + fields(101, b"X-Same") + b"\r\n",
    "a field of 8190 bytes": POST + long_field(8190) + b"\r\n",
    "a field of 8191 bytes": POST + long_field(8191) + b"\r\n",
    "long fields": POST + long_field(8190) * 7 + b"\r\n",
    "a request line of 4094 bytes": line(target=b"/invocations?" + b"q" * (4094 - 27)) + b"\r\n",
    "a request line of 4095 bytes": line(target=b"/invocations?" + b"q" * (4095 - 27)) + b"\r\n",
    "Expect: 100-continue": POST + b"Expect: 100-Continue\r\nContent-Length: 1\r\n\r\n",
    "another Expect": POST + b"Expect: 200-ok\r\n\r\n",
    "chunked": POST + b"Transfer-Encoding: chunked\r\n\r\n",
    "an upgrade (not made)": POST + b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABk\r\n"
    b"Content-Length: 2\r\n\r\n",
    "Chunked": POST + b"Transfer-Encoding: Chunked\r\n\r\n",
    "gzip, chunked": POST + b"Transfer-Encoding: gzip, chunked\r\n\r\n",
    "gzip then chunked": POST + b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n",
    "identity, chunked": POST + b"Transfer-Encoding: identity,chunked\r\n\r\n",
    "chunked, gzip": POST + b"Transfer-Encoding: chunked, gzip\r\n\r\n",
    "chunked twice": POST + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
    "gzip only": POST + b"Transfer-Encoding: gzip\r\n\r\n",
    "an unknown coding": POST + b"Transfer-Encoding: br, chunked\r\n\r\n",
    "an empty coding": POST + b"Transfer-Encoding: chunked,\r\n\r\n",
    "chunked in HTTP/1.0": line(version=b"HTTP/1.0") + b"Transfer-Encoding: chunked\r\n\r\n",
    "chunked with a length": POST + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
    "a length with zeros": POST + b"Content-Length: 007\r\n\r\n",
    "two lengths": POST + b"Content-Length: 3\r\nContent-Length: 3\r\n\r\n",
    "a signed length": POST + b"Content-Length: +3\r\n\r\n",
    "a negative length": POST + b"Content-Length: -3\r\n\r\n",
    "a list of lengths": POST + b"Content-Length: 3, 3\r\n\r\n",
    "an empty length": POST + b"Content-Length:\r\n\r\n",
    "two hosts": POST + b"Host: a\r\nHost: a\r\n\r\n",
    "two content types": POST + b"Content-Type: a/b\r\ncontent-type: a/b\r\n\r\n",
    "secure-scheme headers that agree": POST + b"X-Forwarded-Proto: https\r\nX-Forwarded-Ssl: on\r\n\r\n",
    "secure-scheme headers that disagree": POST + b"X-Forwarded-Proto: https\r\nX-Forwarded-Proto: http\r\n\r\n",
    "a folded header": POST + b"X-A: a\r\n b\r\n\r\n",
    "a control byte": POST + b"X-A: a\x01b\r\n\r\n",
    "a DEL": POST + b"X-A: a\x7f\r\n\r\n",
    "a NUL": POST + b"X-A: \x00\r\n\r\n",
    "a CR in a value": POST + b"X-A: a\rb\r\n\r\n",
    "a bare LF": POST + b"X-A: a\nX-B: b\r\n\r\n",
    "a bare LF after the request line": b"POST /invocations HTTP/1.1\nHost: x\r\n\r\n",
    "a line without a colon": POST + b"X-A\r\n\r\n",
    "an empty name": POST + b": a\r\n\r\n",
    "a space before the colon": POST + b"X-A : a\r\n\r\n",
    "a non-token name": POST + b"X(A): a\r\n\r\n",
    "a non-ASCII name": POST + "X-é: a\r\n".encode("latin-1") + b"\r\n",
    "two spaces in the request line": b"POST  /invocations HTTP/1.1\r\n\r\n",
    "a space after the version": b"POST /invocations HTTP/1.1 \r\n\r\n",
    "a lower-case method": line(b"post") + b"\r\n",
    "a relative target": line(target=b"invocations") + b"\r\n",
    "a non-ASCII target": line(target="/é".encode("latin-1")) + b"\r\n",
    "HTTP/0.9": line(version=b"HTTP/0.9") + b"\r\n",
    "HTTP/2.0": line(version=b"HTTP/2.0") + b"\r\n",
    "two empty lines before": b"\r\n\r\n" + POST + b"\r\n",
    "a head past PEEK_BYTES": POST + long_field(8190) * 8 + b"\r\n",  # the main loop reads it: rank 0 gets it whole
}
# What gunicorn takes that a request thread still reads (parse_head's docstring says why)
GUNICORNS_ONLY = {
    "an unknown method": line(b"FROB") + b"\r\n",
    "HTTP/1.2": line(version=b"HTTP/1.2") + b"\r\n",
    "a length past 2**64": POST + b"Content-Length: 99999999999999999999999\r\n\r\n",
    "OPTIONS *": line(b"OPTIONS", b"*") + b"\r\n",
    "an upgrade of a chunked body": POST + b"Connection: Upgrade\r\nUpgrade: h2c\r\nTransfer-Encoding: chunked\r\n\r\n",
}


@pytest.mark.parametrize("name", HEADS)
def test_it_takes_a_head_exactly_when_gunicorn_does_and_gives_the_handler_the_same_headers(name: str) -> None:
    data = HEADS[name]
    theirs = gunicorn_takes(data)
    head = parse_head(data + b"POST /next HTTP/1.1\r\n\r\n")
    ours = head and (head.method, head.path, head.query, tuple(head.headers), head.chunked)
    assert ours == theirs, name
    if head is not None:
        assert head.size == len(data)


@pytest.mark.parametrize("name", GUNICORNS_ONLY)
def test_what_httptools_does_not_parse_plainly_is_left_to_gunicorn(name: str) -> None:
    data = GUNICORNS_ONLY[name]
    assert gunicorn_takes(data) is not None and parse_head(data) is None, name


def test_the_corpus_holds_heads_both_take_and_heads_both_refuse() -> None:
    taken = [name for name, data in HEADS.items() if parse_head(data) is not None]
    assert 20 < len(taken) < len(HEADS) - 20
    assert {"100 fields", "a repeated header", "an underscore", "a field of 8190 bytes", "chunked"} <= set(taken)
    assert "an upgrade (not made)" in taken  # answered in HTTP/1.1, as gunicorn without HTTP/2 does
    assert len(HEADS["a request line of 4094 bytes"].split(b"\r\n")[0]) == 4094
    assert {"a request line of 4094 bytes", "a non-ASCII value"} <= set(taken)


def test_a_repeated_header_reaches_the_handler_joined() -> None:
    head = parse_head(HEADS["repeated custom attributes"])
    assert head is not None and head.header("X-Amzn-SageMaker-Custom-Attributes") == "a=1,b=2"
    theirs = gunicorn_takes(HEADS["repeated custom attributes"])
    assert theirs is not None and request_properties(head.headers, "r") == request_properties(theirs[3], "r")
    head = parse_head(HEADS["a repeated header"])
    assert head is not None and head.headers == [("Accept", "a,b,c"), ("X-A", "1")]


def test_the_bodys_framing_is_known_from_the_head() -> None:
    chunked, sized = parse_head(HEADS["chunked"]), parse_head(HEADS["plain"])
    assert chunked is not None and (chunked.chunked, chunked.length) == (True, None)
    assert sized is not None and (sized.chunked, sized.length) == (False, 2)
    big = parse_head(POST + b"Content-Length: 1234567890123456\r\n\r\n")
    assert big is not None and big.length == 1234567890123456  # 413 without reading it, as gunicorn's thread


def test_a_head_not_whole_is_none() -> None:
    assert parse_head(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") is None


CHUNKED_HEAD = POST + b"Host: x\r\nTransfer-Encoding: chunked\r\n\r\n"


def decoded(data: bytes, limit: int = 1 << 20, piece: int = 0) -> ChunkedBody:
    """``data`` fed to a ``ChunkedBody`` whole, or ``piece`` bytes at a time."""
    body = ChunkedBody(limit)
    for start in range(0, len(data), piece or len(data)):
        body.feed(data[start : start + (piece or len(data))])
    return body


@pytest.mark.parametrize("piece", [0, 1, 7])
def test_a_chunked_body_is_decoded_however_its_bytes_come(piece: int) -> None:
    data = CHUNKED_HEAD + b"5\r\nhello\r\n1;ext=1\r\n \r\n6\r\nworld!\r\n0\r\nX-Trailer: t\r\n\r\n"
    body = decoded(data, piece=piece)
    assert body.complete and not body.beyond and body.body() == b"hello world!" and body.size == 12
    assert not decoded(data[:-2], piece=piece).complete  # its last line not there yet


def test_a_chunked_body_past_its_limit_is_too_large_as_it_passes_it() -> None:
    with pytest.raises(PayloadTooLarge, match="went past the limit; the limit is 8 bytes"):
        decoded(CHUNKED_HEAD + b"5\r\nhello\r\n5\r\nworld\r\n", limit=8)  # its end not yet sent
    assert decoded(CHUNKED_HEAD + b"4\r\nhell\r\n4\r\nhell\r\n0\r\n\r\n", limit=8).complete


@pytest.mark.parametrize(
    "chunks",
    [b"zz\r\nhello\r\n", b"5\r\nhello world\r\n", b"-5\r\nhello\r\n", b"5 \r\nhello\r\n", b"f" * 20 + b"\r\n"],
)
def test_malformed_chunks_are_refused(chunks: bytes) -> None:
    with pytest.raises(MalformedBody, match="chunked framing is malformed") as raised:
        decoded(CHUNKED_HEAD + chunks + b"0\r\n\r\n")
    assert raised.value.status == 400


@pytest.mark.parametrize("after", [b"POST /invocations HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi", b"garbage"])
def test_bytes_after_a_chunked_body_are_not_its_own_and_are_told(after: bytes) -> None:
    body = decoded(CHUNKED_HEAD + b"2\r\nhi\r\n0\r\n\r\n" + after)
    assert body.complete and body.beyond and body.body() == b"hi"
    closing = decoded(CHUNKED_HEAD.replace(b"Host: x", b"Connection: close") + b"0\r\n\r\n" + after)
    assert closing.complete and closing.beyond and closing.body() == b""


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
