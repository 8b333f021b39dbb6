"""Rank 0 reading a request whose connection the frontend handed over unread, and answering it
on that connection (container/worker/handoff.py): a real TCP connection, a real ``Connection`` to a
frontend over a socket pair, on uvloop (the worker's loop)."""

import asyncio
import json
import os
import socket

import pytest
import uvloop

from container.core.ingress import fingerprint
from container.core.protocol import Attach, End, FrameBuffer, Head, Invoke, ResponseHead, Taken
from container.worker.connection import Connection, PeerGone
from container.worker.handoff import Handoffs

BODY = json.dumps({"inputs": "hi", "stream": True}).encode()
BODY_READ_TIMEOUT = 0.3


def request(body: bytes = BODY, extra: bytes = b"", length: int | None = None) -> bytes:
    return (
        b"POST /invocations?x=1 HTTP/1.1\r\nHost: t\r\n%s"
        b"Content-Length: %d\r\n\r\n%s" % (extra, len(body) if length is None else length, body)
    )


def chunked(chunks: tuple[bytes, ...] = (BODY[:10], BODY[10:]), extra: bytes = b"", end: bytes = b"0\r\n\r\n") -> bytes:
    """A request with ``chunks`` as its chunked body, ``end`` after them (the last chunk)."""
    head = b"POST /invocations?x=1 HTTP/1.1\r\nHost: t\r\n%sTransfer-Encoding: chunked\r\n\r\n" % extra
    return head + b"".join(b"%X\r\n%s\r\n" % (len(c), c) for c in chunks) + end


def run(scenario, max_body: int = 1 << 20):
    """``scenario(hand, client, server, frames, started, conn)``: ``hand(pid=ours)`` hands the
    server side of a TCP connection to rank 0 (``prefix``: what the frontend read off it first);
    ``client`` is its other end; ``frames()`` what reached the frontend; ``started`` the Invokes
    rank 0 started, with their connection."""

    async def main():
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=ours)
        conn = Connection(reader, writer)
        connections = {conn}
        started: list[tuple[Connection, Invoke]] = []
        loop = asyncio.get_running_loop()
        handoffs = Handoffs(connections, lambda c, i: started.append((c, i)), loop, BODY_READ_TIMEOUT)
        listener = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        server.setblocking(True)  # as the frontend hands it over
        buffer = FrameBuffer()

        def hand(pid: int = os.getpid(), prefix: bytes = b"", refused: dict[str, float] | None = None) -> None:
            head = ResponseHead("HTTP/1.1", "gunicorn", False, {"X-Sagelmi-Group": "0", "X-Amzn-SageMaker-Inference-Id": "rid-1"})
            attach = Attach(id="w1", head=head, max_body=max_body, prefix=prefix, refused=refused or {})
            handoffs.receive(attach, os.dup(server.fileno()), pid)

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


async def handed(hand, client: socket.socket, data: bytes) -> None:
    """The client sends ``data``, then the frontend hands its connection to rank 0, whose read
    task has run by the return."""
    client.sendall(data)
    await asyncio.sleep(0.05)
    hand()
    await asyncio.sleep(0.01)


