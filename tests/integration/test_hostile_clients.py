"""Clients that break HTTP's rules, against a real server (tests/model_dirs/lmi_echo):
oversized chunked bodies, bodies shorter than their Content-Length, bytes gunicorn
rejects before the app sees them. Raw sockets, since ``requests`` will not send these."""

import http.client
import json
import socket
import threading
import time

import pytest
import requests

from tests.server import MODEL_DIRS, Server

BODY_READ_TIMEOUT = 2


@pytest.fixture(scope="module")
def server():
    with Server(MODEL_DIRS / "lmi_echo", env={"SERVING_BODY_READ_TIMEOUT": str(BODY_READ_TIMEOUT)}) as s:
        yield s


def send(port: int, head: str, body: bytes = b"", close_write: bool = False,
         timeout: float = 30) -> tuple[http.client.HTTPResponse, float]:
    """Send ``head`` (request line and headers, CRLF-separated, without the blank
    line) and ``body`` from a thread; return the response and the seconds it took."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)

    def write() -> None:
        try:
            sock.sendall(head.encode("latin-1") + b"\r\n\r\n" + body)
            if close_write:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server answered and closed before taking it all: what some tests want

    started = time.monotonic()
    threading.Thread(target=write, daemon=True).start()
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.body = response.read()
    elapsed = time.monotonic() - started
    sock.close()
    return response, elapsed


def chunked(data: bytes, size: int = 65536) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(data[i:i + size]), data[i:i + size]) for i in range(0, len(data), size))


def test_a_chunked_body_over_the_limit_is_413_without_reading_the_rest(server):
    # 8 MiB announced by nothing but its chunks, and never terminated: the answer must
    # come once the limit is passed, not when the body ends (it never does).
    head = "POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked"
    r, elapsed = send(server.port, head, chunked(b" " * (8 * 1024 * 1024)))
    assert r.status == 413, r.body
    assert json.loads(r.body) == {"code": 413, "message": "payload too large", "error": json.loads(r.body)["error"]}
    assert "6291456 bytes" in json.loads(r.body)["error"]
    assert r.getheader("Connection") == "close"
    assert elapsed < 10
    assert server.invoke({"inputs": "after"}).status_code == 200


def test_a_chunked_body_under_the_limit_is_served_whole(server):
    body = json.dumps({"inputs": "x" * (5 * 1024 * 1024)}).encode()
    head = "POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked"
    r, _ = send(server.port, head, chunked(body) + b"0\r\n\r\n")
    assert r.status == 200
    assert len(json.loads(r.body)["echo"]["inputs"]) == 5 * 1024 * 1024


SHORT_BODY = b'{"fail": "the handler ran"}'  # valid JSON as it is: a truncated request would run


def handler_ran(server: Server, request_id: str) -> bool:
    return any(f"[{request_id}]" in line and "handler failed" in line for line in server.log().splitlines())


def test_a_body_shorter_than_its_content_length_is_400_after_the_body_read_timeout(server):
    head = ("POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"X-Amzn-SageMaker-Inference-Id: short-stalled\r\nContent-Length: {len(SHORT_BODY) + 1000}")
    r, elapsed = send(server.port, head, SHORT_BODY, timeout=BODY_READ_TIMEOUT + 10)
    assert r.status == 400, r.body
    error = json.loads(r.body)
    assert error["code"] == 400 and "body_read_timeout" in error["error"]
    assert f"all {len(SHORT_BODY) + 1000} bytes" in error["error"]
    assert BODY_READ_TIMEOUT - 0.5 < elapsed < BODY_READ_TIMEOUT + 2
    assert r.getheader("Connection") == "close"
    time.sleep(0.5)
    assert not handler_ran(server, "short-stalled")
    assert server.invoke({"inputs": "after"}).status_code == 200


def test_a_body_cut_short_by_the_client_leaving_is_never_run(server):
    head = ("POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"X-Amzn-SageMaker-Inference-Id: short-closed\r\nContent-Length: {len(SHORT_BODY) + 1000}")
    r, elapsed = send(server.port, head, SHORT_BODY, close_write=True)
    assert r.status == 400, r.body
    assert "ended after" in json.loads(r.body)["error"]
    assert elapsed < 1
    time.sleep(0.5)
    assert not handler_ran(server, "short-closed")


def test_a_stalled_chunked_body_is_400_after_the_body_read_timeout(server):
    head = "POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked"
    r, elapsed = send(server.port, head, chunked(SHORT_BODY), timeout=BODY_READ_TIMEOUT + 10)
    assert r.status == 400, r.body
    assert "body_read_timeout" in json.loads(r.body)["error"]
    assert elapsed < BODY_READ_TIMEOUT + 2
