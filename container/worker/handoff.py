"""Requests rank 0 reads itself: the frontend hands it a client's connection unread
(an ``Attach`` with ``max_body``, on the descriptor channel) when its next request, all there, looks like a
streamed completion, chat or LMI request (``container.core.ingress.may_be_read``).

Rank 0 looks at what the client sent without reading it (``MSG_PEEK``) and takes only what
``read_request`` takes, so that the frontend's gunicorn would read the same bytes the same way.
It then reads the request off the socket, tells the frontend (``Taken``, with the bytes: a
request thread that takes the request over reads them again), and serves it as an ``Invoke``
whose client's socket came with it: its HTTP head and body are written here. Anything else is
a ``Taken`` not ``served``, with nothing read, and the frontend serves it as any other request.

Why: the frontend's reading of the request, before its group has it, would be on the path to
the first token.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable, Collection

from container.core.ingress import INFERENCE_ID, PEEK_BYTES, ReadRequest, read_request, request_properties
from container.core.protocol import Attach, Invoke, ResponseHead, Taken
from container.worker.connection import Connection

log = logging.getLogger("sagelmi.worker")

TAKEN_LATEST = 0.25  # seconds a Taken waits for other frames to leave with, at most


class Handoffs:
    """Rank 0's side of a hand-off: ``receive`` is the descriptor channel's ``on_handoff``;
    ``start`` serves a request read here (the worker's dispatch of an ``Invoke``), while the
    group is ``ready``."""

    def __init__(
        self,
        connections: Collection[Connection],
        start: Callable[[Connection, Invoke], None],
        ready: Callable[[], bool],
    ) -> None:
        self.connections = connections
        self.start = start
        self.ready = ready

    def receive(self, message: Attach, fd: int, pid: int) -> None:
        """A connection handed over by the process ``pid``: answered on that process's
        connection to rank 0; with none, the descriptor is closed unread (the frontend's
        connection dropped: it serves the request again itself)."""
        conn = self._connection(pid)
        if conn is None:
            log.warning("a connection handed over by a process without a connection to this rank: closed unread")
            os.close(fd)
            return
        sock = socket.socket(fileno=fd)
        try:
            read = self._read(sock, message.max_body)
        except OSError:  # the client's connection broke: the frontend finds it so
            read = None
        given = message.head  # a hand-off always comes with one
        if not isinstance(read, tuple) or given is None:
            sock.close()
            conn.queue(Taken(id=message.id, served=False, raw=read if isinstance(read, bytes) else b""))
            return
        raw, request = read
        request_id = request.header(INFERENCE_ID) or uuid.uuid4().hex
        close = given.close or request.close
        head = ResponseHead(given.version, given.server, close, {**given.headers, INFERENCE_ID: request_id})
        invoke = Invoke(
            id=message.id,
            properties=request_properties(request.headers, request_id),
            body=request.body,
            path=request.path,
        )
        # With the request's Head (or anything written sooner): the frontend is not woken for it
        # during the engine's first step; it needs it only for what follows the Head
        taken = Taken(id=message.id, served=True, request_id=request_id, path=request.path, raw=raw, close=close)
        conn.queue_quietly(taken, TAKEN_LATEST)
        conn.give_client(Attach(id=message.id, direct=True, chunked=True, head=head), sock.detach())
        self.start(conn, invoke)

    def _connection(self, pid: int) -> Connection | None:
        found = None
        for conn in self.connections:
            if pid and conn.peer_pid == pid and not conn.writer.is_closing():
                found = conn  # a set: any of two at once (an old one closes soon)
        return found

    def _read(self, sock: socket.socket, max_body: int) -> tuple[bytes, ReadRequest] | bytes | None:
        """The request, read off ``sock``, and its bytes, if rank 0 may take it; ``None`` (nothing
        read) if not. Bytes alone: what was read of a request the socket then gave less of than
        it had shown (which cannot happen)."""
        try:
            data = sock.recv(PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        request = read_request(data, max_body) if data and self.ready() else None
        if not isinstance(request, ReadRequest):
            return None
        raw = data[: request.size]
        read = _consume(sock, request.size)
        return (raw, request) if read == request.size else raw[:read]


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
