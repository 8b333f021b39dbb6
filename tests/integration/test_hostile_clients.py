"""Clients that break HTTP's rules, against a real server (tests/model_dirs/lmi_echo):
oversized chunked bodies, bodies shorter than their Content-Length, bytes gunicorn
rejects before the app sees them. Raw sockets, since ``requests`` will not send these.
Slow clients, many at once: tests/integration/test_slow_clients.py."""

import http.client
import json
import socket
import threading
import time

import pytest
import requests

from tests.reliability import record
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
    record("chunked-over-limit", "A chunked body over the size limit", {
        "body sent": "8 MiB in 64 KiB chunks, never terminated", "limit": "6 MiB (max_payload_in_mb)",
        "answer": f"{r.status}, Connection: close", "seconds to the answer": f"{elapsed:.2f}",
        "next request": "200"}, note="Before the fix the body was cut at 6 MiB and served with 200.")


def test_a_chunked_body_under_the_limit_is_served_whole(server):
    body = json.dumps({"inputs": "x" * (5 * 1024 * 1024)}).encode()
    head = "POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked"
    r, _ = send(server.port, head, chunked(body) + b"0\r\n\r\n")
    assert r.status == 200
    assert len(json.loads(r.body)["echo"]["inputs"]) == 5 * 1024 * 1024


SHORT_BODY = b'{"fail": "the handler ran"}'  # valid JSON as it is: a truncated request would run


def handler_ran(server: Server, request_id: str) -> bool:
    return any(f"[{request_id}]" in line and "handler failed" in line for line in server.log().splitlines())


