"""How gthread's main loop holds a connection until its request head is whole
(container/frontend/main_loop.py: ``HeadWaitingWorker``): with real sockets and gunicorn's own
connection objects; the request threads and /ping's are lists here.
tests/integration/test_slow_clients.py runs the real server."""

import json
import os
import selectors
import socket
import time
from concurrent.futures import Future

import pytest
from gunicorn.config import Config
from gunicorn.workers.gthread import TConn

from container.core.ingress import PEEK_BYTES
from container.frontend.main_loop import PEEKS, HeadWaitingWorker, read_ahead
from container.frontend.waiting import WaitingConnections


class Pool:
    """/ping's threads: what was handed to them."""

    def __init__(self) -> None:
        self.conns: list = []

    def submit(self, fn, conn) -> Future:
        self.conns.append(conn)
        return Future()

    def shutdown(self, wait: bool) -> None:
        pass


class Loop:
    """A worker's main loop without its threads, and a listening socket to connect to."""

    def __init__(self, header_read_timeout: float = 5.0, per_client: int = 100) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.worker = HeadWaitingWorker(0, os.getpid(), [self.listener], None, 30, Config(), None)
        self.worker.poller = selectors.DefaultSelector()
        self.worker.hold(header_read_timeout, per_client)
        self.worker.ping_pool.shutdown(wait=False)
        self.worker.ping_pool = self.pings = Pool()
        self.threads: list = []
        self.worker.to_thread = self.threads.append
        self.clients: list[socket.socket] = []

    def connect(self, data: bytes = b"") -> tuple[socket.socket, TConn]:
        """A client's connection, accepted as gthread accepts it, after the client sent ``data``."""
        client = socket.create_connection(self.listener.getsockname())
        self.clients.append(client)
        if data:
            client.sendall(data)
        sock, address = self.listener.accept()
        conn = TConn(self.worker.cfg, sock, address, self.listener.getsockname())
        self.worker.nr_conns += 1
        self.worker.enqueue_req(conn)
        return client, conn

    def turn(self, seconds: float = 0.2) -> None:
        """The main loop for ``seconds``: events, then the deadlines."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.worker.wait_for_and_dispatch_events(max(end - time.monotonic(), 0))
            self.worker.murder_pending()

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.listener.close()


class Early:
    """The hand-off to rank 0 (container/frontend/early.py): takes a POST /invocations, noting what
    it was shown and what gunicorn had read of it (the Attach's prefix)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, bytes]] = []

    def may_take(self, start: bytes) -> bool:
        return b"POST /invocations".startswith(start[:17])

    def takes(self, data: bytes) -> bool:
        return data.startswith(b"POST /invocations")

    def send(self, conn, close: bool, data: bytes) -> bool:
        if not self.takes(data):
            return False
        self.sent.append((data, read_ahead(conn)))
        return True


@pytest.fixture
def loop():
    loop = Loop()
    yield loop
    loop.close()


def received(client: socket.socket) -> bytes:
    """Everything the server sent before it closed the connection."""
    client.settimeout(5)
    data = b""
    while chunk := client.recv(65536):
        data += chunk
    return data


def error_answer(data: bytes) -> tuple[str, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"\r\nConnection: close\r\n" in head
    return head.split(b"\r\n")[0].decode(), json.loads(body)


def test_a_whole_head_goes_to_a_thread_at_once(loop):
    _, conn = loop.connect(b"POST /invocations HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
    assert loop.threads == [conn] and conn.data_ready
    assert len(loop.worker.waits) == 0


def test_half_a_head_waits_without_a_thread_until_the_rest_came(loop):
    client, conn = loop.connect(b"POST /invocations HTTP/1.1\r\nConte")
    loop.turn()
    assert loop.threads == [] and conn in loop.worker.waits
    client.sendall(b"nt-Length: 2\r\n\r\n{}")
    loop.turn()
    assert loop.threads == [conn] and conn not in loop.worker.waits
    request = next(conn.parser)  # what gunicorn reads: the head the main loop read, then the body
    assert (request.path, request.body.read()) == ("/invocations", b"{}")


def test_a_bare_ping_goes_to_its_own_threads_and_a_ping_with_a_body_does_not(loop):
    _, ping = loop.connect(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    _, other = loop.connect(b"GET /ping HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello")
    assert loop.pings.conns == [ping] and loop.threads == [other]


def test_a_head_not_whole_by_its_deadline_gets_408_in_its_routes_envelope_and_is_closed():
    loop = Loop(header_read_timeout=0.3)
    try:
        lmi, _ = loop.connect(b"POST /invocations HTTP/1.1\r\nHo")
        openai, _ = loop.connect(b"POST /v1/completions HTTP/1.1\r\nHo")
        silent, _ = loop.connect()
        loop.turn(0.5)
        assert loop.worker.nr_conns == 0 and len(loop.worker.waits) == 0
        status, body = error_answer(received(lmi))
        assert status == "HTTP/1.1 408 Request Timeout"
        assert body == {"code": 408, "message": "request timeout", "error": body["error"]}
        assert "within 0.3s (header_read_timeout)" in body["error"]
        _, body = error_answer(received(openai))
        assert body["error"]["code"] == 408 and "header_read_timeout" in body["error"]["message"]
        assert received(silent) == b""  # nothing was asked: nothing is answered
        assert loop.threads == []
    finally:
        loop.close()


def test_a_client_that_leaves_with_half_a_head_is_forgotten(loop):
    client, conn = loop.connect(b"GET /models HTTP/1.1\r\nHo")
    client.close()
    loop.turn()
    assert loop.worker.nr_conns == 0 and conn not in loop.worker.waits and loop.threads == []


def test_past_the_cap_a_clients_oldest_waiting_connection_is_closed_idle_or_not():
    loop = Loop(per_client=2)
    try:
        idle_client, idle = loop.connect(b"GET /ping HTTP/1.1\r\n\r\n")
        loop.pings.conns.clear()
        idle.set_timeout()  # served; kept alive by gthread's finish_request:
        loop.worker.keepalived_conns.append(idle)
        loop.worker.poller.register(idle.sock, selectors.EVENT_READ, lambda sock: None)
        loop.worker.idle(idle)
        first, _ = loop.connect(b"GET /models HTTP/1.1\r\nHo")
        assert idle in loop.worker.waits
        second, _ = loop.connect(b"GET /models HTTP/1.1\r\nHo")
        assert received(idle_client) == b"" and idle not in loop.worker.keepalived_conns  # closed quietly
        loop.connect(b"GET /models HTTP/1.1\r\nHo")
        _, body = error_answer(received(first))
        assert body["code"] == 408 and "max_connections_per_client" in body["error"]
        assert len(loop.worker.waits) == 2 and loop.worker.nr_conns == 2
        _, ping = loop.connect(b"GET /ping HTTP/1.1\r\n\r\n")  # a request is never refused
        assert loop.pings.conns == [ping]
    finally:
        loop.close()


def test_at_the_servers_bound_accepting_closes_the_connection_waiting_longest():
    loop = Loop()
    try:
        loop.worker.worker_connections = 2
        oldest, newer = (socket.create_connection(loop.listener.getsockname()) for _ in range(2))
        loop.clients += [oldest, newer]
        newer.sendall(b"GET /models HTTP/1.1\r\nHo")
        loop.worker.accept(loop.listener)  # gthread's accept: a connection that sent nothing yet waits
        loop.worker.accept(loop.listener)
        assert loop.worker.nr_conns == 1  # room made for the newer one
        assert received(oldest) == b""
    finally:
        loop.close()


def test_waiting_connections_name_the_oldest_of_a_client_past_its_cap():
    waits = WaitingConnections(per_client=2)
    assert waits.wait("a1", "10.0.0.1", deadline=5.0) is None
    assert waits.wait("b1", "10.0.0.2") is None
    assert waits.wait("a2", "10.0.0.1") is None
    assert waits.wait("a3", "10.0.0.1", deadline=7.0) == "a1"
    waits.done("a1")
    assert waits.oldest() == "b1" and len(waits) == 3
    assert waits.expired(6.0) == [] and waits.next_deadline() == 7.0
    assert waits.expired(7.0) == ["a3"]
    waits.done("a3")
    assert waits.next_deadline() is None and not waits.waiting_for_head("a2") and "a2" in waits


POST = b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"


def test_a_head_read_off_the_socket_goes_to_rank_0_with_what_was_read(loop):
    """A head past PEEK_BYTES, or one that came in more than PEEKS pieces, is read off the socket,
    and still handed to rank 0: with what was read (the Attach's prefix), no request thread."""
    loop.worker.early = early = Early()
    big = POST.replace(b"Host: x\r\n", b"".join(b"X-F%d: %s\r\n" % (i, b"v" * 7000) for i in range(10)))
    assert len(big) > PEEK_BYTES
    client, conn = loop.connect(big[:PEEK_BYTES + 10])
    loop.turn()
    client.sendall(big[PEEK_BYTES + 10 :])
    loop.turn()
    pieces = [POST[i : i + 8] for i in range(0, len(POST), 8)]
    assert len(pieces) > PEEKS + 1
    slow, slow_conn = loop.connect(pieces[0])
    for piece in pieces[1:]:
        loop.turn(0.05)
        slow.sendall(piece)
    loop.turn()
    assert loop.threads == [] and [data for data, _ in early.sent] == [big, POST]
    assert all(data == ahead for data, ahead in early.sent)  # all of it was read here: the prefix
    assert conn not in loop.worker.waits and slow_conn not in loop.worker.waits


def test_a_request_gunicorn_read_ahead_after_an_answer_goes_to_rank_0_with_it(loop):
    """A handler's request pipelined after a request a thread served (GET /models): gunicorn read it
    ahead; the thread leaves it to the main loop (next_head_here), which hands it to rank 0 with
    those bytes."""
    loop.worker.early = early = Early()
    _, conn = loop.connect(b"GET /models HTTP/1.1\r\nHost: x\r\n\r\n" + POST)
    assert loop.threads == [conn] and early.sent == []
    conn.init()
    request = next(conn.parser)  # the thread's gunicorn reads the first request, and the next ahead
    assert request.path == "/models" and read_ahead(conn) == POST
    assert loop.worker.next_head_here(conn) is None  # rank 0's: the main loop hands it over
    loop.worker.enqueue_req(conn)  # (gthread's finish_request, seeing bytes read ahead)
    assert early.sent == [(POST, POST)] and loop.threads == [conn]
