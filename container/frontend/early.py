"""The handler's routes (``ROUTES``), served one way: gthread's main loop hands each connection
whose next request is on one of them to a worker group unread, and rank 0 reads the request and
answers it itself (``container.worker.handoff``); no request thread takes part.

A connection goes so once its next request's head is whole, one gunicorn takes
(``ingress.parse_head``: HTTP/1.0 or 1.1, a body by ``Content-Length`` or chunked), on one of the
routes with its method; what the frontend read of it (a head read whole, bytes gunicorn read
ahead) goes with it (``Attach.prefix``). Admission (``Router.admit``) and routing (a stateful
session's group, else the least busy) must take it; what they refuse, a copy of a poison request
the frontend saw whole, and everything while the server drains, the main loop answers itself
(``_refuse``: the route's error); a copy it did not see whole rank 0 refuses (the ``Attach``
carries the refused fingerprints). A head gunicorn takes that ``parse_head`` does not (HTTP/1.2,
an unknown method ...) reaches Flask, which refuses it (400).

The reader thread of the group's connection follows it (``HandedOff``): ``Taken`` (rank 0 read
the request: its fingerprint, for the poison guard, unless the frontend's look saw it whole), the
``Head`` rank 0 writes (one that opens or closes a session waits on rank 0 until the routing here
knows it: ``GroupClient.routed``), then the ``End`` (the status and bytes written, how it ended,
whether the connection stays open), on which it writes the completion line, releases the
admission and gives the connection back to the main loop. A group lost before the ``End`` leaves
the client the route's 503 where nothing was written, the stream's in-band error where a stream's
head went out and no chunk is torn, else a closed connection.

Why: a request thread per request costs the frontend CPU, and reading the request before its
group has it adds to the time to the first token (docs/benchmarks/ measures both).
"""

from __future__ import annotations

import enum
import logging
import socket
import time
import uuid
from typing import Any, Protocol

from gunicorn import SERVER
from werkzeug.datastructures import Headers as WerkzeugHeaders

from container.core.errors import (
    HeadTooLarge,
    QueueFull,
    RequestStoppedEngine,
    ServiceUnavailable,
    ServingError,
    describe,
    error_body,
    in_band_error,
)
from container.core.ingress import (
    END_OF_CHUNKS,
    GROUP_HEADER,
    INFERENCE_ID,
    RequestHead,
    chunk,
    fingerprint,
    parse_head,
    request_path,
    response_head,
)
from container.core.launch import FrontendLaunch
from container.core.protocol import MAX_PREFIX_BYTES, MAX_REFUSED_SENT, Chunk, End, Fail, Head, ResponseHead, Taken
from container.core.sessions import SESSION_ID
from container.frontend.completion import Answer, Exchange, RequestLog
from container.frontend.main_loop import json_answer, read_ahead
from container.frontend.router import Router

log = logging.getLogger("sagelmi.frontend")

# The handler's routes and the method each answers (Flask answers the others on these paths: 405, OPTIONS, HEAD)
ROUTES = {
    "/invocations": "POST",
    "/v1/chat/completions": "POST",
    "/v1/completions": "POST",
    "/v1/models": "GET",
    "/tokenize": "POST",
    "/detokenize": "POST",
    "/v1/embeddings": "POST",
    "/v1/score": "POST",
    "/v1/rerank": "POST",
    "/v1/responses": "POST",
    "/v1/messages": "POST",
    "/v1/messages/count_tokens": "POST",
}

_METHODS = tuple(f"{method} ".encode() for method in set(ROUTES.values()))


def count_refusal(metrics: Any, exc: ServingError) -> None:
    """The counters of requests refused before they reached a group."""
    if isinstance(exc, RequestStoppedEngine):
        metrics.poison_refused.inc()
    elif isinstance(exc, QueueFull):
        metrics.queue_full.inc()


class Connections(Protocol):
    """The HTTP server's side (gthread's main loop, ``container.frontend.server``)."""

    def let_go(self, conn: Any, keep: bool) -> None:
        """The connection is the server's again: kept alive for its next request, or closed
        (called from any thread; runs on the main loop)."""


class Stage(enum.Enum):
    """How far a handed-off request got, as the reader thread of its group's connection learnt it."""

    SENT = "sent"  # rank 0 has the connection
    READ = "read"  # rank 0 read the request (Taken)
    ANSWERING = "answering"  # rank 0 writes its answer (Head)
    ENDED = "ended"  # the End came, or the group was lost: the connection is the server's again


