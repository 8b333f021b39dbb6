"""HTTP/1.1 bytes, in one module for both processes: request heads parsed by httptools (llhttp, the
parser uvicorn uses), what gthread's main loop looks for in a head before a thread reads it
(``head_ready``, ``request_path``, ``is_bare_ping``), a request as the handler gets it (its ``Input``
properties), and what rank 0 writes of a streamed answer (``response_head``, ``chunk``).

``read_request`` takes only what gunicorn would read the same way: a streamed completion, chat or
LMI call over HTTP/1.1 with one ``Content-Length``, no transfer coding, no repeated or unusual
header, limits below gunicorn's. Where a request thread must take such a request over, gunicorn
reads the same bytes, and the thread checks that it read the same request (``HandlerRoutes``,
``Invocation``). ``may_be_read`` is the same decision, made by the frontend before it hands a
connection to rank 0 unread.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from email.utils import formatdate
from time import time

import httptools

from container.core.protocol import ResponseHead
from container.core.sessions import SESSION_HEADERS
from container.core.tracing import TRACEPARENT, TRACESTATE

INFERENCE_ID = "X-Amzn-SageMaker-Inference-Id"  # the request's id: the client's, else a new one; echoed
GROUP_HEADER = "X-Sagelmi-Group"  # which worker group answered (sticky sessions can be checked with it)
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
# A body that asks for a stream (OpenAI's and LMI's "stream": true)
STREAM_ASKED = re.compile(rb'"stream"\s*:\s*true')
# The routes read early, when their body asks for a stream
HOT_PATHS = ("/v1/completions", "/v1/chat/completions", "/invocations")
_HOT_LINES = tuple(b"POST %s HTTP/1.1\r\n" % path.encode() for path in HOT_PATHS)
PEEK_BYTES = 1 << 16  # what is looked at without reading it: a larger request goes through the frontend
MAX_FIELDS = 64  # below gunicorn's limit_request_fields (100)
MAX_FIELD_BYTES = 4096  # below gunicorn's limit_request_field_size (8190) and limit_request_line (4094)
_VALUE = re.compile(rb"[\t\x20-\x7e]*")  # a header value of visible ASCII, spaces and tabs (gunicorn's)
# Headers that make a request one the frontend must read: a body framed otherwise, a session
# (routed by the frontend to the group holding it), an interim answer, a protocol change.
_DECLINED = frozenset(
    {b"transfer-encoding", b"expect", b"upgrade", b"x-amzn-sagemaker-session-id", b"http2-settings", b"te"}
)
HEAD_END = b"\r\n\r\n"
_BARE_LF = re.compile(rb"(?<!\r)\n")
_PING_LINES = (b"GET /ping HTTP/", b"GET /ping?")
_BODY_FIELD = re.compile(rb"\r\n(?:content-length|transfer-encoding)[ \t]*:", re.IGNORECASE)


def request_properties(
    headers: Iterable[tuple[str, str]], request_id: str, trace_headers: dict[str, str] | None = None
) -> dict[str, str]:
    """The handler's ``Input`` properties, as DJL Serving builds them: the
    headers (a repeated one joined with ", "), the ``k=v`` pairs of the custom
    attributes header (in place of the header itself) and ``requestId``. With
    tracing on, ``trace_headers`` (the frontend span's W3C headers) replace the
    client's, as every hop of a trace does."""
    props: dict[str, str] = {}
    for name, value in headers:
        if trace_headers and name.lower() in (TRACEPARENT, TRACESTATE):
            continue
        if name.lower() == CUSTOM_ATTRIBUTES.lower():
            for pair in value.split(";"):
                key, sep, val = pair.partition("=")
                if sep and key.strip():
                    props[key.strip()] = val.strip()
            continue
        props[name] = f"{props[name]}, {value}" if name in props else value
    props["requestId"] = request_id
    if trace_headers:
        props.update(trace_headers)
    return props


def head_ready(data: bytes, start: int = 0) -> bool:
    """Whether ``data``, the start of a request, holds its whole head (up to its empty line), or
    something gunicorn refuses without reading more (a line ended by a bare LF): a request thread
    may read it then without waiting on the client. ``start``: where to look from (what came
    before was looked at already)."""
    start = max(start - 3, 0)
    return data.find(HEAD_END, start) >= 0 or _BARE_LF.search(data, start) is not None


def request_path(data: bytes) -> str:
    """The path of the request line at the start of ``data`` ("" until that line is whole)."""
    line, crlf, _ = data.lstrip(b"\r\n")[:8192].partition(b"\r\n")
    parts = line.split(b" ")
    if not crlf or len(parts) != 3:
        return ""
    return parts[1].partition(b"?")[0].decode("latin-1")


def is_bare_ping(head: bytes) -> bool:
    """Whether the whole head ``head`` is SageMaker's health check, ``GET /ping``, without a body."""
    end = head.find(HEAD_END)
    return end >= 0 and head.startswith(_PING_LINES) and _BODY_FIELD.search(head, 0, end + 2) is None


@dataclass(frozen=True)
class ReadRequest:
    """One request read early: its route, its headers as the frontend's WSGI environ names
    them (``Content-Type``, ``X-Amzn-Sagemaker-Custom-Attributes`` ...), its body, whether the
    client asked to close the connection after it, and its length on the wire."""

    path: str
    headers: list[tuple[str, str]]
    body: bytes
    close: bool
    size: int

    def header(self, name: str) -> str | None:
        lowered = name.lower()
        return next((value for key, value in self.headers if key.lower() == lowered), None)


@dataclass(frozen=True)
class Partial:
    """What ``read_request`` says of a request that may be read early once the rest of it came:
    how many bytes it has at least (``need``)."""

    need: int


class _Fields:
    """What httptools reports of a request head: its target and its header fields."""

    __slots__ = ("headers", "url")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))


