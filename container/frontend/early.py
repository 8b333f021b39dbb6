"""Streamed requests whose connection gthread's main loop hands to their worker group unread,
followed by no request thread (``container.worker.handoff`` reads them on rank 0).

For a connection whose next request may be read early (its first bytes: ``may_be_read``), the
main loop admits it, picks the group and hands it the client's socket with nothing read
(``GroupClient.hand_off``). No thread is woken for it. Rank 0 answers ``Taken``: ``served`` (it read the
request and serves it, writing the HTTP head and the body itself) or not (it read
nothing: the connection goes to a request thread as any other). When the group says the answer
went out whole (an ending ``End``, then the last), the reader thread of the group's connection writes
the completion line, releases the admission and gives the connection back to the main loop
(kept alive, or closed).

Anything else hands the request to a request thread, which reads the bytes rank 0 read with
gunicorn (they are put back in front of the connection) and follows the request as its own
(``adopt``, by its socket; ``Invocation``): a head the group left to the frontend, an error,
the group's loss, ``predict_timeout`` without a word from the group, a client found gone by
the watch (``CLIENT_CHECK_INTERVAL``). The thread then does what it does for any request
(the error in the route's envelope, an in-band error, 504, 499 ...), with the same timeouts,
counted from the group's last message. A request gunicorn reads otherwise than rank 0 did
(another route, another body) is stopped in its group and its connection closed without an
answer (``abandon``). A group lost before it said it read the request gives the connection
back to the server if the request is still on it, else closes it. Nothing is handed over while
draining, with tracing on, while copies of some request are refused as poisonous, or when
admission or routing would refuse it: a thread then serves and refuses it as before.

Why: a request thread per request costs the frontend CPU, and reading the request before its
group has it adds to the time to the first token (docs/benchmarks/ measures both).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from gunicorn import SERVER

from container.core.errors import ServingError
from container.core.ingress import GROUP_HEADER, Partial, may_be_read
from container.core.launch import FrontendLaunch
from container.core.protocol import ResponseHead, Taken
from container.frontend.client import CLIENT_CHECK_INTERVAL, client_gone, client_waiting
from container.frontend.completion import Answer, Exchange, RequestLog
from container.frontend.group_client import GroupClient
from container.frontend.pending import PendingRequest
from container.frontend.poison import fingerprint
from container.frontend.router import Router

log = logging.getLogger("sagelmi.frontend")


class Owner(Enum):
    """Who ends a request taken early: nobody yet (``TAKEN``, the connection is this module's), the
    group connection's reader thread at a clean end, a request thread (which adopts it by its socket),
    or the server again when rank 0 did not read it (``SERVER``: also ``send``'s answer for a
    connection it did not take)."""

    TAKEN = "taken"
    READER = "reader"
    THREAD = "thread"
    SERVER = "server"


class Connections(Protocol):
    """The HTTP server's side (gthread's main loop, ``container.frontend.server``); both are
    called from any thread and run on the main loop."""

    def requeue(self, conn: Any, raw: bytes) -> None:
        """Serve the connection with a request thread, ``raw`` (the request) read first."""

    def let_go(self, conn: Any, keep: bool) -> None:
        """The connection is the server's again: kept alive for its next request, or closed."""


