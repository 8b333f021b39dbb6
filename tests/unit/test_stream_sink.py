"""A stream's chunks written to the client by the group client's reader thread
(``PendingRequest.attach`` with the frontend's ``ClientSink``), over real
sockets and gunicorn's own request parsing and response framing."""

import socket
import threading

import pytest
from gunicorn.config import Config
from gunicorn.http import wsgi
from gunicorn.http.parser import RequestParser

from container.core.errors import ClientClosedRequest
from container.core.ingress import framing, response_head
from container.core.protocol import Chunk, End, Fail, Head, ResponseHead
from container.frontend.client import ClientSink
from container.frontend.pending import PendingRequest
from container.frontend.server import GunicornBridge


def read_until(sock: socket.socket, ending: bytes, timeout: float = 5) -> bytes:
    sock.settimeout(timeout)
    got = b""
    while not got.endswith(ending):
        part = sock.recv(1 << 16)
        assert part, f"connection closed after {got!r}"
        got += part
    return got


def gunicorn_stream(http_version: str = "1.1"):
    """A request parsed by gunicorn from a real socket, and its streamed answer
    begun through ``GunicornBridge``: (gunicorn's response, environ, the client's end)."""
    server_end, client_end = socket.socketpair()
    client_end.sendall(f"POST /invocations HTTP/{http_version}\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
    cfg = Config()
    req = next(iter(RequestParser(cfg, server_end, ("127.0.0.1", 1))))
    resp, environ = wsgi.create(req, server_end, ("127.0.0.1", 1), ("127.0.0.1", 8080), cfg)
    environ["gunicorn.socket"] = server_end

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "application/jsonlines")])
        return iter(())

    GunicornBridge(app)(environ, resp.start_response)
    return resp, environ, client_end


def streaming(resp, first: bytes) -> PendingRequest:
    pending = PendingRequest("r1")
    pending.deliver([Head(id="r1", code=200, headers={}, stream=True), Chunk(id="r1", data=first)])
    assert pending.next_data(0) == first
    resp.write(first)  # the request thread's first write sends the headers
    return pending


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%X\r\n%s\r\n" % (len(p), p) for p in pieces)


def test_the_reader_thread_writes_each_batch_in_gunicorns_framing_without_waking_the_request_thread():
    resp, environ, client = gunicorn_stream()
    pending = streaming(resp, b"one\n")
    sink = ClientSink.of(environ)
    assert sink is not None and sink.chunked
    pending.attach(sink)
    assert not pending.wait_data_for(0)  # the request thread goes back to waiting

    pending.deliver([Chunk(id="r1", data=b"two\n")])
    pending.deliver([Chunk(id="r1", data=b"three\n"), Chunk(id="r1", data=b"four\n")])
    assert not pending.wait_data_for(0)  # nothing left for it: all written by the reader
    assert pending.progress == 3

    pending.deliver([End(id="r1")])
    assert pending.wait_data_for(0) and pending.next_data(0) is None
    resp.close()  # gunicorn's last chunk
    got = read_until(client, b"0\r\n\r\n")
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    # one write, one HTTP chunk, per batch the reader received
    assert body == chunked(b"one\n", b"two\n", b"three\nfour\n") + b"0\r\n\r\n"


def test_an_http_1_0_client_gets_the_rest_unframed():
    resp, environ, client = gunicorn_stream("1.0")
    pending = streaming(resp, b"one\n")
    sink = ClientSink.of(environ)
    assert sink is not None and not sink.chunked
    pending.attach(sink)
    assert not pending.wait_data_for(0)
    pending.deliver([Chunk(id="r1", data=b"two\n"), End(id="r1")])
    assert pending.next_data(0) is None
    assert read_until(client, b"two\n").endswith(b"\r\n\r\none\ntwo\n")


def test_no_sink_before_the_headers_are_sent_or_without_gunicorn():
    resp, environ, _ = gunicorn_stream()
    assert ClientSink.of(environ) is None  # gunicorn sends its headers with the first piece
    assert ClientSink.of({}) is None  # e.g. Flask's test client
    resp.write(b"x")
    assert ClientSink.of(environ) is not None


