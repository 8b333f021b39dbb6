"""Clients that send their requests slowly, against a real server (tests/model_dirs/lmi_echo):
more connections than the frontend has request threads, each holding half a request head, or a
whole head and half a body. /ping and other clients must still be served, and the server must
close the slow connections itself (408) within their deadlines."""

import json
import selectors
import socket
import time

import pytest
import requests

from tests.reliability import record
from tests.server import MODEL_DIRS, Server

HEADER_READ_TIMEOUT = 5
# Long enough that the pings of the half-body test come before the bodies' 408s on a loaded machine
# (opening a thousand connections, and a thread for each, took a while at load 28).
BODY_READ_TIMEOUT = 20
PER_CLIENT = 1000  # max_connections_per_client: fewer than the connections a test opens from 127.0.0.1
CONNECTIONS = 1100  # more than the frontend's request threads (job_queue_size 1000 + 32)


@pytest.fixture(scope="module")
def server():
    env = {
        "SERVING_HEADER_READ_TIMEOUT": str(HEADER_READ_TIMEOUT),
        "SERVING_BODY_READ_TIMEOUT": str(BODY_READ_TIMEOUT),
        "SERVING_MAX_CONNECTIONS_PER_CLIENT": str(PER_CLIENT),
    }
    with Server(MODEL_DIRS / "lmi_echo", env=env) as s:
        yield s


def open_connections(port: int, count: int, data) -> list[tuple[socket.socket, float]]:
    """``count`` connections to the server, each sent ``data(i)``; with the time each was opened."""
    opened = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(data(i))
        opened.append((sock, time.monotonic()))
    return opened


def ping_seconds(server: Server) -> float:
    started = time.monotonic()
    r = requests.get(server.url("/ping"), timeout=30)
    assert r.status_code == 200, r.text
    return time.monotonic() - started


def held(opened: list[tuple[socket.socket, float]]) -> int:
    """How many of the ``opened`` connections the server has neither answered nor closed yet."""
    with selectors.DefaultSelector() as selector:
        for sock, _ in opened:
            selector.register(sock, selectors.EVENT_READ)
        return len(opened) - len(selector.select(timeout=0))


def read_to_end(opened: list[tuple[socket.socket, float]], timeout: float) -> list[tuple[bytes, float]]:
    """Everything the server sent on each connection until it closed it, and when it closed it
    (seconds after the connection was opened); ``inf`` for one still open after ``timeout``."""
    received = {sock: b"" for sock, _ in opened}
    closed: dict[socket.socket, float] = {}
    selector = selectors.DefaultSelector()
    for sock, _ in opened:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while len(closed) < len(opened) and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=0.2):
            try:
                data = key.fileobj.recv(65536)
            except ConnectionResetError:
                data = b""
            if data:
                received[key.fileobj] += data
            else:
                closed[key.fileobj] = time.monotonic()
                selector.unregister(key.fileobj)
    selector.close()
    result = [(received[sock], closed.get(sock, float("inf")) - at) for sock, at in opened]
    for sock, _ in opened:
        sock.close()
    return result


