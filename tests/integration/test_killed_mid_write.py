"""A worker killed (SIGKILL) while it writes a stream to a slow client: what reaches the client is
valid HTTP/1.1, as a client's HTTP library (h11) reads it. The answer either ends with a complete
chunked body (the last item an error in the route's envelope), or the connection closes, and nothing
follows a torn chunk."""

import json
import os
import signal
import socket
import time

import h11
import pytest

from tests.server import MODEL_DIRS, Server

CHUNK = 256 * 1024  # each line of the stream: several TCP segments, so the worker's sends end mid-chunk
SLOW_RECEIVE = 4096  # the client's receive buffer
KILL_AFTER = 128 * 1024  # body bytes the client takes before the worker is killed
FILL = 1.5  # seconds the client stops reading before the kill: the server's socket fills up
SETTLE = 20.0  # seconds the rest of the answer may take after the kill


@pytest.fixture(scope="module")
def server():
    with Server(MODEL_DIRS / "lmi_echo", env={"OPTION_SYNC_HANDLER_THREADS": "2"}) as s:
        yield s


class Received:
    """What the client read, parsed as it came by a client-side ``h11.Connection``."""

    def __init__(self) -> None:
        self.conn = h11.Connection(h11.CLIENT)
        self.response: h11.Response | None = None
        self.body = b""
        self.raw = b""
        self.ended = False  # the chunked body's terminating chunk came
        self.closed = False  # the server closed the connection

    def request(self, path: str, payload: dict) -> bytes:
        body = json.dumps(payload).encode()
        head = h11.Request(method="POST", target=path, headers=[
            ("Host", "test"), ("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return self.conn.send(head) + self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())

    def feed(self, data: bytes) -> None:
        """Parse ``data`` (``b""``: the connection closed); raises ``h11.RemoteProtocolError`` on
        anything that is not valid HTTP, except a close before the body's end."""
        self.raw += data
        self.conn.receive_data(data)
        self.closed = not data
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError:
                if self.closed and self.response is not None and not self.ended:
                    return  # a body cut short by the close: incomplete, not invalid
                raise
            if event in (h11.NEED_DATA, h11.PAUSED) or isinstance(event, h11.ConnectionClosed):
                return
            if isinstance(event, h11.Response):
                self.response = event
            elif isinstance(event, h11.Data):
                self.body += event.data
            elif isinstance(event, h11.EndOfMessage):
                self.ended = True

    def body_bytes(self) -> int:
        return len(self.body)


def _killed_mid_write(server: Server, path: str, payload: dict) -> Received:
    """Stream ``payload`` to a client reading a few bytes at a time, SIGKILL the worker once the
    client took ``KILL_AFTER`` bytes of the body, then read the rest of the answer."""
    received = Received()
    (worker,) = server.worker_pids()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_RECEIVE)
        sock.settimeout(30)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(received.request(path, payload))
        while received.body_bytes() < KILL_AFTER:
            data = sock.recv(512)
            assert data, f"the connection closed before the kill: {received.raw[:300]!r}"
            received.feed(data)
            time.sleep(0.001)
        time.sleep(FILL)  # the worker's last send took part of a chunk, the rest waits in the worker
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + SETTLE
        sock.settimeout(1)
        while not (received.ended or received.closed):
            assert time.monotonic() < deadline, (
                f"neither the body's end nor a close within {SETTLE:g}s of the kill: the client is left waiting "
                f"(last bytes {received.raw[-120:]!r})")
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            received.feed(data)
    server.wait_until(lambda r: r.status_code == 200, timeout=60)  # the group is back for the next test
    return received


def _items(body: bytes, sse: bool) -> list[bytes]:
    return [item for item in body.split(b"\n\n" if sse else b"\n") if item]


@pytest.mark.parametrize(("path", "sse"), [("/invocations", False), ("/v1/chat/completions", True)])
def test_a_worker_killed_while_writing_to_a_slow_client_leaves_valid_http(server, path, sse):
    payload = {"stream": True, "big_lines": {"count": 400, "size": CHUNK, "every": 0.005, "sse": sse}}
    received = _killed_mid_write(server, path, payload)
    assert received.response is not None and received.response.status_code == 200
    if received.ended:  # whole: the last item is a well-formed error in the route's envelope
        items = _items(received.body, sse)
        if sse:
            assert items[-1] == b"data: [DONE]", items[-1][:200]
            error = json.loads(items[-2].removeprefix(b"data: "))
            assert error["error"]["code"] == 503, error
        else:
            error = json.loads(items[-1])
            assert error["code"] == 503, error
    else:  # closed, mid-chunk or not: an incomplete answer, nothing written after the torn chunk
        assert received.closed
    assert "Traceback" not in server.log()