def parse_head(head: bytes) -> list[tuple[bytes, bytes]] | None:
    """The header fields of the request head ``head`` (its request line to its empty line), as
    httptools parses it (values without their surrounding whitespace); ``None`` for a head it
    refuses."""
    fields = _Fields()
    try:
        httptools.HttpRequestParser(fields).feed_data(head)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        return None
    return [(name, value.strip(b" \t")) for name, value in fields.headers]


def may_be_read(data: bytes) -> bool | Partial:
    """Whether the start of a connection's next request (``data``, peeked) is one rank 0's
    ``read_request`` takes; ``Partial`` while the request line, the head or the body are not all
    there yet. gthread's main loop hands such a connection to rank 0 unread (an ``Attach`` with ``max_body``)."""
    request = read_request(data, PEEK_BYTES)
    return request if isinstance(request, Partial) else request is not None


def read_request(data: bytes, max_body: int) -> ReadRequest | Partial | None:
    """The first request in ``data`` if it may be read early, else ``None``: a POST to one
    of ``HOT_PATHS`` over HTTP/1.1, whole in ``data``, with a ``Content-Length`` body of at most
    ``max_body`` bytes that asks for a stream, and only plain headers, each once. ``Partial``
    for the start of such a request (its head not ended, or its body not all there)."""
    if not data.startswith(_HOT_LINES):
        return Partial(len(data) + 1) if any(line.startswith(data) for line in _HOT_LINES) else None
    end = data.find(HEAD_END)
    if end < 0:
        return Partial(len(data) + 1) if len(data) < PEEK_BYTES else None
    head = data[: end + 4]
    fields = parse_head(head) if head.count(b"\n") == head.count(b"\r\n") else None  # gunicorn refuses a bare LF
    if fields is None or len(fields) > MAX_FIELDS:
        return None
    headers: list[tuple[str, str]] = []
    seen: set[bytes] = set()
    length = None
    close = False
    for name, value in fields:
        lowered = name.lower()
        if len(name) + len(value) >= MAX_FIELD_BYTES or b"_" in name or lowered in seen or lowered in _DECLINED:
            return None  # gunicorn drops a name with "_"; these headers are the frontend's to act on
        if not _VALUE.fullmatch(value):
            return None
        seen.add(lowered)
        if lowered == b"content-length":
            if len(value) > 12:  # httptools checked its digits
                return None
            length = int(value)
        elif lowered == b"connection":
            tokens = {token.strip().lower() for token in value.split(b",")}
            if tokens - {b"close", b"keep-alive"}:
                return None  # an upgrade or a hop-by-hop header list: gunicorn's to read
            close = b"close" in tokens
        headers.append((name.decode("ascii").title(), value.decode("ascii")))
    size = end + 4 + (length or 0)
    if length is None or length > max_body or size > PEEK_BYTES:
        return None
    if size > len(data):
        return Partial(size)
    body = data[end + 4 : size]
    if STREAM_ASKED.search(body) is None:
        return None
    path = data[5 : data.index(b" ", 5)].decode("ascii")
    return ReadRequest(path, headers, body, close, size)