def answer(data: bytes) -> tuple[int, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert "connection: close" in (line.lower() for line in lines[1:]), head
    return int(lines[0].split()[1]), json.loads(body)


def half_a_head(i: int) -> bytes:
    """Mostly health checks, a fifth of them streamed requests (OpenAI's envelope on /v1)."""
    if i % 10 > 1:
        return b"GET /ping HTTP/1.1\r\nHost: x\r\nUser-Ag"
    path = "/v1/chat/completions" if i % 10 == 0 else "/invocations"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: appli".encode()


def test_connections_holding_half_a_head_cost_no_thread_and_are_closed_with_408(server):
    opened = open_connections(server.port, CONNECTIONS, half_a_head)
    time.sleep(2)  # whatever the server does with them first is done
    pings = [ping_seconds(server) for _ in range(3)]
    started = time.monotonic()
    r = server.invoke({"inputs": "served meanwhile"}, timeout=30)
    served_in = time.monotonic() - started
    assert r.status_code == 200 and r.json()["echo"]["inputs"] == "served meanwhile"
    # Answered while the connections within the cap still waited for their deadline (each would be
    # answered 408 by then): /ping and the request did not wait for a thread a slow client held.
    assert held(opened) >= PER_CLIENT // 2, (held(opened), pings, served_in)

    ends = read_to_end(opened, HEADER_READ_TIMEOUT + 10)
    late = [seconds for _, seconds in ends if seconds > HEADER_READ_TIMEOUT + 1.5]
    assert not late, f"{len(late)} connections closed late (first: {late[0]:.1f}s after they opened)"
    by_cap = by_deadline = 0
    for i, (data, _) in enumerate(ends):
        status, body = answer(data)
        assert status == 408
        if i % 10 == 0:
            assert body["error"]["code"] == 408 and body["error"]["type"] == "BadRequestError", body
            error = body["error"]["message"]
        else:
            assert body["code"] == 408 and body["message"] == "request timeout", body
            error = body["error"]
        by_cap += "max_connections_per_client" in error
        by_deadline += f"within {HEADER_READ_TIMEOUT}s (header_read_timeout" in error
    # The oldest connections beyond the cap were closed for the newer ones, the rest at the deadline
    assert by_cap >= CONNECTIONS - PER_CLIENT and by_cap + by_deadline == CONNECTIONS, (by_cap, by_deadline)
    assert ping_seconds(server) < 30
    record("slow-heads", "Connections that send half a request head", {
        "connections": f"{CONNECTIONS} from one address, each sent half a head and then nothing",
        "request threads": "1032 (job_queue_size 1000 + 32)",
        "header_read_timeout (SERVING_HEADER_READ_TIMEOUT)": f"{HEADER_READ_TIMEOUT} s (default 10 s)",
        "max_connections_per_client (SERVING_MAX_CONNECTIONS_PER_CLIENT)": f"{PER_CLIENT}",
        "/ping while they were held": f"200 in {max(pings) * 1000:.0f} ms at most (3 tries)",
        "a request sent meanwhile": f"200 in {served_in * 1000:.0f} ms",
        "answers": f"408 to all: {by_cap} closed for newer connections past the cap, {by_deadline} at the deadline",
        "latest close after its connection opened": f"{max(s for _, s in ends):.2f} s"},
        note="Before the fix each such connection held a request thread with no deadline; /ping got no "
             "thread and was not answered.")


def half_a_body(i: int) -> bytes:
    # a handler route: rank 0 reads the body (job_queue_size of them), the main loop refuses the rest
    return b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"in"


def test_ping_is_answered_while_every_request_thread_waits_for_a_body(server):
    opened = open_connections(server.port, 1040, half_a_body)
    time.sleep(2)  # the worker reads the bodies of the first 1000 (job_queue_size); the rest are refused
    # A request thread (the management routes) is still served: the worker, not a thread, waits for those bodies
    assert requests.get(server.url("/models"), timeout=10).status_code == 200
    pings = [ping_seconds(server) for _ in range(3)]
    # Answered while the connections within the cap still waited for their bodies: /ping did not wait
    # for them (they are read until body_read_timeout answers them 408).
    assert held(opened) >= PER_CLIENT // 2, (held(opened), pings)
    ends = read_to_end(opened, 2 * BODY_READ_TIMEOUT + 20)
    silent = [(i, round(closed_at, 2)) for i, (data, closed_at) in enumerate(ends) if not data]
    assert not silent, f"{len(silent)} not answered: (connection, seconds until closed, inf: still open) {silent[:20]}"
    statuses = [answer(data)[0] for data, _ in ends]
    # Those past job_queue_size are refused at once (503, the queue is full), without waiting for their bodies
    assert sorted(statuses) == [408] * 1000 + [503] * 40, {code: statuses.count(code) for code in set(statuses)}
    refused = [(answer(data)[1], closed_at) for data, closed_at in ends if answer(data)[0] == 503]
    assert all("queue is full" in body["error"]["message"] and closed_at < 10 for body, closed_at in refused)
    error = answer(ends[statuses.index(408)][0])[1]["error"]["message"]
    assert f"did not arrive within {BODY_READ_TIMEOUT}s (body_read_timeout" in error
