"""A request as the handler gets it (its ``Input`` properties), the streamed requests
gthread's main loop takes without a request thread (``container.frontend.early``), and what that
loop looks for in a request head before a thread reads it (``head_ready``, ``request_path``).

``read_request`` looks at what a connection has sent (peeked, ``MSG_PEEK``) and takes only what
gunicorn would read the same way: a streamed completion, chat or LMI call over HTTP/1.1 with one
``Content-Length``, no transfer coding, no repeated or unusual header, limits below gunicorn's.
Where a request thread must take such a request over, gunicorn reads the same bytes, and the
thread checks that it read the same request (``HandlerRoutes``, ``Invocation``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from container.core.tracing import TRACEPARENT, TRACESTATE

INFERENCE_ID = "X-Amzn-SageMaker-Inference-Id"  # the request's id: the client's, else a new one; echoed
GROUP_HEADER = "X-Sagelmi-Group"  # which worker group answered (sticky sessions can be checked with it)
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
# A body that asks for a stream (OpenAI's and LMI's "stream": true)
STREAM_ASKED = re.compile(rb'"stream"\s*:\s*true')
# The routes read early, when their body asks for a stream
HOT_PATHS = ("/v1/completions", "/v1/chat/completions", "/invocations")
_HOT_LINES = tuple(b"POST %s HTTP/1.1\r\n" % path.encode() for path in HOT_PATHS)
_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d{1,12})[ \t]*\r\n", re.IGNORECASE)  # may_be_read's look
PEEK_BYTES = 1 << 16  # what is looked at without reading it: a larger request goes through the frontend
MAX_FIELDS = 64  # below gunicorn's limit_request_fields (100)
MAX_FIELD_BYTES = 4096  # below gunicorn's limit_request_field_size (8190) and limit_request_line (4094)
_TOKEN = re.compile(rb"[!#$%&'*+.^`|~0-9A-Za-z-]+")  # a header name (RFC 9110), without "_" (gunicorn drops those)
_VALUE = re.compile(rb"[\t\x20-\x7e]*")  # a header value of visible ASCII, spaces and tabs
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


def may_be_read(data: bytes) -> bool | Partial:
    """Whether the start of a connection's next request (``data``, peeked) may be one
    ``read_request`` takes: the request line of one of ``HOT_PATHS``, a ``Content-Length`` and a
    body, all there, that asks for a stream. ``Partial`` while the request line, the head or the
    body are not all there yet. A cheap look for gthread's main loop, which hands such a
    connection to rank 0 unread (``Handoff``), where ``read_request`` decides."""
    if not data.startswith(_HOT_LINES):
        return Partial(len(data) + 1) if any(line.startswith(data) for line in _HOT_LINES) else False
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return Partial(len(data) + 1) if len(data) < PEEK_BYTES else False
    length = _LENGTH.search(data, 0, end + 2)
    if length is None:
        return False
    size = end + 4 + int(length.group(1))
    if size > len(data):
        return Partial(size) if size <= PEEK_BYTES else False
    return STREAM_ASKED.search(data, end + 4, size) is not None


def read_request(data: bytes, max_body: int) -> ReadRequest | Partial | None:
    """The first request in ``data`` if it may be read early, else ``None``: a POST to one
    of ``HOT_PATHS`` over HTTP/1.1, whole in ``data``, with a ``Content-Length`` body of at most
    ``max_body`` bytes that asks for a stream, and only plain headers, each once. ``Partial``
    for the start of such a request (its head not ended, or its body not all there)."""
    if not data.startswith(_HOT_LINES):
        return Partial(len(data) + 1) if any(line.startswith(data) for line in _HOT_LINES) else None
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return Partial(len(data) + 1) if len(data) < PEEK_BYTES else None
    line_end = data.index(b"\r\n")
    path = data[5 : line_end - 9].decode("ascii")
    lines = data[line_end + 2 : end].split(b"\r\n") if end > line_end else []
    if len(lines) > MAX_FIELDS:
        return None
    headers: list[tuple[str, str]] = []
    seen: set[bytes] = set()
    length = None
    close = False
    for line in lines:
        name, colon, value = line.partition(b":")
        lowered = name.lower()
        if not colon or len(line) > MAX_FIELD_BYTES or not _TOKEN.fullmatch(name) or lowered in seen:
            return None
        value = value.strip(b" \t")
        if not _VALUE.fullmatch(value) or lowered in _DECLINED:
            return None
        seen.add(lowered)
        if lowered == b"content-length":
            if not value.isdigit() or len(value) > 12:
                return None
            length = int(value)
        elif lowered == b"connection":
            tokens = {token.strip().lower() for token in value.split(b",")}
            if tokens - {b"close", b"keep-alive"}:
                return None  # an upgrade or a hop-by-hop header list: gunicorn's to read
            close = b"close" in tokens
        headers.append((name.decode("ascii").title(), value.decode("ascii")))
    if length is None or length > max_body or end + 4 + length > PEEK_BYTES:
        return None
    if end + 4 + length > len(data):
        return Partial(end + 4 + length)
    body = data[end + 4 : end + 4 + length]
    if STREAM_ASKED.search(body) is None:
        return None
    return ReadRequest(path, headers, body, close, end + 4 + length)
