"""An answer's body written by rank 0 straight to the client's socket: the frontend hands the
socket over once it has sent a stream's HTTP headers (``Attach`` with the socket, on the descriptor
channel; ``container.core.protocol``), or hands over a connection unread, whose request rank 0
reads and answers itself (``container.worker.handoff``), head included.

Tokens do not cross the frontend: a hop through it per token would cost its CPU and wake-ups
that preempt the engine. The frontend wakes at the stream's start and end only.

``DirectBody`` is one answer's body: held until the frontend says where it goes, then
written to the socket without blocking (what the client has not taken waits for the socket
to be writable; past ``WRITE_HIGH_WATER`` the handler's stream waits too), framed as HTTP/1.1
chunks, or raw (a whole body, or a stream to an HTTP/1.0 client). ``DescriptorChannel`` is rank
0's end of the channel.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections.abc import Callable, Collection
from pathlib import Path
from time import monotonic
from typing import Protocol

from container.core.errors import ClientClosedRequest
from container.core.ingress import END_OF_CHUNKS, chunk
from container.core.protocol import Attach, ProtocolError, fd_channel_path, receive_with_fd

log = logging.getLogger("sagelmi.worker")

WRITE_HIGH_WATER = 1 << 16  # bytes not yet taken by the client before the stream waits (vLLM merges deltas)
PROGRESS_INTERVAL = 1.0  # seconds between two progress messages (empty Chunks) of a body written directly

_CREDENTIALS = struct.Struct("3i")  # SO_PEERCRED's pid, uid, gid


def peer_pid(sock: object) -> int:
    """The process at the other end of a Unix socket (0 when it cannot be told)."""
    try:
        pid, _, _ = _CREDENTIALS.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)  # type: ignore[attr-defined]
        )
    except (AttributeError, OSError, struct.error):
        return 0
    return pid


class ClientGone(ClientClosedRequest):
    """The client closed its connection while rank 0 was writing its answer's body (499, like
    a client the frontend found gone)."""


class DirectBody:
    """The body of one streamed answer: ``WAITING`` for the frontend's ``Attach``, then
    ``DIRECT`` (written to the client's socket here) or ``RELAY`` (sent to the frontend as
    Chunks: the connection takes what was held), ``CLOSED`` at the end."""

    WAITING, DIRECT, RELAY, CLOSED = "waiting", "direct", "relay", "closed"

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, on_torn: Callable[[DirectBody], None]) -> None:
        self.id = request_id
        self.loop = loop
        # Told, in the send's own call, when ``torn`` turns true and when it turns false again: the
        # frontend must know before this process can die.
        self.on_torn = on_torn
        self.state = self.WAITING
        self.parts: list[bytes] = []  # body pieces not yet written
        self.pending = 0  # their bytes
        self.backlog = b""  # framed bytes the socket did not take yet
        self.sock: socket.socket | None = None
        self.sock_used = False  # the body went (or goes) to the client's socket from here
        self.preamble = b""  # the HTTP head, written here before the body (Head.written)
        self.chunked = True
        self.sent = 0  # body bytes written (without the chunk framing)
        self.gone = False
        self.last_progress = monotonic()
        self._polling = False  # waiting for the socket to take the backlog
        self._wake: asyncio.Future | None = None

    def open(self, fd: int, chunked: bool, preamble: bytes = b"") -> None:
        """Write to the client's socket ``fd`` (a duplicate this body now owns) from now on,
        ``preamble`` (an HTTP head) first. Its blocking mode is the frontend's too (one open
        file): sends never wait here."""
        self.sock = socket.socket(fileno=fd)
        self.preamble = preamble
        self.sock_used = True
        self.chunked = chunked
        self.state = self.DIRECT
        self._notify()

    def relay(self) -> list[bytes]:
        """The frontend takes the body: what was held goes to it."""
        self.state = self.RELAY
        held, self.parts, self.pending = self.parts, [], 0
        self._notify()
        return held

    def add(self, data: bytes) -> bool:
        """Hold or queue ``data``; True when the stream must ``wait_room`` before the next piece."""
        self.parts.append(data)
        self.pending += len(data)
        return self.gone or self.pending + len(self.backlog) > WRITE_HIGH_WATER

    def write(self, last: bool = False) -> None:
        """Write what is queued (one chunk for all of it), without waiting for the client;
        ``last``: with the chunked body's end after it, in the same write."""
        if self.state != self.DIRECT or self.gone or not (self.parts or last or self.preamble):
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
        if self.state != self.DIRECT or now - self.last_progress < PROGRESS_INTERVAL:
            return False
        self.last_progress = now
        return True

    def _send(self, frame: bytes) -> None:
        assert self.sock is not None  # DIRECT
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
        """Wait until the client has taken enough (and the body is attached); raises
        ``ClientGone`` once the client is gone."""
        self.write()
        await self._until(lambda: self.gone or (self.state != self.WAITING and not self.backlog))
        if self.gone:
            raise ClientGone("the client closed the connection during the stream")

    async def until_attached(self) -> None:
        await self._until(lambda: self.state != self.WAITING)

    async def drain(self) -> None:
        """Write the rest and wait until the client's socket has taken all of it (or the client is gone)."""
        self.write()
        await self._until(lambda: self.gone or not self.backlog)

    def close(self) -> None:
        """Stop writing at once and let go of the socket (the frontend keeps its own)."""
        self._stop_polling()
        self.state = self.CLOSED
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self._notify()


class Attachable(Protocol):
    def attach(self, message: Attach, fd: int | None) -> bool: ...


class DescriptorChannel:
    """Rank 0's end of the descriptor channel (``SOCK_SEQPACKET`` beside its socket at
    ``socket_path``: the frontend hands over clients' sockets there). Each message is an
    ``Attach`` with the client's socket: for the one of ``connections`` whose answer waits for
    it (``Connection.attach``; with none, the descriptor is closed), or, with a ``head``, a
    hand-off: a connection whose request rank 0 reads itself (``on_handoff``, told the process
    that sent it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, socket_path: str, connections: Collection[Attachable]) -> None:
        self.loop = loop
        self.path = path = fd_channel_path(socket_path)
        self.connections = connections
        Path(path).unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(path)
        self.sock.listen(16)
        self.sock.setblocking(False)
        self.peers: dict[socket.socket, int] = {}  # -> the process at its other end
        self.on_handoff: Callable[[Attach, int, int], None] | None = None
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
            elif isinstance(message, Attach) and message.head is not None and self.on_handoff is not None:
                self.on_handoff(message, fd, self.peers.get(peer, 0))
            elif not isinstance(message, Attach) or not any(c.attach(message, fd) for c in list(self.connections)):
                os.close(fd)  # the answer has ended or was cancelled meanwhile: the frontend writes

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
