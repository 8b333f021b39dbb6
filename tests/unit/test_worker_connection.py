"""The model worker's coalesced writes (container/worker/connection.py), over a real socket pair
on uvloop (the worker's loop): what leaves in one write, and when."""

import asyncio
import socket
import time

import pytest
import uvloop

from container.core.protocol import Chunk, End, FrameBuffer, Head, Status, WorkerState
from container.worker import connection
from container.worker.connection import Connection


def run(scenario):
    """Run ``scenario(conn, read)`` on uvloop with a Connection over a socket pair; ``read()``
    gives the messages that have reached the other end so far, one list per ``recv``."""

    async def main():
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=ours)
        frames = FrameBuffer()

        def read() -> list[list]:
            batches = []
            while True:
                try:
                    data = theirs.recv(1 << 20)
                except BlockingIOError:
                    return batches
                batches.append(frames.feed(data))

        try:
            return await scenario(Connection(reader, writer), read)
        finally:
            writer.close()
            theirs.close()

    return uvloop.run(main())


@pytest.fixture
def quiet_pass_only(monkeypatch):
    """The quiet-pass rule alone: under load a pass can outlast COALESCE_SECONDS (CI at bcca408
    wrote "12" and then "3"); the time rule has tests of its own below."""
    monkeypatch.setattr(connection, "COALESCE_SECONDS", 60.0)


def test_a_lone_token_leaves_two_loop_passes_after_it_was_sent(quiet_pass_only):
    async def scenario(conn, read):
        await conn.send(Chunk(id="a", data=b"tok"))
        await asyncio.sleep(0)
        assert read() == []  # still gathering: the rest of this engine step's tokens may come
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return read()

    assert run(scenario) == [[Chunk(id="a", data=b"tok")]]


def test_a_pass_that_adds_nothing_sends_what_was_gathered_as_one_frame_per_request_in_order(quiet_pass_only):
    async def scenario(conn, read):
        await conn.send(Head(id="a", code=200, headers={}, stream=False))
        for data in (b"1", b"2"):
            await conn.send(Chunk(id="a", data=data))
            await conn.send(Chunk(id="b", data=data.upper()))
        await asyncio.sleep(0)  # the next pass queues more: nothing leaves yet
        await conn.send(Chunk(id="a", data=b"3"))
        await conn.send(End(id="a"))
        await conn.send(Chunk(id="a", data=b"late"))  # after End: never merged into an earlier chunk
        for _ in range(3):
            await asyncio.sleep(0)
        return read()

    assert run(scenario) == [
        [
            Head(id="a", code=200, headers={}, stream=False),
            Chunk(id="a", data=b"123"),
            Chunk(id="b", data=b"12"),
            End(id="a"),
            Chunk(id="a", data=b"late"),
        ]
    ]


def keep_producing(item: bytes, block: float = 0.0):
    """A scenario: one chunk of ``item`` a loop pass (never a quiet pass), each pass taking
    ``block`` seconds more, until something is written: (what was written, passes)."""

    async def scenario(conn, read):
        passes = 0
        while not (batches := read()):
            await conn.send(Chunk(id="a", data=item))
            until = time.monotonic() + block
            while time.monotonic() < until:  # a busy pass (time.sleep may oversleep on a loaded machine)
                pass
            await asyncio.sleep(0)
            passes += 1
            assert passes < 1000, "nothing was written"
        return batches, passes

    return scenario


def test_a_streams_head_leaves_at_once_with_what_was_queued_before_it(quiet_pass_only):
    """The frontend hands the client's socket over while the handler goes on (vLLM's add_request
    and prefill) instead of after the loop's next quiet pass; a whole answer's head still waits."""
    async def scenario(conn, read):
        await conn.send(Chunk(id="a", data=b"last"))
        await conn.send(Head(id="b", code=200, headers={}, stream=True))
        at_once = read()
        await conn.send(Head(id="c", code=200, headers={}, stream=False))
        held = read()
        for _ in range(3):
            await asyncio.sleep(0)
        return at_once, held, read()

    at_once, held, later = run(scenario)
    assert at_once == [[Chunk(id="a", data=b"last"), Head(id="b", code=200, headers={}, stream=True)]]
    assert held == []
    assert later == [[Head(id="c", code=200, headers={}, stream=False)]]


