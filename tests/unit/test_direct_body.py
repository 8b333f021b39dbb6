"""A streamed answer's body written by the worker to the client's socket itself
(container/worker/handoff.py: DirectBody, Connection.attach), over real sockets on uvloop: the frontend's
connection is a socket pair, the client's a TCP connection on loopback, the descriptor
handed over as the frontend does (send_with_fd on the descriptor channel)."""

import asyncio
import os
import socket

import pytest
import uvloop

from container.core.protocol import Attach, Chunk, End, FrameBuffer, Head, progress, send_with_fd
from container.worker import handoff as direct
from container.worker.connection import Connection, DescriptorChannel
from container.worker.handoff import ClientGone


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

    def to_frontend(self) -> list:
        messages = []
        while True:
            try:
                data = self.frontend.recv(1 << 20)
            except BlockingIOError:
                return messages
            messages += self.frames.feed(data)

    def to_client(self) -> bytes:
        got = b""
        while True:
            try:
                data = self.client.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return got
            if not data:
                return got
            got += data


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


async def started(sides: Sides, request_id: str = "r") -> None:
    """A stream's start as rank 0 makes it: its body expected, its Head sent, the client's socket attached."""
    sides.conn.expect_stream(request_id)
    await sides.conn.send(Head(id=request_id, code=200, headers={}, stream=True))
    assert sides.conn.attach(Attach(id=request_id, direct=True), os.dup(sides.server.fileno()))


async def passes(count: int = 3) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def test_the_body_waits_for_the_attach_then_goes_to_the_client_as_http_chunks_and_never_to_the_frontend():
    async def scenario(sides: Sides):
        conn = sides.conn
        conn.expect_stream("r")
        await conn.send(Head(id="r", code=200, headers={}, stream=True))
        assert not conn.add_chunk("r", b"one ")
        await passes()
        held = sides.to_client()
        assert conn.attach(Attach(id="r", direct=True), os.dup(sides.server.fileno()))
        conn.add_chunk("r", b"two ")
        conn.add_chunk("r", b"three")
        await passes()
        written = sides.to_client()
        sent = await conn.finish_stream("r")
        await conn.send(End(id="r", body_bytes=sent))
        await passes()
        conn.drop_stream("r")
        return held, written, sent, sides.to_frontend()

    held, written, sent, frontend = run(scenario)
    assert held == b""
    assert written == chunked(b"one two three")  # what was held and what this pass added: one chunk
    assert sent == len(b"one two three")
    assert frontend == [Head(id="r", code=200, headers={}, stream=True), End(id="r", body_bytes=sent)]


def test_another_streams_head_or_end_leaves_at_once_without_writing_a_running_streams_pieces():
    """A stream's Head and End leave at once; the pieces another stream queued this pass stay
    for the pass, so they keep coalescing into one write to that stream's client (writing them
    on every other stream's start and end halved the relay's items/s at 64 streams)."""

    async def scenario(sides: Sides):
        conn = sides.conn
        await started(sides)
        conn.add_chunk("r", b"one ")
        conn.expect_stream("s")
        await conn.send(Head(id="s", code=200, headers={}, stream=True))
        conn.add_chunk("r", b"two ")
        conn.expect_stream("t")
        await conn.send(End(id="t", body_bytes=0))
        conn.add_chunk("r", b"three")
        at_once = sides.to_frontend(), sides.to_client()
        await passes()
        return at_once, sides.to_client()

    (frontend, client_at_once), client_later = run(scenario)
    assert frontend == [
        Head(id="r", code=200, headers={}, stream=True),
        Head(id="s", code=200, headers={}, stream=True),
        End(id="t", body_bytes=0),
    ]
    assert client_at_once == b""
    assert client_later == chunked(b"one two three")  # one write for the pass


