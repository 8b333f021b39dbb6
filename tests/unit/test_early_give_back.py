"""What the frontend does with a connection it handed to rank 0 unread (container/frontend/early.py)
when rank 0 declines it, or goes away before saying it read the request: the connection is the
server's again (served by a request thread, or closed), its admission released, nothing lost."""

import socket
from types import SimpleNamespace

import pytest

from container.core.errors import ServiceUnavailable
from container.core.protocol import Taken
from container.frontend.early import EarlyRequest, EarlyRequests
from container.frontend.pending import PendingRequest

REQUEST = b'POST /invocations HTTP/1.1\r\nContent-Length: 16\r\n\r\n{"stream": true}'


class Server:
    """The router's admission count and the server's side of the connection, as early.py uses them."""

    def __init__(self) -> None:
        self.released = 0
        self.done: list[tuple] = []

    def release(self) -> None:
        self.released += 1

    def requeue(self, conn, raw: bytes) -> None:
        self.done.append(("requeue", raw))

    def let_go(self, conn, keep: bool) -> None:
        self.done.append(("let_go", keep))


@pytest.fixture
def handed():
    """An EarlyRequests with one request handed over, and the client's end of its connection."""
    client, ours = socket.socketpair()
    server = Server()
    metrics = SimpleNamespace(read_early=SimpleNamespace(inc=lambda: None))
    early_requests = EarlyRequests(server, None, SimpleNamespace(metrics=metrics), enabled=True)
    early_requests.connections = server
    early = EarlyRequest(SimpleNamespace(name="0"), 0.0, SimpleNamespace(sock=ours), False)
    early_requests._sent[ours] = early
    yield early_requests, early, PendingRequest("w1"), client, server
    client.close()
    ours.close()


def test_a_declined_request_is_served_by_the_server_after_what_rank_0_read(handed):
    early_requests, early, pending, client, server = handed
    pending.deliver([Taken(id="w1", served=False, raw=b"PO")])
    early_requests._heard(early, pending)
    assert server.done == [("requeue", b"PO")] and server.released == 1
    assert early_requests.adopt(early.conn.sock) is None  # no request thread follows it as rank 0's


@pytest.mark.parametrize(("sent", "done"), [(REQUEST, ("requeue", b"")), (b"", ("let_go", False))])
def test_a_group_gone_before_it_read_the_request_gives_the_connection_back_or_closes_it(handed, sent, done):
    """The request still on the socket: a request thread serves it (another group may); not
    there (rank 0 read it, then went away): the connection is closed."""
    early_requests, early, pending, client, server = handed
    if sent:
        client.sendall(sent)
    pending.fail(ServiceUnavailable("worker group 0 stopped"))
    early_requests._heard(early, pending)
    assert server.done == [done] and server.released == 1


def test_a_request_rank_0_read_and_then_failed_goes_to_a_thread_with_its_bytes(handed):
    early_requests, early, pending, client, server = handed
    pending.deliver([Taken(id="w1", served=True, request_id="r", path="/invocations", raw=REQUEST, close=False)])
    early_requests._heard(early, pending)
    assert (early.request_id, early.path, early.raw) == ("r", "/invocations", REQUEST)
    assert pending.tag == (early.print_, "r", "/invocations") and early.print_
    assert server.done == []
    pending.fail(ServiceUnavailable("worker group 0 stopped"))
    early_requests._heard(early, pending)
    assert server.done == [("requeue", REQUEST)] and server.released == 0  # the thread releases it
    assert early_requests.adopt(early.conn.sock) is early