def test_a_body_shorter_than_its_content_length_is_408_after_the_body_read_timeout(server):
    head = ("POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"X-Amzn-SageMaker-Inference-Id: short-stalled\r\nContent-Length: {len(SHORT_BODY) + 1000}")
    r, elapsed = send(server.port, head, SHORT_BODY, timeout=BODY_READ_TIMEOUT + 10)
    assert r.status == 408, r.body
    error = json.loads(r.body)
    assert error == {"code": 408, "message": "request timeout", "error": error["error"]}
    assert "body_read_timeout" in error["error"]
    assert f"all {len(SHORT_BODY) + 1000} bytes" in error["error"]
    assert BODY_READ_TIMEOUT - 0.5 < elapsed < BODY_READ_TIMEOUT + 2
    assert r.getheader("Connection") == "close"
    time.sleep(0.5)
    assert not handler_ran(server, "short-stalled")
    assert server.invoke({"inputs": "after"}).status_code == 200
    record("stalled-body", "A body that never arrives", {
        "Content-Length": f"{len(SHORT_BODY) + 1000} bytes, {len(SHORT_BODY)} sent",
        "body_read_timeout (SERVING_BODY_READ_TIMEOUT)": f"{BODY_READ_TIMEOUT} s (default 60 s)",
        "answer": f"{r.status} after {elapsed:.2f} s", "handler ran": "no", "next request": "200"},
        note="Before the fix a thread was held for as long as the client stayed (330 s seen), then the "
             "truncated request ran.")


def test_a_body_cut_short_by_the_client_leaving_is_never_run(server):
    head = ("POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"X-Amzn-SageMaker-Inference-Id: short-closed\r\nContent-Length: {len(SHORT_BODY) + 1000}")
    r, elapsed = send(server.port, head, SHORT_BODY, close_write=True)
    assert r.status == 400, r.body
    assert "ended after" in json.loads(r.body)["error"]
    assert elapsed < 1
    time.sleep(0.5)
    assert not handler_ran(server, "short-closed")


def test_a_stalled_chunked_body_is_408_after_the_body_read_timeout(server):
    head = "POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked"
    r, elapsed = send(server.port, head, chunked(SHORT_BODY), timeout=BODY_READ_TIMEOUT + 10)
    assert r.status == 408, r.body
    assert "body_read_timeout" in json.loads(r.body)["error"]
    assert elapsed < BODY_READ_TIMEOUT + 2


def openai_error(body: bytes, status: int) -> dict:
    """The error of an OpenAI-shaped error body, checked for its shape."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    return error


def test_header_bytes_gunicorn_rejects_get_a_json_400(server):
    r, _ = send(server.port, "POST /invocations HTTP/1.1\r\nHost: x\r\nBad\x01Name: y\r\nContent-Length: 2", b"{}")
    assert r.status == 400
    assert r.getheader("Content-Type") == "application/json"
    body = json.loads(r.body)
    assert body["code"] == 400 and body["message"] == "invalid input" and "header" in body["error"].lower()


def test_a_rejected_header_on_an_openai_route_gets_openais_shape_once_the_path_is_read(server):
    # gunicorn knows the path for some header errors (a bad Content-Length), not for all
    r, _ = send(server.port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2x", b"{}")
    assert r.status == 400 and r.getheader("Content-Type") == "application/json"
    assert "CONTENT-LENGTH" in openai_error(r.body, 400)["message"]


def test_a_100_kb_header_gets_a_json_431(server):
    r, _ = send(server.port, f"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 100_000}")
    assert r.status == 431
    assert r.getheader("Content-Type") == "application/json"
    body = json.loads(r.body)
    assert body["code"] == 431 and "header" in body["error"].lower()
    assert requests.get(server.url("/ping"), timeout=5).status_code == 200


def test_errors_on_openai_routes_are_in_openais_shape(server):
    r = requests.post(server.url("/v1/completions"), data=b'{"prompt": ', timeout=10,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert "not valid JSON" in openai_error(r.content, 400)["message"]
    r = requests.post(server.url("/v1/chat/completions"), json={"fail": "the engine broke"}, timeout=10)
    assert r.status_code == 424
    assert openai_error(r.content, 424)["message"] == "the engine broke"
    r = requests.post(server.url("/v1/completions"), data=b"x" * (7 * 1024 * 1024), timeout=30)
    assert r.status_code == 413
    assert "6291456 bytes" in openai_error(r.content, 413)["message"]
    r = requests.get(server.url("/v1/nowhere"), timeout=10)
    assert r.status_code == 404
    openai_error(r.content, 404)
    # LMI's routes keep LMI's envelope
    r = requests.post(server.url("/invocations"), json={"fail": "the engine broke"}, timeout=10)
    assert r.json() == {"code": 424, "message": "invoke handler failure", "error": "the engine broke"}


@pytest.fixture(scope="module")
def sse_server(textgen_sse_server):
    return textgen_sse_server


def sse_events(text: str) -> list[str]:
    return [event.removeprefix("data: ") for event in text.split("\n\n") if event.strip()]


def test_a_stream_failing_on_an_openai_route_ends_with_an_openai_error_event_and_done(sse_server):
    r = requests.post(sse_server.url("/v1/completions"), timeout=10,
                      json={"inputs": "one two three", "stream": True, "fail_after": 2})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert [json.loads(e)["token"]["text"] for e in events[:2]] == ["one", " two"]
    assert events[3:] == ["[DONE]"]
    assert openai_error(events[2].encode(), 424)["message"] == "generation failed on purpose"


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_a_stream_failing_on_a_route_of_named_events_ends_with_an_error_event(sse_server, path):
    """vLLM's Responses and Messages streams name their events (and send no [DONE]): an error after
    the stream began is an ``error`` event, in the route's envelope, as Anthropic's API sends it."""
    r = requests.post(sse_server.url(path), timeout=10,
                      json={"inputs": "one two three", "stream": True, "fail_after": 2})
    assert r.status_code == 200
    events = [event for event in r.text.split("\n\n") if event.strip()]
    assert len(events) == 3 and "[DONE]" not in r.text, r.text
    name, data = events[2].split("\n")
    assert name == "event: error"
    error = json.loads(data.removeprefix("data: "))
    if path == "/v1/messages":
        assert error == {"type": "error", "error": {"type": "api_error", "message": "generation failed on purpose"}}
    else:
        assert openai_error(json.dumps(error).encode(), 424)["message"] == "generation failed on purpose"


def test_the_messages_routes_refuse_in_anthropics_envelope(server):
    """Errors the frontend answers itself on /v1/messages are Anthropic's shape, as vLLM's server answers there."""
    head = "POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 7340032"
    r, _ = send(server.port, head)
    assert r.status == 413
    error = json.loads(r.body)
    assert error["type"] == "error" and error["error"]["type"] == "request_too_large", error
    assert "max_payload_in_mb" in error["error"]["message"]
    for method, path, status in (("GET", "/v1/messages", 405), ("POST", "/v1/messages/batches", 404)):
        r = requests.request(method, server.url(path), json={}, timeout=10)
        assert r.status_code == status
        assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}, r.text


def test_a_stream_failing_on_invocations_ends_with_lmis_envelope(sse_server):
    r = requests.post(sse_server.url("/invocations"), timeout=10,
                      json={"inputs": "one two three", "stream": True, "fail_after": 2})
    events = sse_events(r.text)
    assert json.loads(events[-1]) == {"code": 424, "message": "invoke handler failure",
                                      "error": "generation failed on purpose"}
    assert len(events) == 3
