"""HTTP/1.1 bytes, in one module for both processes: request heads parsed by httptools (llhttp, the
parser uvicorn uses), what gthread's main loop looks for in a head (``head_ready``,
``request_path``, ``is_bare_ping``), the request as the handler gets it (its ``Input`` properties),
and the answers rank 0 writes (``response_head``, ``chunk``).

``parse_head`` takes a whole HTTP/1.0 or 1.1 head exactly when the frontend's gunicorn (its
default limits and ``header_map = "drop"``) would, and gives its headers as gunicorn's WSGI environ
gives them to a request thread; ``ChunkedBody`` decodes a chunked body with httptools. The frontend
hands a connection whose next request has such a head to rank 0 unread
(``container.frontend.early``), which reads the request with them and answers it itself; anything
else gunicorn reads.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from time import time

import httptools

from container.core.errors import body_malformed, too_large
from container.core.protocol import ResponseHead
from container.core.tracing import TRACEPARENT, TRACESTATE

log = logging.getLogger("sagelmi.http")

INFERENCE_ID = "X-Amzn-SageMaker-Inference-Id"  # the request's id: the client's, else a new one; echoed
GROUP_HEADER = "X-Sagelmi-Group"  # which worker group answered (sticky sessions can be checked with it)
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
PEEK_BYTES = 1 << 16  # what is looked at without reading it: a larger head is read, and handed over with it
# gunicorn's limits (its defaults, which the frontend keeps): a head past one is gunicorn's to refuse
MAX_LINE_BYTES = 4094  # limit_request_line: the request line, without its CRLF
MAX_FIELDS = 100  # limit_request_fields: headers kept (one whose name has "_" is dropped, uncounted)
MAX_FIELD_BYTES = 8190  # limit_request_field_size: a header's line with its CRLF
MAX_HEAD_BYTES = MAX_LINE_BYTES + MAX_FIELDS * (MAX_FIELD_BYTES + 2)  # the head gunicorn buffers at most
_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")  # what gunicorn takes in a value: no control byte but tab
_TARGET = re.compile(rb"(?=/|[\x21-\x7e]*://)[\x21-\x7e]+")  # origin or absolute form, printable ASCII
_VERSION = re.compile(rb"HTTP/1\.[01]")
_SINGLETONS = frozenset({b"host", b"content-type", b"content-length"})  # repeated, gunicorn refuses the head
_CODINGS = frozenset({b"chunked", b"identity", b"gzip", b"deflate", b"compress"})  # gunicorn's
# gunicorn's secure_scheme_headers and forwarder_headers: from a trusted proxy (forwarded_allow_ips)
# it refuses secure-scheme headers that disagree and keeps these two despite their "_"
_SCHEMES = {b"x-forwarded-protocol": b"ssl", b"x-forwarded-proto": b"https", b"x-forwarded-ssl": b"on"}
_FORWARDED = frozenset({b"script_name", b"path_info"})
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
class RequestHead:
    """A request's head: its method, path and query, ``1.1`` or ``1.0``, its headers (as the
    frontend's WSGI environ gives them: named ``Content-Type``, ``X-Amzn-Sagemaker-Custom-Attributes``
    ..., each once), its ``Content-Length`` (``None``: none), whether its body is chunked, whether
    the connection is kept after the answer (as the client asked), and the head's size on the wire."""

    method: str
    path: str
    query: str
    version: str
    headers: list[tuple[str, str]]
    length: int | None
    chunked: bool
    keep_alive: bool
    size: int

    def header(self, name: str) -> str | None:
        lowered = name.lower()
        return next((value for key, value in self.headers if key.lower() == lowered), None)


class _Fields:
    """What httptools reports of a request head: its target, its header fields, its end."""

    __slots__ = ("complete", "headers", "url")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.complete = True