class HandedOff:
    """One connection handed to a group, until its ``End``: what the reader thread of the group's
    connection learns of it (``deliver``), or the group's loss (``fail``)."""

    def __init__(self, owner: EarlyRequests, group: Any, conn: Any, exchange: Exchange, asked: str | None) -> None:
        self.id = uuid.uuid4().hex
        self.owner = owner
        self.group = group
        self.conn = conn
        self.exchange = exchange  # its id, route, arrival, span: what its completion line says
        self.path = exchange.path
        self.request_id = exchange.request_id
        self.asked = asked  # the stateful session the request names
        self.incarnation = group.incarnation
        self.stage = Stage.SENT
        self.tag: tuple[str, str, str] | None = None  # (fingerprint, request id, route): GroupClient.on_lost
        self.head: Head | None = None
        self.head_at = 0.0
        self.torn = False  # the client's socket holds part of an HTTP chunk (protocol: Chunk.torn)
        self.chunked = True  # a stream's body is HTTP/1.1 chunks

    def deliver(self, messages: list) -> None:
        for message in messages:
            if isinstance(message, Taken):
                self.tag = (message.fingerprint, self.request_id, self.path)
                self.stage = Stage.READ
            elif isinstance(message, Head):
                self.head, self.head_at, self.stage = message, time.monotonic(), Stage.ANSWERING
                if message.held:  # it opens or closes a session: rank 0 holds it until the routing knows
                    self.owner.router.sessions.observe(
                        self.asked, self.group, self.incarnation, message.code, message.headers
                    )
                    self.group.routed(self.id)
            elif isinstance(message, Chunk):
                self.torn = message.torn  # progress of the body rank 0 writes
            elif isinstance(message, End):
                self.owner.finish(self, message)
            elif isinstance(message, Fail):
                self.fail(ServiceUnavailable(message.error))

    def fail(self, error: ServingError) -> None:
        self.owner.lost(self, error)