# -- what rank 0 writes of a streamed answer

# What gunicorn accepts in a response header (RFC 9110's token; a value of visible characters,
# spaces and tabs): a head with anything else is left to the frontend, which refuses it
_RESPONSE_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_RESPONSE_VALUE = re.compile(r"[ \t\x21-\x7e\x80-\xff]*")
# The headers that frame a body, which the worker takes out of a handler's answer
HOP_BY_HOP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
# Headers the frontend acts on or that frame the body: a head with one is the frontend's to write
_FRONTEND_HEADERS = HOP_BY_HOP | {"upgrade", "te", "trailer", "trailers"} | SESSION_HEADERS
END_OF_CHUNKS = b"0\r\n\r\n"  # the last chunk of an HTTP/1.1 chunked body (no trailers)
_date: tuple[int, bytes] = (0, b"")


def chunk(data: bytes) -> bytes:
    """``data`` as one HTTP/1.1 chunk."""
    return b"%X\r\n%s\r\n" % (len(data), data)


def _http_date() -> bytes:
    """The ``Date`` header's value (as gunicorn writes it), formatted once a second."""
    global _date
    now = int(time())
    if _date[0] != now:
        _date = (now, formatdate(now, usegmt=True).encode())
    return _date[1]


def response_head(head: ResponseHead, chunked: bool, code: int, headers: Mapping[str, str]) -> bytes | None:
    """The HTTP head of a streamed answer as the frontend's gunicorn writes the head of the same
    answer (its status line, ``Server``, ``Date``, ``Connection`` and ``Transfer-Encoding``, then the
    handler's headers, then the frontend's), so a client sees one head whichever process wrote it:
    ``None`` where the frontend must write it itself (not a 200, no ``Content-Type``, a header the
    frontend acts on or would refuse)."""
    if code != 200:
        return None
    lines = [
        b"%s 200 OK\r\nServer: %s\r\nDate: %s\r\nConnection: %s\r\n"
        % (head.version.encode(), head.server.encode(), _http_date(), b"close" if head.close else b"keep-alive")
    ]
    if chunked:
        lines.append(b"Transfer-Encoding: chunked\r\n")
    typed = False
    ours = {name.lower() for name in head.headers}
    for name, value in headers.items():
        lower = name.lower()
        if (
            lower in _FRONTEND_HEADERS
            or lower in ours
            or not _RESPONSE_TOKEN.fullmatch(name)
            or not _RESPONSE_VALUE.fullmatch(value)
        ):
            return None
        typed = typed or lower == "content-type"
        lines.append(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
    if not typed:
        return None  # the frontend's default content type is its own to add
    for name, value in head.headers.items():
        lines.append(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
    lines.append(b"\r\n")
    return b"".join(lines)
