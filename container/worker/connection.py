"""A connection from the frontend (or the supervisor) to rank 0 of a worker group, and where
the answers of another rank go (nowhere)."""

from __future__ import annotations

import asyncio
import logging

from container.core.protocol import FRAME_HEADER, Fail, Message, ProtocolError, decode, encode, frame_length

log = logging.getLogger("sagelmi.worker")

WRITE_HIGH_WATER = 1 << 16  # bytes buffered towards the frontend before senders wait (then vLLM merges deltas)


class PeerGone(Exception):
    """The frontend's connection closed while an answer was being sent (not an
    error of the handler's: a handler's own ``OSError`` is a 424 like any other)."""


class Connection:
    """One connection from the frontend (or the supervisor) to rank 0.

    Frames are coalesced: everything sent during one pass of the event loop
    (typically one token for each running stream) leaves in a single write,
    instead of one system call per frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.tasks: dict[str, asyncio.Task] = {}
        self._frames: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    async def send(self, message: Message) -> None:
        """Queue ``message``; raises ``PeerGone`` once the connection is closed."""
        if not self._frames:
            # Flush on the loop's next pass, after the other streams woken by the
            # same engine step have queued their frames too.
            self._loop.call_soon(self._loop.call_soon, self._flush)
        self._frames.append(encode(message))
        try:
            if self.writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER:
                await self.writer.drain()  # the frontend reads too slowly: wait for it
        except (ConnectionError, OSError) as exc:
            raise PeerGone(str(exc)) from None
        if self.writer.is_closing():
            raise PeerGone("the connection to the frontend is closed")

    def send_now(self, message: Message) -> None:
        """Write ``message`` (after what is queued) at once, for a process about to exit: the
        transport sends it in this call unless the frontend is behind on reading."""
        self._frames.append(encode(message))
        try:
            self._flush()
        except (ConnectionError, OSError):
            pass

    def _flush(self) -> None:
        frames, self._frames = self._frames, []
        if frames and not self.writer.is_closing():
            self.writer.write(b"".join(frames))

    async def receive(self) -> Message | None:
        try:
            header = await self.reader.readexactly(FRAME_HEADER.size)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise ProtocolError("connection closed in the middle of a frame header") from None
            return None
        return decode(await self.reader.readexactly(frame_length(header)))

    def close(self) -> None:
        self.writer.close()


class DroppedAnswers:
    """Where the answers of a rank other than 0 go: nowhere (rank 0's answer is the group's)."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task] = {}

    async def send(self, message: Message) -> None:
        if isinstance(message, Fail):
            log.warning("this rank's answer was an error (rank 0 answers the client): %s", message.error)

    def close(self) -> None:
        pass
