"""A streamed answer's body written by rank 0 to the client's socket (container/worker/handoff.py:
DirectBody, Connection.open_client), over real sockets on uvloop: the frontend's connection is a
socket pair, the client's a TCP connection on loopback, the descriptor handed over as the
frontend does (send_with_fd on the descriptor channel)."""

import asyncio
import os
import socket

import pytest
import uvloop

from container.core.ingress import RequestHead
from container.core.protocol import Attach, Chunk, End, FrameBuffer, Head, ResponseHead, progress, send_with_fd
from container.worker import handoff as direct
from container.worker.connection import Connection, DescriptorChannel
from container.worker.handoff import ClientGone, ClientRequest


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%X\r\n%s\r\n" % (len(p), p) for p in pieces)


class Sides:
    """The worker's Connection, what reached the frontend, and the client's socket."""

    def __init__(self, conn: Connection, frontend: socket.socket, server: socket.socket, client: socket.socket):
        self.conn = conn
        self.frontend = frontend
        self.server = server  # the frontend's end of the client's connection (gunicorn's socket)
        self.client = client
        self.frames = FrameBuffer()
        self.head = b""  # the answer's HTTP head, once it came (to_client gives what follows it)

    def to_frontend(self) -> list:
        messages = []
        while True:
            try:
                data = self.frontend.recv(1 << 20)
            except BlockingIOError:
                return messages
            messages += self.frames.feed(data)

    def to_client(self) -> bytes:
        """What reached the client since the last look, after the answer's HTTP head."""
        got = b""
        while True:
            try:
                data = self.client.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            if not data:
                break
            got += data
        if not self.head.endswith(b"\r\n\r\n"):
            head, end, got = (self.head + got).partition(b"\r\n\r\n")
            self.head = head + end
        return got


def run(scenario):
    async def main():
        ours, frontend = socket.socketpair()
        frontend.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=ours)
        listener = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        listener.close()
        sides = Sides(Connection(reader, writer), frontend, server, client)
        try:
            return await scenario(sides)
        finally:
            writer.close()
            for sock in (frontend, server, client):
                sock.close()

    return uvloop.run(main())


async def started(sides: Sides, request_id: str = "r", version: str = "1.1") -> None:
    """A stream's start as rank 0 makes it for a request it read: its Head sent, then its HTTP head
    and body opened on the client's socket."""
    given = ResponseHead(f"HTTP/{version}", "gunicorn", False, {"X-Amzn-SageMaker-Inference-Id": request_id})
    head = RequestHead("POST", "/invocations", "", version, [], 0, False, True, 0)
    request = ClientRequest(Attach(id=request_id, head=given), given, socket.socket(fileno=os.dup(sides.server.fileno())), head)
    sides.conn.add_client(request)
    await sides.conn.send(Head(id=request_id, code=200, headers={}, stream=True, written=True))
    sides.conn.open_client(request_id, 200, {}, None)


async def passes(count: int = 3) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def test_the_body_goes_to_the_client_as_http_chunks_after_its_head_and_never_to_the_frontend():
    async def scenario(sides: Sides):
        conn = sides.conn
        await started(sides)
        assert not conn.add_chunk("r", b"one ")
        conn.add_chunk("r", b"two ")
        conn.add_chunk("r", b"three")
        await passes()
        written = sides.to_client()
        await conn.end_client("r", None, (1, 3))
        await passes()
        return written, sides.to_client(), sides.head, sides.to_frontend()

    written, ending, head, frontend = run(scenario)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Transfer-Encoding: chunked\r\n" in head
    assert written == chunked(b"one two three")  # what this pass added: one chunk
    assert ending == b"0\r\n\r\n"
    end = End(id="r", prompt_tokens=1, completion_tokens=3, body_bytes=13, code=200, outcome="completed")
    assert frontend == [Head(id="r", code=200, headers={}, stream=True, written=True), end]


def test_another_streams_head_or_end_leaves_at_once_without_writing_a_running_streams_pieces():
    """A stream's Head and End leave at once; the pieces another stream queued this pass stay
    for the pass, so they keep coalescing into one write to that stream's client (writing them
    on every other stream's start and end halved the relay's items/s at 64 streams)."""

    async def scenario(sides: Sides):
        conn = sides.conn
        await started(sides)
        await passes()
        sides.to_client()  # the head
        conn.add_chunk("r", b"one ")
        await conn.send(Head(id="s", code=200, headers={}, stream=True, written=True))
        conn.add_chunk("r", b"two ")
        await conn.send(End(id="t", code=200, outcome="completed"))
        conn.add_chunk("r", b"three")
        at_once = sides.to_frontend(), sides.to_client()
        await passes()
        return at_once, sides.to_client()

    (frontend, client_at_once), client_later = run(scenario)
    assert frontend == [
        Head(id="r", code=200, headers={}, stream=True, written=True),
        Head(id="s", code=200, headers={}, stream=True, written=True),
        End(id="t", code=200, outcome="completed"),
    ]
    assert client_at_once == b""
    assert client_later == chunked(b"one two three")  # one write for the pass


