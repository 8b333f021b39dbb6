"""A connection from the frontend (or the supervisor) to rank 0 of a worker group, and where
the answers of another rank go (nowhere)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from time import monotonic

from container.core.errors import ClientClosedRequest
from container.core.ingress import framing, response_head
from container.core.protocol import (
    FRAME_HEADER,
    Attach,
    Chunk,
    End,
    Head,
    Message,
    ProtocolError,
    decode,
    encode,
    fd_channel_path,
    frame_length,
    peer_pid,
    progress,
    receive_with_fd,
)
from container.core.sessions import SESSION_HEADERS, answer_sessions, changes_sessions
from container.worker.handoff import SWEEP_INTERVAL, WRITE_HIGH_WATER, ClientRequest, DirectBody, Phase, end, sweep

log = logging.getLogger("sagelmi.worker")

COALESCE_BYTES = 1 << 14  # a write leaves once this much is queued, even while the loop keeps adding to it
COALESCE_SECONDS = 0.0002  # ... or once its first frame has been queued this long (checked between loop passes)


class _Body:
    """The body bytes of one request queued since the last write: they leave as one ``Chunk``."""

    __slots__ = ("id", "parts")

    def __init__(self, request_id: str, data: bytes) -> None:
        self.id = request_id
        self.parts = [data]

    def frame(self) -> bytes:
        return encode(Chunk(id=self.id, data=self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)))


class PeerGone(Exception):
    """The frontend's connection closed while an answer was being sent (not an
    error of the handler's: a handler's own ``OSError`` is a 424 like any other)."""


class Connection:
    """One connection from the frontend (or the supervisor) to rank 0.

    Frames are coalesced without waiting: what is sent while the loop is busy leaves in one
    write, once a pass of the loop queued nothing more (typically one token for each running
    stream: the pass after an engine step's), or once ``COALESCE_BYTES`` are queued, or once
    the first queued frame is ``COALESCE_SECONDS`` old (a loop that keeps producing, as a
    handler streaming faster than its client reads). A lone token on an idle loop leaves two
    passes after it was sent. The bodies written to clients' sockets (``bodies``:
    ``container.worker.handoff.DirectBody``) are written on the same passes.

    A request rank 0 read itself (``clients``, ``container.worker.handoff``) has its whole answer
    written here: its ``Head`` (``written``) leaves at once, before the client gets anything
    (``delivered``, ``open_client``), its ``End`` once the socket is let go (``end_client``). The
    answers of the frontend's own requests (``/metrics``) go to it as Chunks."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.tasks: dict[str, asyncio.Task] = {}
        self._loop = asyncio.get_running_loop()
        self.clients: dict[str, ClientRequest] = {}  # requests read here, answered here (handoff)
        self._routing: dict[str, asyncio.Future] = {}  # answers opening or closing a session: the frontend's go
        self.predict_timeout = 0.0  # set by the worker: a handler silent this long has its request stopped
        self.sessions_expiration: float | None = None  # set by the worker when stateful sessions are on
        # Set by the worker: stops a request as the frontend's Cancel does (relayed to an MPI group's
        # other ranks), for one rank 0 stops itself
        self.cancel: Callable[[str], None] = lambda request_id: None
        self._sweeping = False
        self._scheduled = False  # a pass is scheduled (_pass): one at a time
        self.bodies: dict[str, DirectBody] = {}  # streamed answers not relayed to the frontend
        self._touched: list[DirectBody] = []  # bodies with pieces for the next write
        self._queue: list[bytes | _Body] = []  # frames, and bodies still open to more chunks
        self._quiet: list[bytes] = []  # frames that leave first with the next write (queue_quietly)
        self._open: dict[str, _Body] = {}  # request id -> its body, while it is its last queued message
        self._queued = 0  # bytes queued (about)
        self._added = False  # a frame was queued since the last pass
        self._due = 0.0  # when the queue leaves at the latest: its first frame's time + COALESCE_SECONDS
        self._call_soon = self._loop.call_soon
        self._pass_soon = self._pass  # bound once: it is scheduled once a loop pass
        self.peer_pid = peer_pid(writer.get_extra_info("socket"))  # the process at the other end

    async def send(self, message: Message) -> None:
        """Queue ``message``; raises ``PeerGone`` once the connection is closed."""
        if type(message) is Chunk:
            if self.add_chunk(message.id, message.data):
                await self.wait_writable()
            return
        self.queue(message)
        if self.writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER or self.writer.is_closing():
            await self.wait_writable()

    def queue(self, message: Message) -> None:
        """Queue ``message`` (not a ``Chunk`` of body bytes: ``add_chunk``) without waiting for the frontend to read."""
        self._wake()
        request_id = getattr(message, "id", None)
        if request_id is not None:
            self._open.pop(request_id, None)
        frame = encode(message)
        self._queue.append(frame)
        self._queued += len(frame)
        if (type(message) is Head and (message.stream or message.written)) or (
            type(message) is End and message.outcome
        ):
            # an answer's head (its client's bytes wait for it: delivered) or end, at once
            self._write_frames()

    def queue_quietly(self, message: Message, latest: float) -> None:
        """Queue ``message`` to leave with the next frames written, within ``latest`` seconds at the
        latest: it wakes the frontend no sooner than something else does."""
        self._quiet.append(encode(message))  # apart: a queue holding only these schedules no pass
        self._loop.call_later(latest, self._write_quiet)

    def _write_quiet(self) -> None:
        if self._quiet:  # nothing left with other frames meanwhile
            self._write_frames()

    def add_chunk(self, request_id: str, data: bytes) -> bool:
        """Queue a piece of request ``request_id``'s body, merged with the piece queued
        right before it, without a coroutine or a ``Chunk`` per token (a stream's items
        come here: ``Calls.send_output``). True when the caller must ``wait_writable``
        before the next one: the frontend (or the client) reads too slowly, or the
        connection closed."""
        body = self.bodies.get(request_id)
        if body is not None:
            if not body.parts:
                self._touch(body)
            self._added = True
            self._queued += len(data)
            return body.add(data)
        return self._relay_chunk(request_id, data)

    def _wake(self) -> None:
        """Something was queued: the write is due ``COALESCE_SECONDS`` after the first of it, and one
        pass of the loop (one, whoever queued) looks at it."""
        if not self._queue and not self._touched:
            self._due = monotonic() + COALESCE_SECONDS  # not loop.time(): uvloop's counts whole milliseconds
        if not self._scheduled:
            self._scheduled = True
            self._call_soon(self._pass_soon)
        self._added = True

    def _touch(self, body: DirectBody) -> None:
        self._wake()
        self._touched.append(body)  # (twice at a stream's start: its second write finds nothing)

    def _relay_chunk(self, request_id: str, data: bytes) -> bool:
        self._wake()
        body = self._open.get(request_id)
        if body is not None:
            body.parts.append(data)
        else:
            self._open[request_id] = body = _Body(request_id, data)
            self._queue.append(body)
        self._queued += len(data)
        return self.writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER or self.writer.is_closing()

    # -- answers written to the client here
    def has_client(self, request_id: str) -> bool:
        return request_id in self.clients

    def add_client(self, request: ClientRequest) -> None:
        self.clients[request.id] = request
        self._schedule_sweep()

    def stop_reason(self, request_id: str) -> Exception | None:
        """Why request ``request_id``, read here, was stopped (``handoff.sweep``: a timeout, its client
        gone; else the worker stopping); ``None`` for a request of the frontend's."""
        request = self.clients.get(request_id)
        if request is None:
            return None
        return request.stopped or ClientClosedRequest("cancelled")

    def stopped(self, request_id: str) -> Exception | None:
        """Why rank 0 stopped request ``request_id``, read here, itself (``handoff.sweep``), if it did."""
        request = self.clients.get(request_id)
        return request.stopped if request is not None else None

    async def delivered(self, request_id: str) -> None:
        """Wait until the ``Head`` of request ``request_id``, read here, has left for the frontend:
        before the client gets anything, the frontend must know of the answer; of one that opens
        or closes a session (``answer_headers``) also its routing, which says so (an ``Attach``
        without a descriptor). Raises ``PeerGone`` once the connection is closed. uvloop sends
        what a pass wrote at the pass's end: one pass is the usual wait."""
        routed = self._routing.get(request_id)
        if routed is not None:
            try:
                await routed
            finally:
                self._routing.pop(request_id, None)
            return
        passes = 0
        while self.writer.transport.get_write_buffer_size():
            if self.writer.is_closing():
                raise PeerGone("the connection to the frontend is closed")
            passes += 1
            await asyncio.sleep(0 if passes < 8 else 0.001)  # a frontend that reads slowly: no spinning

    def answer_headers(self, request_id: str, code: int, headers: dict[str, str]) -> dict[str, str]:
        """The headers of an answer written here, with SageMaker's session headers where the
        handler opened or closed a session in LMI's or DJL's form only (as the frontend completes
        them; it learns the session from the ``Head``). An answer that opens or closes one is
        ``held``: it waits in ``delivered`` for the frontend's routing to know it."""
        if any(name.lower() in SESSION_HEADERS for name in headers):
            if self.sessions_expiration is not None and code < 300:
                headers = answer_sessions(self.clients[request_id].session, headers, self.sessions_expiration)[0]
            if changes_sessions(headers):
                self._routing[request_id] = self._loop.create_future()
        return headers

    def held(self, request_id: str) -> bool:
        """Whether the answer of request ``request_id`` waits for the frontend's routing (``answer_headers``)."""
        return request_id in self._routing

    def open_client(self, request_id: str, code: int, headers: Mapping[str, str], length: int | None) -> None:
        """Start writing the answer of request ``request_id``, read here: its HTTP head (``code``, the
        handler's ``headers``; ``length``: a whole body's, ``None``: a stream) goes to the client on
        the next pass, after the ``Head`` the caller sent. Its body follows (``add_chunk``)."""
        request = self.clients[request_id]
        content_type = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
        request.code, request.content_type, request.phase = code, content_type, Phase.WRITING
        request.chunked = framing(request.answer_head, length is not None)[0]
        preamble = response_head(request.answer_head, code, headers, length)
        self.bodies[request_id] = body = DirectBody(
            request_id, self._loop, self._torn, request.take_fd(), request.chunked, preamble
        )
        self._touch(body)

    async def end_client(
        self, request_id: str, error: Exception | None = None, tokens: tuple[int | None, int | None] = (None, None)
    ) -> None:
        """End request ``request_id``, read here (``container.worker.handoff.end``)."""
        request = self.clients.get(request_id)
        if request is not None and request.phase is not Phase.ENDED:
            await end(self, request, error, tokens)

    def queue_end_unanswered(self, request_id: str) -> None:
        """A hand-off rank 0 could not read: the frontend closes the connection."""
        self.queue(End(id=request_id, close=True, outcome="error"))

    def release_client(self, request_id: str) -> bool:
        """A request read here, stopped before its answer (its batch was cancelled): the client's
        connection is closed; True if there was one."""
        if request_id not in self.clients:
            return False
        self._loop.create_task(self.end_client(request_id, ClientClosedRequest("cancelled")))
        return True

    def _sweep(self) -> None:
        self._sweeping = False
        sweep(self)
        self._schedule_sweep()

    def _schedule_sweep(self) -> None:
        if self.clients and not self._sweeping:
            self._sweeping = True
            self._loop.call_later(SWEEP_INTERVAL, self._sweep)

    def attach(self, message: Attach) -> None:
        """The frontend's routing knows the session an answer opens or closes (``delivered``)."""
        routed = self._routing.get(message.id)
        if routed is not None and not routed.done():
            routed.set_result(None)

    def drop_client(self, request_id: str) -> None:
        """Forget a request read here once it is over; one that was not ended (its connection to
        the frontend broke) stops writing and lets go of the client's socket."""
        request = self.clients.pop(request_id, None)
        if request is not None:
            request.release()
        body = self.bodies.pop(request_id, None)
        if body is not None:
            body.close()

    async def wait_writable(self, request_id: str | None = None) -> None:
        """Wait until the frontend (or, for a body written here, the client) has read enough;
        raises ``PeerGone`` once the connection is closed, ``ClientGone`` once the client is."""
        body = self.bodies.get(request_id) if request_id is not None else None
        if body is not None:
            await body.wait_room()
            return
        try:
            await self.writer.drain()
        except (ConnectionError, OSError) as exc:
            raise PeerGone(str(exc)) from None
        if self.writer.is_closing():
            raise PeerGone("the connection to the frontend is closed")

    def _pass(self) -> None:
        """Between two passes of the loop: write, unless the last pass queued more and
        the queue is still small and young."""
        if self._added and self._queued < COALESCE_BYTES and monotonic() < self._due:
            self._added = False
            self._call_soon(self._pass_soon)
            return
        self._scheduled = False
        self._flush()

    def send_now(self, message: Message) -> None:
        """Write ``message`` (after what is queued) at once, for a process about to exit: the
        transport sends it in this call unless the frontend is behind on reading."""
        self._queue.append(encode(message))
        try:
            self._flush()
        except (ConnectionError, OSError):
            pass

    def _write_frames(self) -> None:
        """Write the frames queued for the frontend, in order, and leave the bodies written to
        clients here for the pass: the other streams' pieces keep coalescing (each write of a
        stream's body is a send of its own; a stream starting or ending every few passes, as
        at 64 streams of a fast handler, otherwise split every stream's writes)."""
        queue, self._queue = self._queue, []
        if self._quiet:  # each the first frame of its request: ahead of the others' frames is in order
            queue[:0], self._quiet = self._quiet, []
        self._open.clear()
        if queue and not self.writer.is_closing():
            data = b"".join(item if isinstance(item, bytes) else item.frame() for item in queue)
            self._queued = max(0, self._queued - len(data))
            self.writer.write(data)

    def _torn(self, body: DirectBody) -> None:
        """A body's socket holds part of an HTTP chunk (or whole frames again): the frontend hears of
        a tear in this call, before anything else can happen to this process."""
        self.queue(progress(body.id, body.torn))
        if body.torn:
            self._write_frames()

    def _flush(self) -> None:
        if self._touched:
            touched, self._touched = self._touched, []
            now = monotonic()
            for body in touched:
                body.write()
                if body.progress_due(now):
                    self._queue.append(encode(progress(body.id, body.torn)))
        self._write_frames()
        self._queued = 0
        self._added = False

    async def receive(self) -> Message | None:
        try:
            header = await self.reader.readexactly(FRAME_HEADER.size)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise ProtocolError("connection closed in the middle of a frame header") from None
            return None
        return decode(await self.reader.readexactly(frame_length(header)))

    def close(self) -> None:
        for routed in self._routing.values():
            if not routed.done():
                routed.set_exception(PeerGone("the connection to the frontend is closed"))
        for request_id in list(self.bodies) + list(self.clients):
            self.drop_client(request_id)
        self.writer.close()


