"""Rank 0's side of HTTP: requests it reads and answers itself, and the bodies it writes to
clients' sockets.

The frontend hands rank 0 a client's connection (an ``Attach`` with a ``head`` and what it read of
the request, ``prefix``, on the descriptor channel) once its next request has a head gunicorn takes
(``ingress.parse_head``) on a handler route: every request of the handler's goes this way.
``Handoffs`` reads the rest (its body within ``body_read_timeout``, at most ``max_body`` bytes),
tells the frontend what it read (``Taken``, unless it saw it whole; a copy of a poison request
among ``Attach.refused`` is refused, 422) and starts it as an ``Invoke``;
``Connection.open_client`` writes its head (any status), ``end`` its end: the route's error where
the handler failed (in band once a stream began), 504 where it was silent for ``predict_timeout``
and nothing where the client left (``sweep``), then one ``End``. A request's state here is one
``ClientRequest`` in one ``Phase``.

``DirectBody`` is one answer's body on the client's socket: written without blocking on the loop's
passes (what the client has not taken waits for the socket to be writable; past
``WRITE_HIGH_WATER`` the handler's stream waits too), as HTTP/1.1 chunks or raw. Tokens do not
cross the frontend: a hop per token would cost its CPU and wake-ups that preempt the engine.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import socket
import uuid
from collections.abc import Callable, Collection
from time import monotonic
from typing import TYPE_CHECKING

import msgspec

from container.core.errors import (
    ClientClosedRequest,
    GatewayTimeout,
    RequestStoppedEngine,
    ServingError,
    body_cut,
    body_late,
    describe,
    error_body,
    in_band_error,
    stopped_engine,
    too_large,
)
from container.core.ingress import (
    END_OF_CHUNKS,
    INFERENCE_ID,
    PEEK_BYTES,
    ChunkedBody,
    RequestHead,
    chunk,
    fingerprint,
    parse_head,
    request_properties,
)
from container.core.protocol import Attach, End, Head, Invoke, ResponseHead, Taken
from container.core.sessions import SESSION_ID

if TYPE_CHECKING:
    from container.worker.connection import Connection

log = logging.getLogger("sagelmi.worker")

SWEEP_INTERVAL = 0.5  # how often requests read here are looked at (predict_timeout, a client gone)
WRITE_HIGH_WATER = 1 << 16  # bytes not yet taken by the client before the stream waits (vLLM merges deltas)
PROGRESS_INTERVAL = 1.0  # seconds between two progress messages (empty Chunks) of a body written directly
READ_BYTES = 1 << 16
_OUTCOMES = ((ClientClosedRequest, "client_gone"), (GatewayTimeout, "timeout"), (RequestStoppedEngine, "refused"))


class ClientGone(ClientClosedRequest):
    """The client closed its connection while rank 0 wrote its answer's body (499, as the frontend's)."""


class DirectBody:
    """The body of one answer rank 0 writes to the client's socket ``fd`` (a duplicate this body owns
    until ``close``), ``preamble`` (its HTTP head) first, as HTTP/1.1 chunks when ``chunked``. The
    socket's blocking mode is the frontend's too (one open file): sends never wait here."""

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        on_torn: Callable[[DirectBody], None],
        fd: int,
        chunked: bool,
        preamble: bytes,
    ) -> None:
        self.id = request_id
        self.loop = loop
        # Told, in the send's own call, when ``torn`` turns true and when it turns false again: the
        # frontend must know before this process can die.
        self.on_torn = on_torn
        self.parts: list[bytes] = []  # body pieces not yet written
        self.pending = 0  # their bytes
        self.backlog = b""  # framed bytes the socket did not take yet
        self.sock: socket.socket | None = socket.socket(fileno=fd)  # None once closed
        self.preamble = preamble  # the HTTP head, written here before the body (Head.written)
        self.chunked = chunked
        self.sent = 0  # body bytes written (without the chunk framing)
        self.gone = False
        self.last_progress = monotonic()
        self._polling = False  # waiting for the socket to take the backlog
        self._wake: asyncio.Future | None = None

    def add(self, data: bytes) -> bool:
        """Hold or queue ``data``; True when the stream must ``wait_room`` before the next piece."""
        self.parts.append(data)
        self.pending += len(data)
        return self.gone or self.pending + len(self.backlog) > WRITE_HIGH_WATER

    def write(self, last: bool = False) -> None:
        """Write what is queued (one chunk for all of it), without waiting for the client;
        ``last``: with the chunked body's end after it, in the same write."""
        if self.sock is None or self.gone or not (self.parts or last or self.preamble):
            return
        data = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
        self.parts, self.pending = [], 0
        self.sent += len(data)
        frame = data
        if self.chunked:
            frame = chunk(data) if data else b""
            if last:
                frame += END_OF_CHUNKS
        if self.preamble:
            frame, self.preamble = self.preamble + frame, b""
        if self.backlog:  # behind what the client has not taken yet
            self.backlog += frame
            return
        self._send(frame)

    def progress_due(self, now: float) -> bool:
        if self.sock is None or now - self.last_progress < PROGRESS_INTERVAL:
            return False
        self.last_progress = now
        return True

    def _send(self, frame: bytes) -> None:
        assert self.sock is not None  # not closed
        try:
            taken = self.sock.send(frame, socket.MSG_DONTWAIT)
        except BlockingIOError:
            taken = 0
        except OSError:
            self._lose()
            return
        if taken < len(frame):
            self.backlog = frame[taken:]
            self.on_torn(self)
            if not self._polling:
                self._polling = True
                self.loop.add_writer(self.sock.fileno(), self._writable)

    def _writable(self) -> None:
        assert self.sock is not None
        try:
            taken = self.sock.send(self.backlog, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            self._lose()
            return
        self.backlog = self.backlog[taken:]
        if not self.backlog:
            self.on_torn(self)
            self._stop_polling()
            self._notify()

    @property
    def torn(self) -> bool:
        """Whether the client's socket may hold part of a frame: a send left some of it waiting here
        (counted from the first send that did not take everything, even one that took nothing)."""
        return bool(self.backlog)

    def _lose(self) -> None:
        self.gone = True
        self.backlog, self.parts, self.pending = b"", [], 0
        self._stop_polling()
        self._notify()

    def _stop_polling(self) -> None:
        if self._polling and self.sock is not None:
            self._polling = False
            self.loop.remove_writer(self.sock.fileno())
            # The loop's poller made the socket non-blocking, for the frontend too: undo that
            os.set_blocking(self.sock.fileno(), True)

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            self._wake = self.loop.create_future()
            await self._wake

    async def wait_room(self) -> None:
        """Wait until the client has taken enough; raises ``ClientGone`` once the client is gone."""
        self.write()
        await self._until(lambda: self.gone or not self.backlog)
        if self.gone:
            raise ClientGone("the client closed the connection during the stream")

    async def drain(self) -> None:
        """Write the rest and wait until the client's socket has taken all of it (or the client is gone)."""
        self.write()
        await self._until(lambda: self.gone or not self.backlog)

    def close(self) -> None:
        """Stop writing at once and let go of the socket (the frontend keeps its own)."""
        self._stop_polling()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self._notify()


class Phase(enum.Enum):
    """Where a request rank 0 reads itself stands; each phase has one owner of the socket."""

    READING = "reading"  # its body is being read (the reader task)
    SERVING = "serving"  # the handler has it; nothing written to the client yet
    WRITING = "writing"  # its head went out; the body follows (the connection's DirectBody)
    ENDED = "ended"  # rank 0 let go of the socket and sent the End


class ClientRequest:
    """One request rank 0 read off a client's connection: its route, the frontend's part of the
    answer's head, its phase, when the handler last produced something (``predict_timeout``
    counts from then) and why rank 0 stopped it, if it did."""

    def __init__(self, attach: Attach, given: ResponseHead, sock: socket.socket, head: RequestHead) -> None:
        self.id = attach.id
        self.sock: socket.socket | None = sock  # until the answer's body takes it (Connection.open_client)
        self.path = head.path
        self.request_id = given.headers.get(INFERENCE_ID) or head.header(INFERENCE_ID) or uuid.uuid4().hex
        self.session = head.header(SESSION_ID)  # the stateful session the request names
        self.trace = attach.trace or None  # the frontend span's W3C headers: the worker's span's parent
        ours, close = {**given.headers, INFERENCE_ID: self.request_id}, given.close or not head.keep_alive
        self.answer_head = ResponseHead(given.version, given.server, close, ours)
        self.phase = Phase.READING
        self.code = 0  # the status written
        self.content_type = ""
        self.chunked = False
        self.stopped: ServingError | None = None
        self.produced = -1  # body bytes produced when last looked at (sweep)
        self.produced_at = monotonic()

    @property
    def close(self) -> bool:
        return self.answer_head.close

    def must_close(self) -> None:
        """The connection closes after this answer (its request was not read to its end ...)."""
        self.answer_head = msgspec.structs.replace(self.answer_head, close=True)

    def take_fd(self) -> int:
        assert self.sock is not None  # taken once, by the answer's body
        fd, self.sock = self.sock.detach(), None
        return fd

    def release(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class Handoffs:
    """Rank 0's side of a hand-off: ``receive`` is the descriptor channel's ``on_handoff``;
    ``start`` serves a request read here (the worker's dispatch of an ``Invoke``)."""

    def __init__(
        self,
        connections: Collection[Connection],
        start: Callable[[Connection, Invoke], None],
        loop: asyncio.AbstractEventLoop,
        body_read_timeout: float,
    ) -> None:
        self.connections = connections
        self.start = start
        self.loop = loop
        self.body_read_timeout = body_read_timeout

    def receive(self, message: Attach, fd: int, pid: int) -> None:
        """A connection handed over by the process ``pid``: answered on that process's
        connection to rank 0; with none, the descriptor is closed unread (the frontend's
        connection dropped: it closes the client's connection)."""
        conn = self._connection(pid)
        if conn is None or message.head is None:
            log.warning("a connection handed over by a process without a connection to this rank: closed unread")
            os.close(fd)
            return
        sock = socket.socket(fileno=fd)
        try:  # the request goes on from what the frontend read of it (the prefix)
            peeked = sock.recv(PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:  # nothing there but the prefix (or the client left already), or the connection broke
            peeked = b""
        head = parse_head(message.prefix + peeked)
        if head is None:
            sock.close()
            conn.queue_end_unanswered(message.id)
            return
        request = ClientRequest(message, message.head, sock, head)
        conn.add_client(request)
        self.loop.create_task(self._read(conn, request, head, message))

    def _connection(self, pid: int) -> Connection | None:
        """The connection from process ``pid`` (of two at once, any: an old one closes soon)."""
        found = [c for c in self.connections if pid and c.peer_pid == pid and not c.writer.is_closing()]
        return found[-1] if found else None

    async def _read(self, conn: Connection, request: ClientRequest, head: RequestHead, attach: Attach) -> None:
        started = monotonic()
        try:
            body = await self._body(request, head, attach.max_body, attach.prefix)
        except (ServingError, OSError) as exc:  # (OSError: the connection broke, the client is gone)
            request.must_close()
            await conn.end_client(request.id, exc if isinstance(exc, ServingError) else ClientClosedRequest())
            return
        if not attach.seen:  # what the frontend must know before the handler can stop the group
            print_ = fingerprint(f"{head.path}?{head.query}", body)
            if (refused_for := attach.refused.get(print_, 0.0) - (monotonic() - started)) > 0:
                await conn.end_client(request.id, stopped_engine(refused_for))  # a poison request's copy: 422
                return
            conn.queue(Taken(request.id, request.request_id, head.path, print_))
        request.phase = Phase.SERVING
        request.produced_at = monotonic()
        properties = request_properties(head.headers, request.request_id, request.trace)
        self.start(conn, Invoke(id=request.id, properties=properties, body=body, path=head.path, query=head.query))

    async def _body(self, request: ClientRequest, head: RequestHead, max_body: int, prefix: bytes) -> bytes:
        """The request's body, read off the socket after ``prefix`` (what the frontend read of the
        request) with the rest of its head (which was peeked); raises the error the client gets for
        a body too large (413: a length past ``max_body`` unread, a chunked body as it passes it),
        late (408), cut short or with malformed chunks (400). Bytes read past the request's end (a
        request sent before the answer) close the connection after the answer: they are gone."""
        sock = request.sock
        assert sock is not None  # READING
        length = head.length or 0
        if length > max_body:
            raise too_large(length, max_body)
        chunks = ChunkedBody(max_body) if head.chunked else None  # its decoder finds a chunked body's end
        announced, wanted = (None, 0) if chunks else (length, head.size + length)
        data, received = bytearray(), len(prefix)
        take = data.extend if chunks is None else chunks.feed
        take(prefix)
        deadline = monotonic() + self.body_read_timeout
        waits = head.version == "1.1" and (head.header("Expect") or "").lower() == "100-continue"
        while received < wanted or (chunks is not None and not chunks.complete):
            try:
                part = sock.recv(min(wanted - received, READ_BYTES) if wanted else READ_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if waits and received >= head.size:
                    waits = False
                    sock.send(b"HTTP/1.1 100 Continue\r\n\r\n", socket.MSG_DONTWAIT)
                if not await self._readable(sock, deadline):
                    raise body_late(announced, self.body_read_timeout) from None
                continue
            if not part:
                raise body_cut(chunks.size if chunks else max(received - head.size, 0), announced)
            received += len(part)
            take(part)
        if chunks.beyond if chunks is not None else received > wanted:
            request.must_close()
        return bytes(data[head.size : wanted]) if chunks is None else chunks.body()

    async def _readable(self, sock: socket.socket, deadline: float) -> bool:
        """Wait until ``sock`` has something to read (or its client closed it); False past ``deadline``."""
        ready, fd = asyncio.Event(), sock.fileno()
        self.loop.add_reader(fd, ready.set)
        try:
            await asyncio.wait_for(ready.wait(), max(deadline - monotonic(), 0))
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self.loop.remove_reader(fd)
            os.set_blocking(fd, True)  # the loop's poller made it non-blocking, for the frontend too


async def end(
    conn: Connection, request: ClientRequest, error: Exception | None, tokens: tuple[int | None, int | None]
) -> None:
    """End ``request``: with ``error``, written to the client as the route's error (whole when
    nothing went out yet, in band after a stream's head, nothing for a client gone or a body that
    cannot take more); then let go of the socket and tell the frontend (``End``)."""
    outcome = "completed"
    error = error or request.stopped  # a handler that answered once stopped (vLLM's servers may) is still stopped
    if error is not None:
        outcome = next((name for kind, name in _OUTCOMES if isinstance(error, kind)), "error")
        gone = outcome == "client_gone"
        if request.phase is Phase.WRITING:
            await _in_band(conn, request, error)
        elif gone or request.sock is None:
            request.must_close()
            request.code = ClientClosedRequest.status
        else:
            body, json_type = error_body(request.path, error), {"Content-Type": "application/json"}
            status = describe(error)[0]
            conn.queue(Head(id=request.id, code=status, headers=json_type, stream=False, written=True))
            await conn.delivered(request.id)  # the frontend knows of the answer before the client gets any of it
            conn.open_client(request.id, status, json_type, len(body))
            conn.add_chunk(request.id, body)
    body_bytes = 0
    stream = conn.bodies.get(request.id)
    if stream is not None:
        if error is None and request.chunked:
            stream.write(last=True)
        await stream.drain()
        stream.close()
        body_bytes = stream.sent
        if stream.gone:
            request.must_close()
            outcome = "client_gone" if outcome == "completed" else outcome
    request.release()
    request.phase = Phase.ENDED
    conn.clients.pop(request.id, None)
    conn.bodies.pop(request.id, None)
    prompt, completion = tokens
    conn.queue(
        End(
            id=request.id,
            prompt_tokens=prompt,
            completion_tokens=completion,
            body_bytes=body_bytes,
            code=request.code,
            outcome=outcome,
            close=request.close,
        )
    )


async def _in_band(conn: Connection, request: ClientRequest, error: Exception) -> None:
    """After the head: the error as the stream's last item, the body's end; else the close."""
    body = conn.bodies.get(request.id)
    if body is None or body.gone or isinstance(error, ClientClosedRequest):
        request.must_close()
        return
    await body.drain()  # the rest of a chunk the client has not taken goes first
    if body.gone:
        request.must_close()
        return
    body.add(in_band_error(request.path, request.content_type, error))
    body.write(last=request.chunked)
    if not request.chunked:
        request.must_close()


def sweep(conn: Connection) -> None:
    """Every ``SWEEP_INTERVAL`` while requests read here are answered: stop those whose handler
    produced nothing for ``predict_timeout`` (504) and those whose client left (499)."""
    now = monotonic()
    for request in list(conn.clients.values()):
        if request.phase not in (Phase.SERVING, Phase.WRITING) or request.stopped is not None:
            continue
        body = conn.bodies.get(request.id)
        produced = body.sent + body.pending if body is not None else -1
        if produced != request.produced:
            request.produced, request.produced_at = produced, now
        elif conn.predict_timeout and now - request.produced_at >= conn.predict_timeout:
            what = "the model sent nothing for" if request.phase is Phase.WRITING else "no answer from the model within"
            request.stopped = GatewayTimeout(f"{what} {conn.predict_timeout:g}s (option.predict_timeout)")
            conn.cancel(request.id)
            continue
        sock = request.sock if request.sock is not None else body.sock if body is not None else None
        if sock is not None and _client_left(sock):
            request.stopped = ClientClosedRequest("the client closed the connection before the answer was ready")
            conn.cancel(request.id)


def _client_left(sock: socket.socket) -> bool:
    """Whether the client closed its connection (one non-blocking peek)."""
    try:
        return not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True