class EarlyRequests:
    def __init__(self, router: Router, launch: FrontendLaunch, requests: RequestLog) -> None:
        self.router = router
        self.launch = launch
        self.requests = requests
        self.metrics = requests.metrics
        self.connections: Connections | None = None  # set by the server before the first request

    def may_take(self, start: bytes) -> bool:
        """Whether a connection whose next request begins with ``start`` may be handed over once
        its head is whole (its head is then peeked, not read, while it comes)."""
        path = request_path(start)
        if path:
            return path in ROUTES
        start = start.lstrip(b"\r\n")
        return any(method.startswith(start[: len(method)]) or start.startswith(method) for method in _METHODS)

    def takes(self, data: bytes) -> bool:
        """Whether the request whose head ``data`` starts with is one ``send`` hands over (unless
        admission or routing refuse it)."""
        return self._takeable(data) is not None

    @staticmethod
    def _takeable(data: bytes) -> RequestHead | None:
        head = parse_head(data)
        return head if head is not None and ROUTES.get(head.path) == head.method else None

    def send(self, conn: Any, close: bool, data: bytes) -> bool:
        """gthread's main loop, a connection whose next request's head is there (``data``: what
        gunicorn read of it, then what a peek sees): hand it to a group with the rest unread if that
        request may be (True: the connection is this module's until it gives it back; gunicorn's
        read bytes go with it). ``close``: gunicorn would close the connection after the answer."""
        router = self.router
        if self.connections is None:
            return False
        if type(conn.sock) is not socket.socket:  # TLS: gunicorn's to read
            return False
        head = self._takeable(data)
        if head is None:
            return False
        ahead = read_ahead(conn)
        end = head.size + (head.length or 0)
        whole = len(data) >= end and not head.chunked  # (a chunked body: rank 0 decodes it)
        print_ = fingerprint(f"{head.path}?{head.query}", data[head.size : end]) if whole else None
        # (at most what the descriptor channel carries: the latest refused)
        refused = router.poison.refusals(MAX_REFUSED_SENT) if print_ is None and router.poison.refusing else {}
        exchange = self.requests.begin(WerkzeugHeaders(head.headers), head.method, head.path, head.path, bind=False)
        if len(ahead) > MAX_PREFIX_BYTES:  # a head larger than the descriptor channel carries
            too_large = HeadTooLarge(
                f"the request head is larger than {MAX_PREFIX_BYTES // 1024} KiB, this route's limit"
            )
            self._refuse(conn, True, head, exchange, too_large)
            return True
        asked = head.header(SESSION_ID)
        close_after_refusal = close or print_ is None or bool(ahead)  # kept only when read off here, whole
        try:
            if print_ is not None and router.poison.refusing:
                router.poison.check(print_)  # a copy of a refused request: 422
            router.admit()
        except ServingError as exc:
            self._refuse(conn, close_after_refusal or router.draining, head, exchange, exc)
            return True
        try:
            group = router.pick_for(asked)  # a stateful session's group, else the least busy
        except ServingError as exc:
            router.release()
            self._refuse(conn, close_after_refusal, head, exchange, exc)
            return True
        request_id = exchange.request_id
        record = HandedOff(self, group, conn, exchange, asked)
        tracer = self.requests.tracer
        trace = tracer.headers_of(exchange.span) if tracer is not None and exchange.span is not None else {}
        if print_ is not None:  # the whole request was peeked: its fingerprint is known before rank 0 reads it
            record.tag = (print_, request_id, head.path)
            record.stage = Stage.READ
        record.chunked = head.version == "1.1"  # a stream to an HTTP/1.0 client ends with the connection
        version = f"HTTP/{head.version}"
        given = ResponseHead(version, SERVER, close, {GROUP_HEADER: group.name, INFERENCE_ID: request_id})
        conn.sock.setblocking(True)  # the mode a request thread serves it in, which rank 0's writes keep
        if ahead:
            conn.parser.unreader.take_buffered()  # rank 0 has those bytes now (the prefix)
        try:
            group.hand_off(
                conn.sock, given, self.launch.max_payload_bytes, record, record.tag is not None, trace, ahead, refused
            )
        except ServingError as exc:
            router.release()
            self._refuse(conn, close_after_refusal, head, exchange, exc)
            return True
        self.metrics.read_early.inc()
        return True

    def _refuse(self, conn: Any, close: bool, head: RequestHead, exchange: Exchange, error: ServingError) -> None:
        """Answer a request the server refuses before any group has it (the server drains, the queue
        is full, no group is ready, its session cannot be served, a copy of a poison request): the
        route's error, written here. The connection stays open when its whole request was peeked
        (it is read off now), gunicorn held none of it and nothing asks for a close."""
        count_refusal(self.metrics, error)
        status = describe(error)[0]
        body = error_body(head.path, error)
        given = ResponseHead(
            f"HTTP/{head.version}", SERVER, close or not head.keep_alive, {INFERENCE_ID: exchange.request_id}
        )
        sock = conn.sock
        try:
            if not given.close:
                sock.recv(head.size + (head.length or 0), socket.MSG_DONTWAIT)  # peeked whole: all there
            data = response_head(given, status, {"Content-Type": "application/json"}, len(body)) + body
            kept = sock.send(data, socket.MSG_DONTWAIT) == len(data) and not given.close
        except OSError:
            kept = False
        self.requests.finish(exchange, status, len(body))()
        assert self.connections is not None  # send() checked
        self.connections.let_go(conn, kept)

    def finish(self, record: HandedOff, end: End) -> None:
        """The reader thread: rank 0 ended the answer and let go of the connection."""
        outcome = end.outcome or "completed"
        if outcome == "refused":  # rank 0 refused a copy of a poison request (422)
            self.metrics.poison_refused.inc()
        self._done(record, end.code or (499 if outcome == "client_gone" else 400), outcome, end)

    def lost(self, record: HandedOff, error: ServingError) -> None:
        """The reader thread: the group went away before the answer's end."""
        if record.stage is Stage.ENDED:
            return
        head = record.head
        sock = record.conn.sock
        if head is None:
            described = describe(error)
            data, code = json_answer(record.path, *described), described[0]
        elif head.stream and not record.torn and record.chunked:
            content_type = next((v for k, v in head.headers.items() if k.lower() == "content-type"), "")
            data = chunk(in_band_error(record.path, content_type, error)) + END_OF_CHUNKS
            code = head.code
        else:
            data, code = b"", head.code  # a whole answer, or a torn chunk: only the close is left to say
        log.error("request %s: worker group %s went away during it", record.request_id, record.group.name)
        try:
            if data:
                sock.send(data, socket.MSG_DONTWAIT)
        except OSError:
            pass
        self._done(record, code, "error", None)

    def _done(self, record: HandedOff, code: int, outcome: str, end: End | None) -> None:
        if record.stage is Stage.ENDED:
            return
        record.stage = Stage.ENDED
        head = record.head
        answer = Answer(streamed=bool(head and head.stream), outcome=outcome, bytes=end.body_bytes if end else 0)
        if end is not None:
            answer.prompt_tokens, answer.completion_tokens = end.prompt_tokens, end.completion_tokens
        exchange = record.exchange
        if head is not None and head.started:
            answer.queue_wait = head.started - exchange.started
        exchange.answer = answer
        whole = None if head is None or head.stream else answer.bytes
        try:
            self.requests.finish(exchange, code, whole, record.head_at)()
        finally:
            self.router.release()
            assert self.connections is not None  # send() took it
            self.connections.let_go(record.conn, end is not None and not end.close)