class DescriptorChannel:
    """Rank 0's end of the descriptor channel (``SOCK_SEQPACKET`` beside its socket at
    ``socket_path``: the frontend hands over clients' sockets there). Each message is an
    ``Attach`` with a ``head`` and the client's socket, whose next request rank 0 reads itself
    (``on_handoff``, told the process that sent it)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, socket_path: str, on_handoff: Callable[[Attach, int, int], None]
    ) -> None:
        self.loop = loop
        self.path = path = fd_channel_path(socket_path)
        Path(path).unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(path)
        self.sock.listen(16)
        self.sock.setblocking(False)
        self.peers: dict[socket.socket, int] = {}  # -> the process at its other end
        self.on_handoff = on_handoff
        loop.add_reader(self.sock.fileno(), self._accept)

    def _accept(self) -> None:
        while True:
            try:
                peer, _ = self.sock.accept()
            except BlockingIOError:
                return
            peer.setblocking(False)
            self.peers[peer] = peer_pid(peer)
            self.loop.add_reader(peer.fileno(), self._read, peer)

    def _read(self, peer: socket.socket) -> None:
        while True:
            try:
                received = receive_with_fd(peer)
            except BlockingIOError:
                return
            except (OSError, ProtocolError) as exc:
                log.error("closing a descriptor channel that failed: %s", exc)
                received = None
            if received is None:
                self._drop(peer)
                return
            message, fd = received
            if fd is None:
                log.warning("ignoring a descriptor-channel message without a descriptor")
            elif isinstance(message, Attach) and message.head is not None:
                self.on_handoff(message, fd, self.peers.get(peer, 0))
            else:
                log.warning("closing a descriptor sent without a request head")
                os.close(fd)

    def _drop(self, peer: socket.socket) -> None:
        self.loop.remove_reader(peer.fileno())
        self.peers.pop(peer, None)
        peer.close()

    def close(self) -> None:
        for peer in list(self.peers):
            self._drop(peer)
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        Path(self.path).unlink(missing_ok=True)
