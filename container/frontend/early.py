"""Streamed requests taken by gthread's main loop and sent to their worker group without a
request thread (``container.core.ingress``).

For a connection whose next request is already waiting and may be read early
(``read_request``: a streamed completion, chat or LMI call with plain headers), the main loop
admits it, picks the group, sends it with the client's socket (``GroupClient.submit`` with
``client``: rank 0 writes the HTTP head and the body itself) and reads it off the socket. No
thread is woken for it. When the group says the answer went out whole (``Ending``, then
``End``), the reader thread of the group's connection writes the completion line, releases
the admission and gives the connection back to the main loop (kept alive, or closed).

Anything else hands the request to a request thread, which reads the same bytes with gunicorn
(they are put back in front of the connection) and follows the request as its own
(``adopt``, by its socket; ``Invocation``): a head the group left to the frontend, an error,
the group's loss, ``predict_timeout`` without a word from the group, a client found gone by
the watch (``CLIENT_CHECK_INTERVAL``). The thread then does what it does for any request
(the error in the route's envelope, an in-band error, 504, 499 ...), with the same timeouts,
counted from the group's last message. A request gunicorn reads otherwise than the main loop
did (another route, another body) is stopped in its group and its connection closed without an
answer (``abandon``). Nothing is taken early while draining, with tracing on, while copies of
some request are refused as poisonous, or when admission or routing would refuse it: a thread
then serves and refuses it as before.

Why: the request threads that followed a request used 0.9 ms of the frontend's CPU per request at
one stream on two cores; taken this way the frontend's process uses a third less in all
(docs/benchmarks/README.md, issue 31).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from gunicorn import SERVER

from container.core.errors import ServingError
from container.core.ingress import (
    GROUP_HEADER,
    INFERENCE_ID,
    PEEK_BYTES,
    Partial,
    ReadRequest,
    read_request,
    request_properties,
)
from container.core.launch import FrontendLaunch
from container.core.protocol import Invoke, ResponseHead
from container.frontend.client import CLIENT_CHECK_INTERVAL, client_gone
from container.frontend.completion import Answer, Exchange, RequestLog
from container.frontend.group_client import GroupClient
from container.frontend.pending import PendingRequest
from container.frontend.poison import fingerprint
from container.frontend.router import Router

log = logging.getLogger("sagelmi.frontend")

TAKEN, CLOSED = "taken", "closed"  # what EarlyRequests.send found ("": a request for a thread)


class Connections(Protocol):
    """The HTTP server's side (gthread's main loop, ``container.frontend.server``); both are
    called from any thread and run on the main loop."""

    def requeue(self, conn: Any, raw: bytes) -> None:
        """Serve the connection with a request thread, ``raw`` (the request) read first."""

    def let_go(self, conn: Any, keep: bool) -> None:
        """The connection is the server's again: kept alive for its next request, or closed."""


@dataclass
class EarlyRequest:
    """A request taken early: its group and answers, its id, route and fingerprint, when the
    frontend admitted it, its connection and bytes on the wire, whether the connection closes
    after it, and who ends it (``owner``: nobody yet, the reader thread at a clean end, or a
    request thread)."""

    group: GroupClient
    pending: PendingRequest
    request_id: str
    path: str
    print_: str
    admitted: float
    conn: Any
    raw: bytes
    close: bool
    owner: str = ""

    def abandon(self, router: Router, why: str) -> None:
        """Stop this request, which its thread will not follow (``why``); its connection must be
        closed without an answer: the group may have written to it."""
        log.error("request %s, sent early, %s: stopping it and closing its connection", self.request_id, why)
        self.group.cancel(self.pending.id)
        router.release()