def waiting(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return b""


def answer(client: socket.socket) -> tuple[bytes, bytes]:
    """What the client got: the answer's head and the body after it."""
    client.settimeout(2)
    data = b""
    while b"\r\n\r\n" not in data:
        data += client.recv(1 << 16)
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


def test_a_request_is_read_to_its_end_and_started_and_the_next_one_stays_on_the_socket():
    async def scenario(hand, client, server, frames, started, conn):
        await handed(hand, client, request() + b"POST /next")
        ((on, invoke),) = started
        assert on is conn and (invoke.id, invoke.path, invoke.query, invoke.body) == ("w1", "/invocations", "x=1", BODY)
        assert invoke.properties["requestId"] == "rid-1" and invoke.properties["Host"] == "t"
        # at once: the frontend did not see the whole request (Attach.seen), and the handler may stop the group
        assert await frames() == [Taken("w1", "rid-1", "/invocations", fingerprint("/invocations?x=1", BODY))]
        assert waiting(server) == b"POST /next"  # its request read, nothing more
        await conn.end_client("w1")

    run(scenario)


def test_a_whole_answer_goes_to_the_client_with_its_length_after_the_frontend_heard_of_it():
    async def scenario(hand, client, server, frames, started, conn):
        await handed(hand, client, request())
        await conn.send(Head(id="w1", code=201, headers={"Content-Type": "text/plain"}, stream=False, written=True))
        heard = await frames(0)
        conn.open_client("w1", 201, {"Content-Type": "text/plain"}, 5)
        conn.add_chunk("w1", b"hello")
        await conn.end_client("w1", None, (3, 2))
        head, body = answer(client)
        return heard, head, body, await frames(0.05)

    heard, head, body, later = run(scenario)
    assert [type(m) for m in heard] == [Taken, Head]  # the Head leaves at once, before the client's bytes
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 201 CREATED" and b"Content-Length: 5" in lines and b"Connection: keep-alive" in lines
    assert b"X-Amzn-SageMaker-Inference-Id: rid-1" in lines and body == b"hello"
    assert later == [End(id="w1", prompt_tokens=3, completion_tokens=2, body_bytes=5, code=201, outcome="completed")]


def test_a_handlers_error_mid_stream_ends_the_chunked_body_with_the_routes_error():
    async def scenario(hand, client, server, frames, started, conn):
        await handed(hand, client, request())
        headers = {"Content-Type": "application/jsonlines"}
        await conn.send(Head(id="w1", code=200, headers=headers, stream=True, written=True))
        conn.open_client("w1", 200, headers, None)
        conn.add_chunk("w1", b'{"token": 1}\n')
        await asyncio.sleep(0.01)
        await conn.end_client("w1", RuntimeError("boom"))
        await asyncio.sleep(0.01)
        head, body = answer(client)
        return head, body, await frames(0.05)

    head, body, frames = run(scenario)
    assert b"Transfer-Encoding: chunked" in head
    first, error, rest = body.split(b"\r\n", 4)[1], body.split(b"\r\n")[3], body.split(b"\r\n")[4:]
    assert first == b'{"token": 1}\n' and json.loads(error)["code"] == 424 and rest == [b"0", b"", b""]
    assert frames[-1].outcome == "error" and frames[-1].code == 200 and not frames[-1].close


def test_a_body_past_the_limit_is_413_without_reading_it_and_the_connection_closes():
    async def scenario(hand, client, server, frames, started, conn):
        client.sendall(request(b"x" * 100))
        await asyncio.sleep(0.05)
        hand()
        got = await frames(0.1)
        head, body = answer(client)
        return head, body, started, got

    head, body, started, frames = run(scenario, max_body=10)
    assert head.startswith(b"HTTP/1.1 413 ") and b"Connection: close" in head
    assert "the limit is 10 bytes" in json.loads(body)["error"] and started == []
    assert frames[-1] == End(id="w1", code=413, outcome="error", close=True, body_bytes=len(body))


def test_a_body_that_does_not_come_in_time_is_408_and_one_cut_short_is_400():
    async def scenario(hand, client, server, frames, started, conn):
        client.sendall(request()[:-5])
        await asyncio.sleep(0.05)
        hand()
        await asyncio.sleep(BODY_READ_TIMEOUT + 0.1)
        late = answer(client)
        return late, started

    (head, body), started = run(scenario)
    assert head.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 0.3s (body_read_timeout)" in body
    assert started == []

    async def cut(hand, client, server, frames, started, conn):
        client.sendall(request()[:-5])
        client.shutdown(socket.SHUT_WR)
        await asyncio.sleep(0.05)
        hand()
        await asyncio.sleep(0.1)
        return answer(client)

    head, body = run(cut)
    assert head.startswith(b"HTTP/1.1 400 ") and b"ended after" in body


def test_an_unknown_process_gets_nothing_and_its_connection_is_closed_unread():
    async def scenario(hand, client, server, frames, started, conn):
        client.sendall(request())
        await asyncio.sleep(0.05)
        hand(pid=1)  # not the process of any connection to rank 0
        return await frames(), started, waiting(server)

    frames, started, left = run(scenario)
    assert frames == [] and started == [] and left == request()


def test_an_answer_opening_a_session_waits_for_the_frontends_routing_and_others_do_not():
    async def scenario(hand, client, server, frames, started, conn):
        conn.sessions_expiration = 60.0
        await handed(hand, client, request())
        headers = conn.answer_headers("w1", 200, {"X-Amzn-SageMaker-Session-Id": "s-1"})  # LMI's form: it opens s-1
        assert headers["X-Amzn-SageMaker-New-Session-Id"].startswith("s-1; Expires=") and conn.held("w1")
        await conn.send(Head(id="w1", code=200, headers=headers, stream=False, written=True, held=True))
        held = asyncio.ensure_future(conn.delivered("w1"))
        await asyncio.sleep(0.1)
        waited = not held.done()  # the Head left, but the frontend's routing has not said it knows s-1
        conn.attach(Attach(id="w1"))  # it has (GroupClient.routed)
        await asyncio.wait_for(held, 1)
        plain = conn.answer_headers("w1", 200, {"Content-Type": "text/plain"})
        assert not conn.held("w1")
        await asyncio.wait_for(conn.delivered("w1"), 1)  # nothing said of sessions: only the Head's leaving
        await conn.end_client("w1")
        return waited, plain

    waited, plain = run(scenario)
    assert waited and plain == {"Content-Type": "text/plain"}


def test_an_answer_held_for_its_sessions_routing_fails_when_the_frontends_connection_closes():
    async def scenario(hand, client, server, frames, started, conn):
        await handed(hand, client, request())
        conn.answer_headers("w1", 200, {"X-Amzn-SageMaker-New-Session-Id": "s-2"})  # the handler's SageMaker form
        held = asyncio.ensure_future(conn.delivered("w1"))
        await asyncio.sleep(0.01)
        conn.close()
        try:
            await asyncio.wait_for(held, 1)
        except PeerGone:
            return True
        return False

    assert run(scenario)


def test_a_chunked_body_is_decoded_and_started_and_the_connection_stays_open():
    async def scenario(hand, client, server, frames, started, conn):
        client.sendall(chunked())
        await asyncio.sleep(0.05)
        hand()
        await asyncio.sleep(0.05)
        ((_, invoke),) = started
        assert invoke.body == BODY and invoke.properties["Transfer-Encoding"] == "chunked"
        assert await frames() == [Taken("w1", "rid-1", "/invocations", fingerprint("/invocations?x=1", BODY))]
        assert not conn.clients["w1"].close
        await conn.end_client("w1")
        return await frames(0.05)

    (end,) = run(scenario)
    assert not end.close


def test_a_chunked_body_that_comes_in_pieces_after_100_continue_is_waited_for():
    async def scenario(hand, client, server, frames, started, conn):
        data = chunked(extra=b"Expect: 100-continue\r\n")
        head_end = data.index(b"\r\n\r\n") + 4
        client.sendall(data[:head_end])
        await asyncio.sleep(0.05)
        hand()
        await asyncio.sleep(0.05)
        asked = waiting(client)
        client.recv(len(asked))
        for start in range(head_end, len(data), 9):
            client.sendall(data[start : start + 9])
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        return asked, [invoke.body for _, invoke in started]

    asked, bodies = run(scenario)
    assert asked == b"HTTP/1.1 100 Continue\r\n\r\n" and bodies == [BODY]


def test_a_request_sent_after_a_chunked_body_is_not_served_and_the_connection_closes_after_the_answer():
    async def scenario(hand, client, server, frames, started, conn):
        client.sendall(chunked() + request())
        await asyncio.sleep(0.05)
        hand()
        await asyncio.sleep(0.05)
        assert [invoke.body for _, invoke in started] == [BODY]  # the second is gone with the read
        await conn.send(Head(id="w1", code=200, headers={}, stream=False, written=True))
        await frames(0)
        conn.open_client("w1", 200, {}, 2)
        conn.add_chunk("w1", b"ok")
        await conn.end_client("w1")
        head, body = answer(client)
        return head, body, await frames(0.05)

    head, body, (end,) = run(scenario)
    assert b"Connection: close" in head and body == b"ok" and end.close


@pytest.mark.parametrize(
    ("data", "shut", "status", "says"),
    [
        (chunked((b"x" * 6, b"y" * 6), end=b""), False, 413, "the limit is 10 bytes"),
        (chunked(end=b""), False, 408, "the whole chunked body did not arrive within 0.3s"),
        (chunked(end=b"0\r\n"), True, 400, f"ended after {len(BODY)} bytes of a chunked body"),
        (chunked().replace(b"A\r\n", b"Z\r\n"), False, 400, "framing is malformed: Invalid character in chunk size"),
        (chunked().replace(BODY[:10], BODY[:12]), False, 400, "framing is malformed"),
    ],
)
def test_a_chunked_body_too_large_late_cut_short_or_malformed_gets_the_routes_error(data, shut, status, says):
    async def scenario(hand, client, server, frames, started, conn):
        client.sendall(data)
        if shut:
            client.shutdown(socket.SHUT_WR)
        await asyncio.sleep(0.05)
        hand()
        await asyncio.sleep(BODY_READ_TIMEOUT + 0.1)
        head, body = answer(client)
        return head, body, started, await frames(0.05)

    head, body, started, frames = run(scenario, max_body=10 if status == 413 else 1 << 20)
    assert head.startswith(b"HTTP/1.1 %d " % status) and b"Connection: close" in head
    assert json.loads(body)["code"] == status and says in json.loads(body)["error"] and started == []
    assert frames[-1].code == status and frames[-1].close


@pytest.mark.parametrize(
    ("data", "read", "rest", "closes"),
    [
        (request() + b"POST /next", 30, b"POST /next", False),  # part of the head read by the frontend
        (request(), len(request()) - 5, b"", False),  # the head and part of the body
        (request() + b"POST /next", len(request()) + 4, b" /next", True),  # and some of the next request: gone
        (chunked() + b"POST /next", 60, b"", True),  # a chunked body read on after the prefix (and past its end)
    ],
)
def test_a_request_whose_start_the_frontend_read_is_read_on_after_it(data, read, rest, closes):
    """The frontend hands over what it read of the request (a head read whole, bytes gunicorn read
    ahead) with the connection (``Attach.prefix``): rank 0 parses the head from it and what it
    peeks, and reads the rest after it; bytes of a next request in it close the connection after
    the answer."""

    async def scenario(hand, client, server, frames, started, conn):
        client.sendall(data)
        await asyncio.sleep(0.05)
        prefix = server.recv(read)
        hand(prefix=prefix)
        await asyncio.sleep(0.05)
        ((_, invoke),) = started
        assert (invoke.path, invoke.query, invoke.body) == ("/invocations", "x=1", BODY)
        assert await frames() == [Taken("w1", "rid-1", "/invocations", fingerprint("/invocations?x=1", BODY))]
        return waiting(server), conn.clients["w1"].close

    assert run(scenario) == (rest, closes)


def test_a_copy_of_a_poison_request_the_frontend_did_not_see_whole_is_refused_by_rank_0_with_the_frontends_422():
    """While copies of some request are refused, the Attach carries the refused fingerprints with
    the seconds each stays refused: rank 0 answers a copy with the error the frontend gives one it
    saw whole (the route's envelope, 422) instead of starting it, says so in the End (outcome
    ``refused``: the frontend counts it) and keeps the connection; other requests are served."""
    refused = {fingerprint("/invocations?x=1", BODY): 30.0}

    async def copy(hand, client, server, frames, started, conn):
        client.sendall(request()[:-5])
        await asyncio.sleep(0.05)
        hand(refused=refused)
        await asyncio.sleep(0.05)
        client.sendall(request()[-5:])  # the body's end after the head: the frontend could not see it whole
        await asyncio.sleep(0.05)
        head, body = answer(client)
        return head, body, started, await frames(0.05)

    head, body, started, got = run(copy)
    assert head.startswith(b"HTTP/1.1 422 ") and b"Connection: keep-alive" in head and started == []
    error = json.loads(body)
    assert error["code"] == 422 and error["message"] == "request stopped the engine"
    assert "copies of it are refused for 30 more seconds" in error["error"]
    assert [type(m) for m in got] == [Head, End]  # no Taken: it never ran
    assert got[-1] == End(id="w1", code=422, outcome="refused", body_bytes=len(body))

    async def other(hand, client, server, frames, started, conn):
        client.sendall(request(b'{"inputs": "other"}'))
        await asyncio.sleep(0.05)
        hand(refused=refused)
        await asyncio.sleep(0.05)
        return [invoke.body for _, invoke in started]

    assert run(other) == [b'{"inputs": "other"}']