def test_what_a_slow_client_does_not_take_is_left_to_the_request_thread_in_order():
    resp, environ, client = gunicorn_stream()
    server_end = environ["gunicorn.socket"]
    server_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    pending = streaming(resp, b"first\n")
    pending.attach(ClientSink.of(environ))
    assert not pending.wait_data_for(0)

    big = [bytes([65 + i]) * 300_000 for i in range(3)]  # far more than the socket buffer holds
    pending.deliver([Chunk(id="r1", data=big[0])])  # partly written by the reader, the rest left over
    pending.deliver([Chunk(id="r1", data=big[1])])  # queued behind it
    assert pending.wait_data_for(0)

    received = []
    reader = threading.Thread(target=lambda: received.append(read_until(client, b"0\r\n\r\n", timeout=20)))
    reader.start()
    # the request thread's loop: send what the sink left (answer b""), then what queued, as gunicorn writes it
    assert pending.next_data(0) == b""
    assert pending.wait_data_for(0)
    assert pending.next_data(0) == big[1]
    resp.write(big[1])
    assert not pending.wait_data_for(0)  # caught up: the reader thread writes again
    pending.deliver([Chunk(id="r1", data=big[2]), End(id="r1")])
    while (data := pending.next_data(5)) is not None:
        resp.write(data)
    resp.close()
    reader.join(20)
    body = received[0].partition(b"\r\n\r\n")[2]
    assert body == chunked(b"first\n", *big) + b"0\r\n\r\n"


def test_a_client_gone_mid_stream_fails_the_request_and_later_chunks_are_dropped():
    resp, environ, client = gunicorn_stream()
    pending = streaming(resp, b"one\n")
    pending.attach(ClientSink.of(environ))
    assert not pending.wait_data_for(0)
    client.close()
    for _ in range(3):  # the first write after the peer closed may still succeed
        pending.deliver([Chunk(id="r1", data=b"more\n")])
    assert pending.wait_data_for(0)
    with pytest.raises(ClientClosedRequest):
        pending.next_data(0)
    assert pending.done and not pending._chunks


def test_an_error_after_direct_writes_reaches_the_request_thread():
    resp, environ, client = gunicorn_stream()
    pending = streaming(resp, b"one\n")
    pending.attach(ClientSink.of(environ))
    assert not pending.wait_data_for(0)
    pending.deliver([Chunk(id="r1", data=b"two\n"), Fail(id="r1", code=424, message="m", error="boom")])
    assert pending.wait_data_for(0)
    with pytest.raises(Exception, match="boom"):
        pending.next_data(0)
    assert read_until(client, chunked(b"two\n")).endswith(chunked(b"one\n", b"two\n"))


def test_after_take_over_the_reader_leaves_every_chunk_to_the_request_thread():
    resp, environ, client = gunicorn_stream()
    pending = streaming(resp, b"one\n")
    pending.attach(ClientSink.of(environ))
    assert not pending.wait_data_for(0)
    pending.take_over()  # e.g. to write an in-band error of its own
    pending.deliver([Chunk(id="r1", data=b"late\n")])
    assert pending.wait_data_for(0) and pending.next_data(0) == b"late\n"


@pytest.mark.parametrize(("http_version", "request_header"), [("1.1", ""), ("1.0", ""), ("1.1", "Connection: close\r\n")])
def test_the_head_the_worker_writes_for_a_request_is_the_one_gunicorn_writes_for_it(http_version, request_header):
    """``response_head`` (the worker's writer, given what the frontend puts in a head: version,
    server, keep-alive, its headers) makes the same bytes as gunicorn's own ``send_headers`` for
    a streamed answer, the date aside."""
    server_end, client_end = socket.socketpair()
    client_end.sendall(
        f"POST /invocations HTTP/{http_version}\r\nHost: x\r\n{request_header}Content-Length: 0\r\n\r\n".encode()
    )
    cfg = Config()
    req = next(iter(RequestParser(cfg, server_end, ("127.0.0.1", 1))))
    resp, environ = wsgi.create(req, server_end, ("127.0.0.1", 1), ("127.0.0.1", 8080), cfg)
    given = ResponseHead(f"HTTP/{http_version}", resp.version, bool(req.should_close()), {"X-Ours": "1"})
    ours = response_head(given, 200, {"Content-Type": "application/jsonlines"}, None)
    resp.start_response("200 OK", [("Content-Type", "application/jsonlines"), ("X-Ours", "1")])
    resp.send_headers()
    theirs = read_until(client_end, b"\r\n\r\n")

    def undated(head: bytes) -> list[bytes]:
        return [line for line in head.split(b"\r\n") if not line.startswith(b"Date: ")]

    assert framing(given, whole=False)[0] == (http_version == "1.1") == resp.chunked
    assert undated(ours) == undated(theirs)
    server_end.close()
    client_end.close()