class EarlyRequests:
    def __init__(self, router: Router, launch: FrontendLaunch, requests: RequestLog, enabled: bool) -> None:
        self.router = router
        self.launch = launch
        self.requests = requests
        self.metrics = requests.metrics
        self.enabled = enabled
        self.connections: Connections | None = None  # set by the server before the first request
        self._lock = threading.Condition()
        # the client's socket -> its request, until the reader thread ended it or a thread adopted it
        self._sent: dict[socket.socket, EarlyRequest] = {}
        self._watch: threading.Thread | None = None

    def send(self, conn: Any, close: bool) -> str | Partial:
        """gthread's main loop, a connection with something to read: take its request and send it
        to a group if it may be read early (``TAKEN``: the connection is this module's until it
        gives it back). ``CLOSED``: the client closed the connection. A ``Partial``: it may be,
        once the rest of it came. ``close``: gunicorn would close the connection after the answer."""
        if not self.enabled or self.connections is None or self.router.draining or self.router.poison.refused:
            return ""
        sock = conn.sock
        if type(sock) is not socket.socket:
            return ""  # TLS: gunicorn's to read
        try:
            data = sock.recv(PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return Partial(1)  # a new connection whose client has not sent its request yet
        except OSError:
            return ""
        if not data:
            return CLOSED
        request = read_request(data, self.launch.max_payload_bytes)
        if request is None or isinstance(request, Partial):
            return request or ""
        return TAKEN if self._take(conn, close, data, request) else ""

    def _take(self, conn: Any, close: bool, data: bytes, request: ReadRequest) -> bool:
        sock = conn.sock
        try:
            self.router.admit()
        except ServingError:
            return False  # refused by its thread, as any other request
        admitted = time.monotonic()
        try:
            group = self.router.pick()
            request_id = request.header(INFERENCE_ID) or uuid.uuid4().hex
            print_ = fingerprint(f"{request.path}?", request.body)  # as Invocation.run makes it
            invoke = Invoke(
                id=uuid.uuid4().hex,
                properties=request_properties(request.headers, request_id),
                body=request.body,
                path=request.path,
            )
            close = close or request.close
            head = ResponseHead("HTTP/1.1", SERVER, close, {GROUP_HEADER: group.name, INFERENCE_ID: request_id})
            sock.setblocking(True)  # the mode a request thread serves it in, which rank 0's writes keep
            pending = group.submit(
                invoke, tag=(print_, request_id, request.path), client=(sock, True, head), client_required=True
            )
        except ServingError:
            self.router.release()
            return False
        raw = data[: request.size]
        early = EarlyRequest(group, pending, request_id, request.path, print_, admitted, conn, raw, close)
        with self._lock:
            self._sent[sock] = early
            self._lock.notify()
        taken = _consume(sock, request.size)
        pending.watcher = lambda _: self._heard(early)
        if taken != request.size:  # cannot happen with the bytes peeked above; served by a thread if it does
            early.raw = raw[taken:]
            self._hand_to_thread(early)
        elif pending.done or (pending.head is not None and not pending.head.written):
            self._heard(early)  # it ended before the watcher was set
        self.metrics.read_early.inc()
        self._start_watch()
        return True

    def adopt(self, sock: socket.socket | None) -> EarlyRequest | None:
        """The request sent early on ``sock`` (a request thread, once gunicorn read it), which the
        caller follows from here and whose admission it releases; ``None`` if there is none."""
        if sock is None:
            return None
        with self._lock:
            return self._sent.pop(sock, None)

    def abandon_sock(self, sock: socket.socket, why: str) -> bool:
        """``abandon`` the request sent early on ``sock``, if it was not adopted; True if so."""
        with self._lock:
            early = self._sent.get(sock)
            if early is None or early.owner != "thread":
                return False
            del self._sent[sock]
        early.abandon(self.router, why)
        return True

    def _claim(self, early: EarlyRequest, owner: str) -> bool:
        """Make ``owner`` the one that ends ``early`` (once)."""
        with self._lock:
            if early.owner:
                return False
            early.owner = owner
            if owner == "reader":
                self._sent.pop(early.conn.sock, None)
            return True

    def _heard(self, early: EarlyRequest) -> None:
        """The reader thread of the group's connection: the request's head was left to the
        frontend, or it ended (a request already handed to a thread is that thread's)."""
        if not early.pending.clean_end:
            self._hand_to_thread(early)
        elif self._claim(early, "reader"):
            self._finish(early)

    def _hand_to_thread(self, early: EarlyRequest) -> None:
        if self._claim(early, "thread"):
            assert self.connections is not None  # send() took it
            self.connections.requeue(early.conn, early.raw)

    def _finish(self, early: EarlyRequest) -> None:
        """The answer went out whole, written by the group: what its request thread would have
        done after it (the completion line, the metrics, the admission, the connection)."""
        pending = early.pending
        head = pending.head
        assert head is not None  # clean_end: the group wrote the head
        answer = Answer(streamed=True, outcome="completed", bytes=pending.body_bytes)
        if pending.tokens is not None:
            answer.prompt_tokens, answer.completion_tokens = pending.tokens
        if head.started:
            answer.queue_wait = head.started - early.admitted
        exchange = Exchange(early.request_id, "POST", early.path, early.path, early.admitted, answer=answer)
        try:
            self.requests.finish(exchange, head.code, None, pending.head_at)()
        finally:
            self.router.release()
            assert self.connections is not None
            self.connections.let_go(early.conn, not early.close)

    def _start_watch(self) -> None:
        if self._watch is None:
            self._watch = threading.Thread(target=self._watching, name="early-watch", daemon=True)
            self._watch.start()

    def _watching(self) -> None:
        """Every ``CLIENT_CHECK_INTERVAL`` while requests are taken early: hand to a thread those
        whose group said nothing for ``predict_timeout`` or whose client left (the thread
        answers 504 or 499 as for any request)."""
        while True:
            with self._lock:
                self._lock.wait_for(lambda: bool(self._sent))
                watched = [early for early in self._sent.values() if not early.owner]
            now = time.monotonic()
            for early in watched:
                if now >= early.pending.progress_at + self.launch.predict_timeout or client_gone(early.conn.sock):
                    self._hand_to_thread(early)
            time.sleep(CLIENT_CHECK_INTERVAL)


def _consume(sock: socket.socket, size: int) -> int:
    """Read ``size`` bytes already waiting on ``sock``; how many it read."""
    taken = 0
    while taken < size:
        try:
            data = sock.recv(size - taken, socket.MSG_DONTWAIT)
        except OSError:
            break
        if not data:
            break
        taken += len(data)
    return taken
