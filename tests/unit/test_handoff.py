"""Rank 0 reading a request whose connection the frontend handed over unread
(container/worker/handoff.py): a real TCP connection, a real ``Connection`` to a frontend over a
socket pair, on uvloop (the worker's loop)."""

import asyncio
import json
import os
import socket

import uvloop

from container.core.protocol import Attach, FrameBuffer, Head, Invoke, ResponseHead, Taken
from container.worker import handoff
from container.worker.connection import Connection
from container.worker.handoff import Handoffs

BODY = json.dumps({"inputs": "hi", "stream": True}).encode()


def request(body: bytes = BODY, extra: bytes = b"") -> bytes:
    return (
        b"POST /invocations HTTP/1.1\r\nHost: t\r\nX-Amzn-SageMaker-Inference-Id: rid-1\r\n%s"
        b"Content-Length: %d\r\n\r\n%s" % (extra, len(body), body)
    )


def run(scenario, ready: bool = True):
    """``scenario(hand, client, server, frames, started)``: ``hand(wait, pid=ours)`` hands the
    server side of a TCP connection to rank 0; ``client`` is its other end; ``frames()`` what
    reached the frontend; ``started`` the Invokes rank 0 started, with their connection."""

    async def main():
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=ours)
        conn = Connection(reader, writer)
        connections = {conn}
        started: list[tuple[Connection, Invoke]] = []
        handoffs = Handoffs(connections, lambda c, i: started.append((c, i)), lambda: ready)
        listener = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        buffer = FrameBuffer()

        def hand(pid: int = os.getpid()) -> None:
            head = ResponseHead("HTTP/1.1", "gunicorn", False, {"X-Sagelmi-Group": "0"})
            handoffs.receive(Attach(id="w1", head=head, max_body=1 << 20), os.dup(server.fileno()), pid)

        async def frames(wait: float = 0.01) -> list:
            await asyncio.sleep(wait)  # the connection's coalescing pass
            messages = []
            while True:
                try:
                    data = theirs.recv(1 << 20)
                except BlockingIOError:
                    return messages
                messages += buffer.feed(data)

        try:
            return await scenario(hand, client, server, frames, started, conn)
        finally:
            for sock in (client, server, listener, theirs):
                sock.close()
            writer.close()

    return uvloop.run(main())


def waiting(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return b""


def test_a_whole_streamed_request_is_read_and_started_with_its_clients_socket():
    async def scenario(hand, client, server, frames, started, conn):
        client.sendall(request() + b"POST /next")
        await asyncio.sleep(0.05)
        hand()
        assert await frames() == []  # not alone: the frontend is not woken for it during the first step
        head = Head(id="w1", code=200, headers={}, stream=True, written=True)
        conn.queue(head)
        taken = Taken(id="w1", served=True, request_id="rid-1", path="/invocations", raw=request(), close=False)
        assert await frames() == [taken, head]
        ((on, invoke),) = started
        assert on is conn and (invoke.id, invoke.path, invoke.body) == ("w1", "/invocations", BODY)
        assert invoke.properties["requestId"] == "rid-1" and invoke.properties["Host"] == "t"
        attach, fd = conn._clients["w1"]
        assert attach.head.headers == {"X-Sagelmi-Group": "0", "X-Amzn-SageMaker-Inference-Id": "rid-1"}
        os.close(fd)
        assert waiting(server) == b"POST /next"  # its request read, nothing more

    run(scenario)


def test_what_rank_0_may_not_read_is_declined_with_nothing_read():
    async def scenario(hand, client, server, frames, started, conn):
        data = request(extra=b"Accept: a\r\nAccept: b\r\n")
        client.sendall(data)
        await asyncio.sleep(0.05)
        hand()
        assert await frames() == [Taken(id="w1", served=False)]
        assert started == [] and waiting(server) == data

    run(scenario)


def test_a_request_not_all_there_is_declined_with_nothing_read():
    """The frontend hands over only a request all there (``may_be_read``); rank 0 does not wait."""

    async def scenario(hand, client, server, frames, started, conn):
        data = request()
        client.sendall(data[:-5])
        await asyncio.sleep(0.05)
        hand()
        assert await frames() == [Taken(id="w1", served=False)]
        assert started == [] and waiting(server) == data[:-5]

    run(scenario)


def test_taken_leaves_alone_when_nothing_else_does_soon():
    async def scenario(hand, client, server, frames, started, conn):
        client.sendall(request())
        await asyncio.sleep(0.05)
        hand()
        got = await frames(handoff.TAKEN_LATEST + 0.05)
        assert [type(m) for m in got] == [Taken] and got[0].raw == request()
        assert os.get_blocking(server.fileno())  # as the frontend handed it over
        os.close(conn._clients["w1"][1])

    run(scenario)


def test_a_group_not_ready_declines_and_an_unknown_process_gets_nothing():
    async def scenario(hand, client, server, frames, started, conn):
        client.sendall(request())
        await asyncio.sleep(0.05)
        hand()
        assert await frames() == [Taken(id="w1", served=False)]
        hand(pid=1)  # not the process of any connection to rank 0: closed unread
        assert await frames() == []
        assert started == [] and waiting(server) == request()

    run(scenario, ready=False)
