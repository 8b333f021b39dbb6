"""What the frontend's gthread worker does after an answer on a kept-alive connection
(``DrainingWorker.handle`` in container/frontend/server.py): it looks at the client's socket
once. A client that closed it is let go at once, a next request whose head is there whole is
served in the same thread, and otherwise the connection goes back to gthread's main loop.
gthread's own ``handle`` (one request) is replaced here by one that answers from a list;
tests/integration/test_requests.py and the e2e tests run the real one."""

import io
import socket
import ssl
from types import SimpleNamespace

import pytest
from gunicorn.workers.gthread import ThreadWorker

from container.frontend.server import DrainingWorker


@pytest.fixture
def sockets():
    server, client = socket.socketpair()
    yield server, client
    server.close()
    client.close()


def kept(sock) -> SimpleNamespace:
    """A kept-alive connection (gthread's ``TConn`` once its first request was parsed)."""
    parser = SimpleNamespace(unreader=SimpleNamespace(buf=io.BytesIO()))
    return SimpleNamespace(sock=sock, is_http2=False, initialized=True, data_ready=True, parser=parser)


def worker(monkeypatch, keepalive: list[bool]) -> tuple[DrainingWorker, list]:
    """A worker whose gthread ``handle`` answers one request with the next of ``keepalive``."""
    served: list = []

    def handle(self, conn):
        served.append(conn)
        return keepalive.pop(0)

    monkeypatch.setattr(ThreadWorker, "handle", handle)
    instance = object.__new__(DrainingWorker)
    instance.alive = True
    return instance, served


def test_a_client_that_closed_its_connection_is_let_go_at_once(monkeypatch, sockets):
    server, client = sockets
    instance, served = worker(monkeypatch, [True])
    client.close()
    assert instance.handle(kept(server)) is False
    assert len(served) == 1


def test_a_next_request_already_sent_is_served_in_the_same_thread(monkeypatch, sockets):
    server, client = sockets
    instance, served = worker(monkeypatch, [])
    conn = kept(server)

    def handle(self, c):
        served.append(c)
        if len(served) == 1:
            client.sendall(b"GET /ping HTTP/1.1\r\n\r\n")  # the client's next request, sent meanwhile
        else:
            server.recv(65536)  # read, as gthread's parser reads it
        return True

    monkeypatch.setattr(ThreadWorker, "handle", handle)
    assert instance.handle(conn) is True
    assert len(served) == 2  # the second request, then nothing more: back to the main loop


def test_a_next_request_whose_head_is_not_whole_yet_goes_back_to_the_main_loop(monkeypatch, sockets):
    server, client = sockets
    client.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n")  # the rest may never come: no thread waits for it
    instance, served = worker(monkeypatch, [True])
    assert instance.handle(kept(server)) is True
    assert len(served) == 1


def test_a_connection_with_nothing_sent_yet_goes_back_to_the_main_loop(monkeypatch, sockets):
    server, _client = sockets
    instance, served = worker(monkeypatch, [True])
    assert instance.handle(kept(server)) is True
    assert len(served) == 1


def test_an_answer_that_closes_the_connection_or_a_stopping_worker_is_not_looked_past(monkeypatch, sockets):
    server, client = sockets
    client.sendall(b"GET /ping HTTP/1.1\r\n\r\n")
    instance, served = worker(monkeypatch, [False])
    assert instance.handle(kept(server)) is False
    instance, served = worker(monkeypatch, [True])
    instance.alive = False
    assert instance.handle(kept(server)) is True
    assert len(served) == 1


def test_a_socket_that_cannot_be_peeked_is_left_to_gthread(monkeypatch, sockets):
    server, client = sockets
    client.close()
    instance, served = worker(monkeypatch, [True])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    wrapped = context.wrap_socket(socket.socket(), server_side=True, do_handshake_on_connect=False)
    try:
        assert instance.handle(kept(wrapped)) is True
    finally:
        wrapped.close()