def test_one_pass_at_a_time_looks_at_what_was_queued_whatever_queued_it():
    """A Head that leaves at once, then a body attached and its pieces added, schedule one pass of
    the loop, not one each: two chains of passes each flush what the other just let coalesce,
    a write per piece (the relay at 1 stream ran at a third of its items/s so)."""

    async def scenario(sides: Sides):
        conn = sides.conn
        scheduled = []
        call_soon = conn._call_soon
        conn._call_soon = lambda callback, *args: (scheduled.append(callback), call_soon(callback, *args))
        conn.expect_stream("r")
        await conn.send(Head(id="r", code=200, headers={}, stream=True))  # leaves at once
        conn.attach(Attach(id="r", direct=True), os.dup(sides.server.fileno()))
        for piece in (b"one ", b"two ", b"three"):
            conn.add_chunk("r", piece)
        first = len(scheduled)
        await passes()
        return first, sides.to_client()

    first, client = run(scenario)
    assert first == 1
    assert client == chunked(b"one two three")  # one write for the pass


def test_an_attach_without_the_socket_sends_the_held_body_to_the_frontend():
    async def scenario(sides: Sides):
        conn = sides.conn
        conn.expect_stream("r")
        conn.add_chunk("r", b"one ")
        assert conn.attach(Attach(id="r"), None)
        conn.add_chunk("r", b"two")
        sent = await conn.finish_stream("r")
        await passes()
        return sent, sides.to_frontend(), sides.to_client()

    sent, frontend, client = run(scenario)
    assert sent == 0 and client == b""
    assert [m.data for m in frontend] == [b"one two"]


def test_an_http_1_0_client_gets_the_raw_body():
    async def scenario(sides: Sides):
        sides.conn.expect_stream("r")
        sides.conn.attach(Attach(id="r", direct=True, chunked=False), os.dup(sides.server.fileno()))
        sides.conn.add_chunk("r", b"raw bytes")
        await sides.conn.finish_stream("r")
        return sides.to_client()

    assert run(scenario) == b"raw bytes"


def test_a_slow_client_holds_the_stream_back_and_its_socket_stays_blocking_for_the_frontend():
    async def scenario(sides: Sides):
        conn = sides.conn
        conn.expect_stream("r")
        conn.attach(Attach(id="r", direct=True), os.dup(sides.server.fileno()))
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
        await asyncio.wait_for(conn.finish_stream("r"), 10)
        received += len(sides.to_client())
        return added, received, os.get_blocking(sides.server.fileno())

    added, received, blocking = run(scenario)
    assert received >= (added + 1) * (1 << 16)  # everything, with the chunk framing
    assert blocking, "the socket was left non-blocking: the frontend's blocking writes would fail"


def test_a_client_that_leaves_ends_the_stream_with_client_gone():
    async def scenario(sides: Sides):
        conn = sides.conn
        conn.expect_stream("r")
        conn.attach(Attach(id="r", direct=True), os.dup(sides.server.fileno()))
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
        conn.expect_stream("r")
        conn.attach(Attach(id="r", direct=True), os.dup(sides.server.fileno()))
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
        conn.expect_stream("r")
        conn.attach(Attach(id="r", direct=True), os.dup(sides.server.fileno()))
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


def test_the_descriptor_channel_hands_the_socket_to_the_waiting_answer_and_closes_unwanted_ones(tmp_path):
    async def scenario(sides: Sides):
        conn = sides.conn
        path = str(tmp_path / "group.sock")
        channel = DescriptorChannel(asyncio.get_running_loop(), path, {conn})
        frontend = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        frontend.connect(path + ".fd")
        conn.expect_stream("r")
        send_with_fd(frontend, Attach(id="r", direct=True), sides.server.fileno())
        send_with_fd(frontend, Attach(id="nobody", direct=True), sides.server.fileno())
        conn.add_chunk("r", b"hello")
        await asyncio.sleep(0.05)
        await conn.finish_stream("r")
        conn.drop_stream("r")
        got = sides.to_client()
        sides.server.close()  # the frontend closes its socket: the client sees the end only if
        await asyncio.sleep(0.05)  # no copy of it is left open in the worker
        ended = sides.client.recv(16) == b""
        frontend.close()
        channel.close()
        return got, ended

    got, ended = run(scenario)
    assert got == chunked(b"hello")
    assert ended, "the worker kept a copy of the client's socket"