def parse_head(data: bytes) -> RequestHead | None:
    """The head at the start of ``data`` if it is whole, within ``MAX_HEAD_BYTES``, and one gunicorn
    takes; ``None`` if not. An upgrade it asks for is not made (as gunicorn, without HTTP/2, does
    not): it is answered in HTTP/1.1. Left to gunicorn: what httptools does not parse plainly (a
    method it does not know, HTTP/1.2, a ``Content-Length`` past 2**64, ``OPTIONS *``, a chunked
    body with an upgrade) and what gunicorn reads differently from a trusted proxy (``_headers``)."""
    end = data.find(HEAD_END, 0, MAX_HEAD_BYTES)
    if end < 0:
        return None
    head = data[: end + 4]
    if head.count(b"\n") != head.count(b"\r\n"):
        return None  # a bare LF: gunicorn refuses it
    lines = head[2 if head.startswith(b"\r\n") else 0 : end].split(b"\r\n")  # one empty line may lead
    parts = lines[0].split(b" ", 2)
    if len(lines[0]) > MAX_LINE_BYTES or len(parts) != 3 or not _TARGET.fullmatch(parts[1]):
        return None
    if not _VERSION.fullmatch(parts[2]) or any(len(line) + 2 > MAX_FIELD_BYTES for line in lines[1:]):
        return None
    fields = _Fields()
    parser = httptools.HttpRequestParser(fields)
    upgrade = False
    try:
        try:
            parser.feed_data(head)
        except httptools.HttpParserUpgrade:
            upgrade = True  # after the whole head (httptools stops there)
        url = httptools.parse_url(fields.url)
    except httptools.HttpParserError:
        return None
    version = parser.get_http_version()
    headers = _headers(fields.headers) if fields.complete else None
    framing = _framing(headers, version) if headers is not None else None
    if headers is None or framing is None or (upgrade and framing[1]):
        return None
    return RequestHead(
        method=parser.get_method().decode("ascii"),
        path=url.path.decode("latin-1"),
        query=(url.query or b"").decode("latin-1"),
        version=version,
        headers=[
            (name.decode("ascii").title(), value.decode("latin-1"))
            for name, value in headers.items()
            if value or name != b"content-type"  # werkzeug's environ headers leave an empty one out
        ],
        length=framing[0],
        chunked=framing[1],
        keep_alive=parser.should_keep_alive(),
        size=end + 4,
    )


def _headers(fields: list[tuple[bytes, bytes]]) -> dict[bytes, bytes] | None:
    """The header fields as gunicorn's WSGI environ keeps them (by lowered name): a name with "_"
    dropped, a repeated one once where it first came, its values joined with ","; ``None`` where
    gunicorn refuses the head (a value with a control byte, more than ``MAX_FIELDS`` kept, a
    repeated Host, Content-Type or Content-Length, an ``Expect`` but ``100-continue``) or reads it
    differently from a trusted proxy (``SCRIPT_NAME`` or ``PATH_INFO``, secure-scheme headers
    that disagree): Flask refuses those on the handler's routes (400)."""
    kept: dict[bytes, bytes] = {}
    count = 0
    schemes: set[bool] = set()
    for name, raw in fields:
        value = raw.strip(b" \t")
        lowered = name.lower()
        if count >= MAX_FIELDS or not _VALUE.fullmatch(value) or lowered in _FORWARDED:
            return None
        if lowered == b"expect" and value.lower() != b"100-continue":
            return None  # gunicorn's 417
        if lowered in _SCHEMES:
            schemes.add(value == _SCHEMES[lowered])
        if b"_" in name:
            continue
        if lowered in kept:
            if lowered in _SINGLETONS:
                return None
            value = kept[lowered] + b"," + value
        kept[lowered] = value
        count += 1
    return kept if len(schemes) < 2 else None


def _framing(headers: dict[bytes, bytes], version: str) -> tuple[int | None, bool] | None:
    """The body's framing, as gunicorn reads it: its ``Content-Length``, whether it is chunked (a
    list of codings that ends with ``chunked`` once); ``None`` where gunicorn refuses it (an
    unknown coding, a coding after ``chunked``, none, ``chunked`` in HTTP/1.0 or with a length)."""
    length = headers.get(b"content-length")
    codings = headers.get(b"transfer-encoding")
    if codings is None:
        return (int(length) if length is not None else None), False  # httptools checked its digits
    chunked = False
    for coding in (coding.strip(b" \t").lower() for coding in codings.split(b",")):
        if chunked or coding not in _CODINGS:
            return None
        chunked = coding == b"chunked"
    if not chunked or version == "1.0" or length is not None:
        return None
    return None, True