@dataclass
class EarlyRequest:
    """A request taken early: its group and answers, when the frontend admitted it, its
    connection, whether the connection closes after it, and who ends it (``owner``, set once).
    What rank 0 read (``Taken``): its id, route, bytes on the wire and fingerprint."""

    group: GroupClient
    admitted: float
    conn: Any
    close: bool
    pending: PendingRequest = field(init=False)
    request_id: str = ""
    path: str = ""  # "" until rank 0 said it read the request
    print_: str = ""
    raw: bytes = b""
    owner: Owner = Owner.TAKEN

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

    def send(self, conn: Any, close: bool, data: bytes) -> Owner | Partial:
        """gthread's main loop, a connection whose next request's head is there (``data``, peeked):
        hand it to a group unread if that request may be read early (``TAKEN``: the connection is
        this module's until it gives it back; ``SERVER``: it is not). A ``Partial``: it may be, once
        the rest of its body came. ``close``: gunicorn would close the connection after the answer."""
        if not self.enabled or self.connections is None or self.router.draining or self.router.poison.refused:
            return Owner.SERVER
        if type(conn.sock) is not socket.socket:
            return Owner.SERVER  # TLS: gunicorn's to read
        readable = may_be_read(data)
        if isinstance(readable, Partial):
            return readable
        return Owner.TAKEN if readable and self._hand_off(conn, close) else Owner.SERVER

    def _hand_off(self, conn: Any, close: bool) -> bool:
        sock = conn.sock
        try:
            self.router.admit()
        except ServingError:
            return False  # refused by its thread, as any other request
        try:
            group = self.router.pick()
        except ServingError:
            self.router.release()
            return False
        early = EarlyRequest(group, time.monotonic(), conn, close)
        with self._lock:
            self._sent[sock] = early
            self._lock.notify()
        head = ResponseHead("HTTP/1.1", SERVER, close, {GROUP_HEADER: group.name})
        sock.setblocking(True)  # the mode a request thread serves it in, which rank 0's writes keep
        try:
            pending = group.hand_off(
                sock, head, self.launch.max_payload_bytes, lambda pending: self._heard(early, pending)
            )
        except ServingError:
            with self._lock:
                self._sent.pop(sock, None)
            self.router.release()
            return False
        early.pending = pending
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
            if early is None or early.owner is not Owner.THREAD:
                return False
            del self._sent[sock]
        early.abandon(self.router, why)
        return True

    def _claim(self, early: EarlyRequest, owner: Owner) -> bool:
        """Make ``owner`` the one that ends ``early`` (once)."""
        with self._lock:
            if early.owner is not Owner.TAKEN:
                return False
            early.owner = owner
            if owner is not Owner.THREAD:  # a request thread adopts it (by its socket)
                self._sent.pop(early.conn.sock, None)
            return True

    def _heard(self, early: EarlyRequest, pending: PendingRequest) -> None:
        """The reader thread of the group's connection: rank 0 read the request or declined it,
        the request's head was left to the frontend, or it ended (a request already handed to a
        thread is that thread's)."""
        early.pending = pending
        if pending.declined is not None:
            self._give_back(early, pending.declined.raw)
            return
        if pending.taken is not None and not early.path:
            self._read(early, pending.taken)
        if not pending.done and (pending.head is None or pending.head.written):
            return
        if not early.path:  # the group went away before it said it read the request
            self._give_back(early, None)
        elif not pending.clean_end:
            self._hand_to_thread(early)
        elif self._claim(early, Owner.READER):
            self._finish(early)

    def _read(self, early: EarlyRequest, taken: Taken) -> None:
        """What the frontend keeps of a request rank 0 read: what its fallback and its completion
        line need (its bytes are read again by a request thread that takes it over)."""
        early.request_id, early.raw, early.close = taken.request_id, taken.raw, taken.close
        body = taken.raw[taken.raw.find(b"\r\n\r\n") + 4 :]
        early.print_ = fingerprint(f"{taken.path}?", body)  # as Invocation.run makes it
        early.pending.tag = (early.print_, taken.request_id, taken.path)
        early.path = taken.path
        self.metrics.read_early.inc()

    def _give_back(self, early: EarlyRequest, raw: bytes | None) -> None:
        """The request is the server's again, as if it had never been taken: a request thread
        reads it, after ``raw`` (what rank 0 read of it). ``None``: nobody knows what rank 0 read;
        the connection is served again only if the client's bytes are still there, else closed."""
        if not self._claim(early, Owner.SERVER):
            return
        self.router.release()
        assert self.connections is not None  # send() took it
        if raw is None and not client_waiting(early.conn.sock):
            log.error("a connection handed to worker group %s, which went away: closing it", early.group.name)
            self.connections.let_go(early.conn, False)
        else:
            self.connections.requeue(early.conn, raw or b"")

    def _hand_to_thread(self, early: EarlyRequest) -> None:
        if self._claim(early, Owner.THREAD):
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
                watched = [early for early in self._sent.values() if early.owner is Owner.TAKEN and early.path]
            now = time.monotonic()
            for early in watched:
                if now >= early.pending.progress_at + self.launch.predict_timeout or client_gone(early.conn.sock):
                    self._hand_to_thread(early)
            time.sleep(CLIENT_CHECK_INTERVAL)