def test_one_pass_at_a_time_looks_at_what_was_queued_whatever_queued_it():
    """A Head that leaves at once, then a body opened and its pieces added, schedule one pass of
    the loop, not one each: two chains of passes each flush what the other just let coalesce,
    a write per piece (the relay at 1 stream ran at a third of its items/s so)."""

    async def scenario(sides: Sides):
        conn = sides.conn
        scheduled = []
        call_soon = conn._call_soon
        conn._call_soon = lambda callback, *args: (scheduled.append(callback), call_soon(callback, *args))
        await started(sides)  # its Head leaves at once, its HTTP head waits for the pass
        for piece in (b"one ", b"two ", b"three"):
            conn.add_chunk("r", piece)
        first = len(scheduled)
        await passes()
        return first, sides.to_client()

    first, client = run(scenario)
    assert first == 1
    assert client == chunked(b"one two three")  # one write for the pass


def test_an_http_1_0_client_gets_the_raw_body():
    async def scenario(sides: Sides):
        await started(sides, version="1.0")
        sides.conn.add_chunk("r", b"raw bytes")
        await sides.conn.end_client("r")
        return sides.to_client(), sides.head

    body, head = run(scenario)
    assert body == b"raw bytes" and head.startswith(b"HTTP/1.0 200 OK\r\n") and b"Connection: close\r\n" in head


def test_a_slow_client_holds_the_stream_back_and_its_socket_stays_blocking_for_the_frontend():
    async def scenario(sides: Sides):
        conn = sides.conn
        await started(sides)
        piece = b"x" * (1 << 16)
        added = 0
        while not conn.add_chunk("r", piece):  # nobody reads: the socket buffers fill up
            added += 1
            await passes()
            assert added < 10_000, "never asked to wait"
        waiting = asyncio.ensure_future(conn.wait_writable("r"))
        await passes(5)
        assert not waiting.done()
        received = 0
        while not waiting.done():  # the client reads: the stream goes on
            received += len(sides.to_client())
            await asyncio.sleep(0.001)
        await waiting
        await asyncio.wait_for(conn.end_client("r"), 10)
        received += len(sides.to_client())
        return added, received, os.get_blocking(sides.server.fileno())

    added, received, blocking = run(scenario)
    assert received >= (added + 1) * (1 << 16)  # everything, with the chunk framing
    assert blocking, "the socket was left non-blocking: the frontend's blocking writes would fail"


def test_a_client_that_leaves_ends_the_stream_with_client_gone():
    async def scenario(sides: Sides):
        conn = sides.conn
        await started(sides)
        sides.client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sides.client.close()  # a reset: the next writes fail
        for _ in range(100):
            if conn.add_chunk("r", b"token"):
                with pytest.raises(ClientGone):
                    await conn.wait_writable("r")
                return True
            await asyncio.sleep(0.01)
        return False

    assert run(scenario)


def test_a_long_body_written_directly_tells_the_frontend_it_is_alive(monkeypatch):
    monkeypatch.setattr(direct, "PROGRESS_INTERVAL", 0.0)

    async def scenario(sides: Sides):
        conn = sides.conn
        await started(sides)
        conn.add_chunk("r", b"token")
        await passes()
        await asyncio.sleep(0.001)
        conn.add_chunk("r", b"token")
        await passes()
        return sides.to_frontend()

    assert progress("r") in run(scenario)


def test_a_send_that_leaves_part_of_a_chunk_on_the_socket_tells_the_frontend_before_anything_else():
    """If rank 0 dies while the client's socket holds part of an HTTP chunk, nothing may follow it
    there: the frontend learns of the tear in the pass that made it (protocol: Chunk.torn), and
    that the socket holds whole chunks again once the client took the rest."""

    async def scenario(sides: Sides):
        conn = sides.conn
        await started(sides)
        conn.add_chunk("r", b"x" * (8 << 20))  # more than the socket's buffers take at once
        await passes()
        torn = [m for m in sides.to_frontend() if isinstance(m, Chunk)]
        received = b""
        while len(received) < (8 << 20):
            received += sides.to_client()
            await asyncio.sleep(0.001)
        await passes()
        return torn, [m for m in sides.to_frontend() if isinstance(m, Chunk)]

    torn, whole = run(scenario)
    assert torn == [progress("r", torn=True)]
    assert whole == [progress("r", torn=False)]


def test_the_descriptor_channel_hands_a_connection_over_and_closes_one_sent_without_a_head(tmp_path):
    async def scenario(sides: Sides):
        path = str(tmp_path / "group.sock")
        received = []
        channel = DescriptorChannel(asyncio.get_running_loop(), path, lambda m, fd, pid: received.append((m, fd, pid)))
        frontend = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        frontend.connect(path + ".fd")
        given = ResponseHead("HTTP/1.1", "gunicorn", False, {})
        send_with_fd(frontend, Attach(id="r", head=given), sides.server.fileno())
        send_with_fd(frontend, Attach(id="nobody"), sides.server.fileno())
        await asyncio.sleep(0.05)
        for _, fd, _ in received:
            os.close(fd)
        sides.server.close()  # the frontend closes its socket: the client sees the end only if
        await asyncio.sleep(0.05)  # no copy of it is left open in the worker
        ended = sides.client.recv(16) == b""
        frontend.close()
        channel.close()
        return [(m.id, pid) for m, _, pid in received], ended

    received, ended = run(scenario)
    assert received == [("r", os.getpid())]
    assert ended, "the worker kept a copy of the client's socket"