class ChunkedBody:
    """A chunked request's bytes as they come off the socket (its head first), its body decoded by
    httptools (``on_body``) up to the message's end (``on_message_complete``: ``complete``).
    ``feed`` raises ``PayloadTooLarge`` once the body passes ``limit`` bytes, ``MalformedBody``
    where its chunks' framing is not HTTP's. ``beyond``: bytes after the message's end were fed
    (a request sent before the answer): they were read off the socket, and are lost with it."""

    __slots__ = ("beyond", "complete", "limit", "parts", "size", "_parser")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = 0
        self.complete = self.beyond = False
        self._parser = httptools.HttpRequestParser(self)

    def on_body(self, data: bytes) -> None:
        self.parts.append(data)
        self.size += len(data)

    def on_message_begin(self) -> None:
        if self.complete:  # the next request: not this body's to parse
            raise EOFError

    def on_message_complete(self) -> None:
        self.complete = True

    def feed(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if not self.complete:
                raise body_malformed(str(exc)) from None
            self.beyond = True
        if self.size > self.limit:
            raise too_large(None, self.limit)

    def body(self) -> bytes:
        return b"".join(self.parts)


def fingerprint(path: str, body: bytes) -> str:
    """What identifies copies of a request (its route, query and body), for the poison-request guard."""
    return hashlib.blake2b(path.encode() + b"\0" + body, digest_size=16).hexdigest()


# -- what rank 0 writes of a streamed answer

# What gunicorn accepts in a response header (RFC 9110's token; a value of visible characters,
# spaces and tabs): a handler's header with anything else is left out
_RESPONSE_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_RESPONSE_VALUE = re.compile(r"[ \t\x21-\x7e\x80-\xff]*")
# The headers that frame a body, which the worker takes out of a handler's answer
HOP_BY_HOP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
# ... and those of a handler's that the server's framing decides (left out of the head)
_SERVERS = HOP_BY_HOP | {"upgrade", "te", "trailer", "trailers", "server", "date"}
DEFAULT_CONTENT_TYPE = "text/html; charset=utf-8"  # what an answer without one is sent with (Flask's default)
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


def _reason(code: int) -> bytes:
    try:
        return HTTPStatus(code).phrase.upper().encode()
    except ValueError:
        return b"UNKNOWN"


def framing(head: ResponseHead, whole: bool) -> tuple[bool, bool]:
    """How an answer's body is framed: chunked (a stream to an HTTP/1.1 client), and whether the
    connection closes after it (asked, or a stream's end that only the close can tell)."""
    chunked = not whole and head.version == "HTTP/1.1"
    return chunked, head.close or (not whole and not chunked)


def response_head(head: ResponseHead, code: int, headers: Mapping[str, str], length: int | None) -> bytes:
    """The HTTP head of an answer rank 0 writes, as the frontend's gunicorn writes the head of one
    (its status line, ``Server``, ``Date``, ``Connection``, the body's framing, then the handler's
    headers, a default ``Content-Type``, then the frontend's), so a client sees one kind of head
    whichever process wrote it. ``length``: a whole body's (``None``: a stream, ``framing``). A
    header of the handler's that frames the body is the server's; one gunicorn would refuse
    (a name that is not a token, a value with control characters) is left out."""
    chunked, close = framing(head, length is not None)
    lines = [
        b"%s %d %s\r\nServer: %s\r\nDate: %s\r\nConnection: %s\r\n"
        % (
            head.version.encode(),
            code,
            _reason(code),
            head.server.encode(),
            _http_date(),
            b"close" if close else b"keep-alive",
        )
    ]
    if chunked:
        lines.append(b"Transfer-Encoding: chunked\r\n")
    elif length is not None and not (100 <= code < 200 or code in (204, 304)):
        lines.append(b"Content-Length: %d\r\n" % length)
    typed = False
    ours = {name.lower() for name in head.headers}
    for name, value in headers.items():
        lower = name.lower()
        if lower in _SERVERS or lower in ours:
            continue
        if not _RESPONSE_TOKEN.fullmatch(name) or not _RESPONSE_VALUE.fullmatch(value):
            log.warning("leaving out the handler's response header %r: not one HTTP allows", name[:100])
            continue
        typed = typed or lower == "content-type"
        lines.append(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
    if not typed:
        lines.append(b"Content-Type: %s\r\n" % DEFAULT_CONTENT_TYPE.encode())
    for name, value in head.headers.items():
        lines.append(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
    lines.append(b"\r\n")
    return b"".join(lines)