def test_an_answer_to_a_client_ends_at_once_and_the_frontends_own_waits(quiet_pass_only):
    """The frontend ends the client's request on its End (the completion line, the connection back
    to the main loop): the sooner it has it, the sooner its work for that request is done (before
    the client's next request, not during it)."""
    async def scenario(conn, read):
        await conn.send(End(id="s", body_bytes=5, code=200, outcome="completed"))  # rank 0 wrote the answer
        at_once = read()
        await conn.send(End(id="w"))  # a whole answer's, after its body: the quiet pass sends it
        held = read()
        for _ in range(3):
            await asyncio.sleep(0)
        return at_once, held, read()

    at_once, held, later = run(scenario)
    assert at_once == [[End(id="s", body_bytes=5, code=200, outcome="completed")]]
    assert held == []
    assert later == [[End(id="w")]]


def test_a_loop_that_keeps_producing_writes_once_enough_is_queued(monkeypatch):
    monkeypatch.setattr(connection, "COALESCE_SECONDS", 60.0)
    (([chunk],), passes) = run(keep_producing(b"x" * 1000))
    assert len(chunk.data) == 1000 * (connection.COALESCE_BYTES // 1000 + 1) and passes <= len(chunk.data) // 1000 + 2


def test_a_loop_that_keeps_producing_writes_once_the_first_frame_is_old_enough(monkeypatch):
    """Counted in the loop's passes around the first frame's deadline, not in wall time: a loaded
    machine stretches a pass, and the write may then come with the first frame alone."""
    monkeypatch.setattr(connection, "COALESCE_BYTES", 1 << 30)
    monkeypatch.setattr(connection, "COALESCE_SECONDS", 0.05)

    async def scenario(conn, read):
        first_sent = time.monotonic()
        due = 0.0  # the first frame's deadline, at the latest
        passes_past_due = 0
        while True:
            await conn.send(Chunk(id="a", data=b"x"))  # a frame every pass: never a quiet one
            due = due or time.monotonic() + connection.COALESCE_SECONDS
            until = time.monotonic() + 0.02
            while time.monotonic() < until:  # a busy pass (time.sleep may oversleep on a loaded machine)
                pass
            yielded_at = time.monotonic()
            await asyncio.sleep(0)
            if batches := read():
                return batches, time.monotonic() - first_sent
            passes_past_due += yielded_at >= due
            assert passes_past_due < 3, "the first frame was held past its deadline"

    (([chunk],), age) = run(scenario)
    assert age >= connection.COALESCE_SECONDS  # not written while the first frame was young
    assert chunk.data == b"x" * len(chunk.data)


def test_send_now_writes_at_once_after_what_is_queued():
    async def scenario(conn, read):
        await conn.send(Chunk(id="a", data=b"tok"))
        conn.send_now(Status(state=WorkerState.DOWN, detail="bye"))
        return read()

    assert run(scenario) == [[Chunk(id="a", data=b"tok"), Status(state=WorkerState.DOWN, detail="bye")]]


def test_a_stream_waits_for_a_frontend_that_reads_too_slowly_and_stops_once_it_is_gone():
    """``add_chunk`` (a stream's tokens) asks its sender to wait past the high-water mark;
    ``wait_writable`` returns once the frontend has read, and raises ``PeerGone`` once it is gone."""

    async def scenario(conn, read):
        piece = b"x" * (1 << 16)
        added = 0
        while not conn.add_chunk("a", piece):  # nobody reads: the socket and then the transport fill up
            added += 1
            for _ in range(3):
                await asyncio.sleep(0)  # the pass that writes what was queued
            assert added < 1000, "never asked to wait"
        waiting = asyncio.ensure_future(conn.wait_writable())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done()
        received = 0
        while not waiting.done():  # the frontend reads: the sender goes on
            received += sum(len(m.data) for batch in read() for m in batch)
            await asyncio.sleep(0.001)
        await waiting
        conn.add_chunk("a", piece)
        conn.writer.transport.abort()  # the connection is gone
        try:
            await conn.wait_writable()
        except connection.PeerGone:
            return received > 0
        return False

    assert run(scenario)
