"""Requests against a real server running the LMI-style handler in tests/model_dirs/lmi_echo."""

import concurrent.futures
import json
import re
import socket
import time
import urllib.parse

import psutil
import pytest
import requests

from container.frontend.early import ROUTES
from tests.server import MODEL_DIRS, RawStream, Server


@pytest.fixture(scope="module")
def server():
    with Server(
        MODEL_DIRS / "lmi_echo",
        env={
            "SERVING_JOB_QUEUE_SIZE": "4",
            "OPTION_PREDICT_TIMEOUT": "3",
            "OPTION_SYNC_HANDLER_THREADS": "8",
            "OPTION_CUSTOM_FLAG": "on",
        },
    ) as s:
        yield s


def test_lmi_handler_runs_unchanged_with_its_initialisation_call(server):
    r = server.invoke({"inputs": "hello"})
    assert r.status_code == 200
    body = r.json()
    assert body["echo"] == {"inputs": "hello"}
    assert body["model_properties"]["model_dir"] == str(MODEL_DIRS / "lmi_echo")
    assert body["model_properties"]["custom_flag"] == "on"
    assert r.headers["content-type"] == "application/json"


def test_handler_exception_is_424_with_its_message_and_no_traceback(server):
    r = server.invoke({"fail": "the model is unhappy"})
    assert r.status_code == 424
    assert r.json() == {"code": 424, "message": "invoke handler failure", "error": "the model is unhappy"}
    assert "Traceback" not in r.text and "/model_dirs/" not in r.text


def test_a_handlers_key_error_names_its_type_and_the_missing_key(server):
    """lmi_echo reads data["gate"] when "lines" is given: without it, a KeyError in the handler."""
    detail = (
        "KeyError: 'gate' is missing (the handler looked up a key that is not there: a field the request "
        "does not have?)"
    )
    r = server.invoke({"lines": ["a"]})
    assert r.status_code == 424
    assert r.json() == {"code": 424, "message": "invoke handler failure", "error": detail}
    r = requests.post(server.url("/v1/chat/completions"), json={"lines": ["a"]}, timeout=10)
    assert r.status_code == 424
    assert r.json()["error"]["message"] == detail and "Traceback" not in r.text


def test_a_handlers_own_oserror_is_424_at_once(server, tmp_path):
    missing = tmp_path / "no-such-file.txt"
    started = time.monotonic()
    r = server.invoke({"open": str(missing)})
    assert time.monotonic() - started < 1
    assert r.status_code == 424
    assert r.json()["code"] == 424 and "No such file or directory" in r.json()["error"]
    assert str(tmp_path) not in r.text  # no local path leaks


def test_a_handlers_own_oserror_mid_stream_ends_the_stream_at_once(server, tmp_path):
    started = time.monotonic()
    r = server.invoke({"lines_then_open": ["one", "two"], "path": str(tmp_path / "gone.txt")})
    assert time.monotonic() - started < 1
    assert r.status_code == 200
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines[:2] == [{"outputs": "one\n"}, {"outputs": "two\n"}]
    assert lines[2]["code"] == 424
    assert server.invoke({"inputs": "after"}).status_code == 200


def test_output_error_is_relayed(server):
    r = server.invoke({"error_output": "bad prompt"})
    assert r.status_code == 424
    assert r.json()["error"] == "bad prompt"


def test_malformed_json_is_400(server):
    r = requests.post(
        server.url("/invocations"), data=b'{"inputs": ', timeout=10, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json()["code"] == 400
    assert "not valid JSON" in r.json()["error"]


def test_8_mib_body_is_413_and_the_server_stays_healthy(server):
    r = requests.post(server.url("/invocations"), data=b"x" * (8 * 1024 * 1024), timeout=30)
    assert r.status_code == 413
    assert r.json()["code"] == 413
    assert "6291456 bytes" in r.json()["error"]
    assert server.invoke({"inputs": "after"}).status_code == 200


def test_custom_attributes_and_inference_id_reach_the_handler_and_come_back(server):
    r = server.invoke(
        {"attributes": "handler_says=hi"},
        headers={
            "X-Amzn-SageMaker-Custom-Attributes": "trace_id=abc; accept_eula=true",
            "X-Amzn-SageMaker-Inference-Id": "req-12345",
        },
    )
    assert r.status_code == 200
    props = r.json()["properties"]
    assert props["trace_id"] == "abc" and props["accept_eula"] == "true"
    # as DJL Serving: the attributes header itself is not a property; headers keep their names
    assert not any(k.lower() == "x-amzn-sagemaker-custom-attributes" for k in props)
    assert props["requestId"] == "req-12345"
    assert props["Content-Type"] == "application/json"
    assert props["device_id"] == "-1" and props["model_dir"] == str(MODEL_DIRS / "lmi_echo")
    assert r.headers["X-Amzn-SageMaker-Inference-Id"] == "req-12345"
    assert r.headers["X-Amzn-SageMaker-Custom-Attributes"] == "handler_says=hi"
    # the completion line is written once the answer has gone out: it may follow the client's read
    deadline = time.monotonic() + 10
    while "frontend [req-12345]" not in server.log():
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.05)


def test_request_id_is_generated_when_absent_and_is_on_worker_log_lines(server):
    r = server.invoke({"inputs": "x"})
    rid = r.headers["X-Amzn-SageMaker-Inference-Id"]
    assert len(rid) >= 16
    assert r.json()["properties"]["requestId"] == rid
    server.invoke({"fail": "logged"}, headers={"X-Amzn-SageMaker-Inference-Id": "req-fail-1"})
    assert any("worker-0 [req-fail-1]" in line and "handler failed" in line for line in server.log().splitlines())


FORGED = "1999-01-01 00:00:00,000 INFO frontend [forged] sagelmi.frontend: forged"


def test_a_request_cannot_write_a_line_of_its_own_into_the_text_log(server):
    """A URL path with %0D%0A (decoded by the server into CR LF) and a handler's error message
    with a newline reach log lines: the frontend's completion line, the worker's "handler failed"
    line and its traceback. Neither starts a line."""
    path = "/nowhere%0D%0A" + urllib.parse.quote(FORGED, safe="")
    r = requests.get(server.url(path), headers={"X-Amzn-SageMaker-Inference-Id": "forge-path"}, timeout=10)
    assert r.status_code == 404
    r = server.invoke({"fail": f"unhappy\n{FORGED}"}, headers={"X-Amzn-SageMaker-Inference-Id": "forge-error"})
    assert r.status_code == 424
    deadline = time.monotonic() + 10
    while "forge-path" not in server.log() or "[forge-error]" not in server.log():
        assert time.monotonic() < deadline, "no log line of the requests"
        time.sleep(0.05)
    time.sleep(0.3)
    lines = server.log().splitlines()
    assert not [line for line in lines if line.startswith("1999-01-01")]
    assert any("[forge-path]" in line and f"GET /nowhere\\r\\n{FORGED} -> 404" in line for line in lines)
    assert any("[forge-error]" in line and f"unhappy\\n{FORGED}" in line for line in lines)


def test_a_priority_without_the_priority_scheduling_policy_is_a_400_naming_the_option(server):
    """This server serves first-come (option.scheduling_policy unset): a request asking for more is
    refused, not served as if it had not asked; priority 0, every request's default, asks for nothing."""
    for headers in ({"X-Priority": "2"}, {"X-Amzn-SageMaker-Custom-Attributes": "x-priority=-1"}):
        r = server.invoke({"inputs": "x"}, headers=headers)
        assert r.status_code == 400, r.text
        assert "option.scheduling_policy=priority" in r.json()["error"]
    r = requests.post(
        server.url("/v1/chat/completions"), json={"messages": []}, headers={"X-Priority": "2"}, timeout=10
    )
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("X-Priority=2: "), r.text
    assert server.invoke({"inputs": "x"}, headers={"X-Priority": "0"}).status_code == 200


def test_unknown_route_and_wrong_method(server):
    r = requests.get(server.url("/nowhere"), timeout=10)
    assert r.status_code == 404 and r.json()["code"] == 404
    others = ("GET /ping", "GET /models", "/models/{model}/adapters", "POST /adapters", "DELETE /adapters/{name}")
    for route in (*(f"{method} {path}" for path, method in ROUTES.items()), *others, "GET /openapi.json"):
        assert route in r.json()["error"]
    r = requests.get(server.url("/invocations"), timeout=10)
    assert r.status_code == 405 and r.json()["code"] == 405


def test_the_handlers_routes_answer_other_methods_as_before(server):
    """The handler's routes are served in front of Flask (container/frontend/invocations.py);
    Flask still answers the methods they do not take."""
    r = requests.put(server.url("/v1/chat/completions"), timeout=10)
    assert r.status_code == 405 and "PUT is not allowed on /v1/chat/completions" in r.text
    r = requests.options(server.url("/invocations"), timeout=10)
    assert r.status_code == 200 and "POST" in r.headers["Allow"]
    get = requests.get(server.url("/v1/models"), timeout=10)
    head = requests.head(server.url("/v1/models"), timeout=10)
    assert head.status_code == get.status_code and head.content == b""
    assert head.headers["X-Amzn-SageMaker-Inference-Id"] != get.headers["X-Amzn-SageMaker-Inference-Id"]
    r = requests.post(server.url("/invocations?x=1"), json={"inputs": "q"}, timeout=10)
    assert r.status_code == 200 and r.headers["Content-Length"] == str(len(r.content))
    assert r.json()["echo"] == {"inputs": "q"}


def test_full_queue_is_503_and_queued_requests_still_finish(server):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        slow = [pool.submit(server.invoke, {"sleep": 1.5}) for _ in range(4)]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # wait until all four are in flight
            if sum(w["in_flight"] for w in requests.get(server.url("/ping"), timeout=2).json()["workers"]) == 4:
                break
            time.sleep(0.02)
        started = time.monotonic()
        rejected = server.invoke({"inputs": "one too many"})
        assert time.monotonic() - started < 1
        assert rejected.status_code == 503
        assert "queue is full" in rejected.json()["error"]
        # On a kept-alive connection: each refusal in the route's envelope with its request's id (and
        # its completion line), the connection kept for the client's next request
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            for inference_id in ("refused-1", "refused-2"):
                sock.sendall(_post({"inputs": "refused"}, inference_id))
                head, body = _whole_answer(sock)
                assert head.startswith(b"HTTP/1.1 503 ") and f"Inference-Id: {inference_id}".encode() in head
                assert b"Connection: keep-alive" in head and "queue is full" in json.loads(body)["error"]
                assert " 503 " in _completion_line(server, inference_id)
        ping = requests.get(server.url("/ping"), timeout=2)
        assert ping.status_code == 200
        assert [f.result().status_code for f in slow] == [200] * 4


def _whole_answer(sock) -> tuple[bytes, bytes]:
    """One whole answer (with its Content-Length) off a kept-alive connection: its head and body."""
    data = b""
    while b"\r\n\r\n" not in data:
        got = sock.recv(65536)
        assert got, "the server closed the connection"
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


def test_predict_timeout_is_504_and_the_next_request_succeeds(server):
    started = time.monotonic()
    r = server.invoke({"sleep": 6})
    elapsed = time.monotonic() - started
    assert r.status_code == 504
    assert r.json()["code"] == 504 and "predict_timeout" in r.json()["error"]
    assert 2.9 < elapsed < 5
    assert server.invoke({"inputs": "next"}).status_code == 200


def test_execution_parameters(server):
    body = requests.get(server.url("/execution-parameters"), timeout=5).json()
    assert body == {"MaxConcurrentTransforms": 1, "BatchStrategy": "SINGLE_RECORD", "MaxPayloadInMB": 6}


def test_a_plain_generator_streams_each_item_as_it_comes(server, tmp_path):
    gate = tmp_path / "gate"
    with server.invoke({"lines": ["a", "b", "c"], "gate": str(gate)}, stream=True, timeout=10) as r:
        lines = (json.loads(line) for line in r.iter_lines())  # LMI's default: {"outputs": item} lines
        assert [next(lines), next(lines)] == [{"outputs": "a\n"}, {"outputs": "b\n"}]
        gate.write_text("open")  # only now may the generator produce the last line
        assert list(lines) == [{"outputs": "c\n"}]


def test_a_plain_generator_stops_when_its_client_goes_away(server, tmp_path):
    marker = tmp_path / "marker"
    stream = RawStream(server.port, "/invocations", {"lines_forever": str(marker)})
    assert len(stream.read_lines(3)) == 3
    stream.close()
    deadline = time.monotonic() + 2
    while not (marker.exists() and marker.read_text() == "closed"):
        assert time.monotonic() < deadline, "the generator kept running after its client left"
        time.sleep(0.02)


def test_a_stream_that_keeps_sending_outlives_predict_timeout(server, tmp_path):
    """predict_timeout (3 s here) bounds the wait for each piece, not the stream:
    a stream the worker writes straight to the client is no less alive for not
    passing through the frontend (its progress messages, empty Chunks, say so)."""
    stream = RawStream(server.port, "/invocations", {"lines_forever": str(tmp_path / "marker")})
    try:
        lines = stream.read_lines(100)  # one line every 50 ms: 5 s
        assert [json.loads(line) for line in lines] == [{"outputs": f"line {n}\n"} for n in range(100)]
    finally:
        stream.close()


def test_a_streamed_body_goes_from_the_worker_to_the_client_without_the_frontend(server, tmp_path):
    """Once the headers are out, the frontend hands the client's socket to the worker, which
    writes the body itself: during the stream the worker holds a TCP connection to the
    client's address, and lets go of it when the stream ends."""
    stream = RawStream(server.port, "/invocations", {"lines_forever": str(tmp_path / "marker")})
    client = stream.conn.sock.getsockname()
    (worker,) = server.worker_pids()

    def held() -> bool:
        return any(c.raddr and tuple(c.raddr) == client for c in psutil.Process(worker).net_connections("tcp"))

    try:
        assert len(stream.read_lines(2)) == 2
        assert held()
    finally:
        stream.close()
    deadline = time.monotonic() + 5
    while held():
        assert time.monotonic() < deadline, "the worker kept the client's socket after the stream"
        time.sleep(0.05)


def _read_responses(sock, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """``count`` HTTP/1.1 responses read off one connection in order (status, headers, body),
    chunked bodies decoded; fails on anything between them that is not a response."""
    buffer = b""

    def need(size: int) -> None:
        nonlocal buffer
        while len(buffer) < size:
            data = sock.recv(65536)
            assert data, f"the connection closed after {len(responses)} response(s): {buffer[:200]!r}"
            buffer += data

    def line() -> bytes:
        nonlocal buffer
        while b"\r\n" not in buffer:
            need(len(buffer) + 1)
        head, _, buffer = buffer.partition(b"\r\n")
        return head

    responses = []
    while len(responses) < count:
        status = line()
        assert status.startswith(b"HTTP/1.1 "), f"not a response: {status!r}"
        headers = {}
        while header := line():
            name, _, value = header.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        body = b""
        if headers.get("transfer-encoding") == "chunked":
            while size := int(line(), 16):
                need(size + 2)
                body, buffer = body + buffer[:size], buffer[size + 2 :]
            assert line() == b""  # no trailers
        else:
            need(int(headers["content-length"]))
            length = int(headers["content-length"])
            body, buffer = buffer[:length], buffer[length:]
        responses.append((int(status.split()[1]), headers, body))
    return responses


def test_a_streamed_answer_ends_once_and_the_kept_alive_connection_serves_the_next_requests(server, tmp_path):
    """The worker ends the chunked body it writes itself (protocol: an ending End) and the frontend
    writes nothing after it: requests one after the other, and requests sent before the
    previous answer ended (pipelined), all get whole answers on one connection, each
    chunked body ended once (a second end would be read here as garbage before the next
    status line)."""
    import socket

    gate = tmp_path / "gate"
    gate.write_text("open")
    payload = json.dumps({"lines": ["a", "b", "c"], "gate": str(gate)}).encode()
    post = (
        b"POST /invocations HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    ping = b"GET /ping HTTP/1.1\r\nHost: test\r\n\r\n"
    expected = b"".join(json.dumps({"outputs": f"{x}\n"}).encode() + b"\n" for x in "abc")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        for _ in range(3):
            sock.sendall(post)
            ((status, headers, body),) = _read_responses(sock, 1)
            assert (status, headers["transfer-encoding"], body) == (200, "chunked", expected)
        sock.sendall(post + post + ping)
        answers = _read_responses(sock, 3)
    assert [(status, body) for status, _, body in answers[:2]] == [(200, expected)] * 2
    assert answers[2][0] == 200


def _raw_exchange(port: int, payload: dict, inference_id: str, version: str = "1.1") -> tuple[bytes, bytes]:
    """One request on a new connection, read until the answer ends (the chunked body's end, or
    the connection's for HTTP/1.0): the response's head and its raw body."""
    import socket

    body = json.dumps(payload).encode()
    request = (
        f"POST /invocations HTTP/{version}\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"X-Amzn-SageMaker-Inference-Id: {inference_id}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request + body)
        while not (version == "1.1" and got.endswith(b"\r\n0\r\n\r\n")):
            data = sock.recv(65536)
            if not data:
                break
            got += data
    head, _, rest = got.partition(b"\r\n\r\n")
    return head, rest


def _content(body: bytes, chunked: bool) -> bytes:
    """A raw body's content: its chunks joined when it is chunked (each chunk's size checked)."""
    if not chunked:
        return body
    content = b""
    while True:
        size, _, body = body.partition(b"\r\n")
        length = int(size, 16)
        assert body[length : length + 2] == b"\r\n", "a chunk longer or shorter than its size"
        if length == 0:
            return content
        content, body = content + body[:length], body[length + 2 :]


def _without_date(head: bytes) -> list[bytes]:
    return [line for line in head.split(b"\r\n") if not line.startswith(b"Date: ")]


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_a_stream_asked_for_in_the_body_has_the_head_gunicorn_would_have_written(server, tmp_path, version):
    """A body with "stream": true sends the client's socket to the worker with the request, and
    the worker writes the stream's HTTP head itself: byte for byte the head the frontend has
    gunicorn write otherwise (the same lines in the same order; the date aside), and the same body
    (where the chunks begin and end depends on when the lines were ready)."""
    gate = tmp_path / "gate"
    gate.write_text("open")
    plain = {"lines": ["a", "b"], "gate": str(gate)}
    head, body = _raw_exchange(server.port, plain, "same-id", version)
    early_head, early_body = _raw_exchange(server.port, {**plain, "stream": True}, "same-id", version)
    assert _without_date(early_head) == _without_date(head)
    assert _content(early_body, version == "1.1") == _content(body, version == "1.1")
    assert head.startswith(f"HTTP/{version} 200 OK\r\n".encode())
    assert b"\r\nX-Sagelmi-Group: " in head and b"\r\nX-Amzn-SageMaker-Inference-Id: same-id" in head
    assert (b"Transfer-Encoding: chunked" in head) == (version == "1.1")


def _worker_holds(server, address) -> bool:
    (worker,) = server.worker_pids()
    return any(c.raddr and tuple(c.raddr) == address for c in psutil.Process(worker).net_connections("tcp"))


@pytest.mark.parametrize("asks_stream", [True, False])
def test_the_clients_socket_goes_to_the_worker_for_the_answer_and_comes_back_after_it(server, asks_stream):
    """A request on the handler's routes hands its client's socket to the worker, which reads the
    request and writes the answer, whole (with its length) or streamed; it lets go of the socket
    once the answer is out."""
    import socket

    payload = json.dumps({"sleep": 1.0, "stream": asks_stream}).encode()
    request = (
        b"POST /invocations HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        time.sleep(0.5)  # the handler sleeps for a second
        held = _worker_holds(server, sock.getsockname())
        ((status, headers, body),) = _read_responses(sock, 1)
        let_go = not _worker_holds(server, sock.getsockname())
    assert (status, json.loads(body)["echo"]["sleep"]) == (200, 1.0)
    assert headers["content-length"] == str(len(body))
    assert held
    assert let_go


def test_a_stream_whose_head_the_worker_wrote_logs_its_first_byte_then_not_at_its_end(server, tmp_path):
    """The frontend takes a head the worker wrote itself when it has time (at the latest at the
    stream's end); the completion line still says when the status line went out."""
    gate = tmp_path / "gate"
    stream = RawStream(
        server.port,
        "/invocations",
        {"lines": ["a", "b"], "gate": str(gate), "stream": True},
        headers={"X-Amzn-SageMaker-Inference-Id": "first-byte-check"},
    )
    try:
        assert len(stream.read_lines(1)) == 1
        time.sleep(1.0)
        gate.write_text("open")
        assert len(stream.read_lines(1)) == 1
    finally:
        stream.close()
    deadline = time.monotonic() + 5
    while not (lines := [x for x in server.log().splitlines() if "first-byte-check" in x and "first byte" in x]):
        assert time.monotonic() < deadline, "no completion line"
        time.sleep(0.05)
    first_byte = float(lines[0].split("first byte ")[1].split(" ms")[0])
    assert first_byte < 500, lines[0]


def test_a_stream_request_that_times_out_before_its_head_is_still_a_504(server):
    """predict_timeout before the head, with the client's socket in the worker: the worker says it
    let go without writing, and the frontend answers 504 as without it."""
    r = server.invoke({"sleep": 6, "stream": True})
    assert r.status_code == 504 and r.json()["code"] == 504
    assert server.invoke({"inputs": "next", "stream": True}).status_code == 200


def _post(payload: dict, inference_id: str = "") -> bytes:
    body = json.dumps(payload).encode()
    named = f"X-Amzn-SageMaker-Inference-Id: {inference_id}\r\n" if inference_id else ""
    return (
        f"POST /invocations HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{named}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def _completion_line(server, inference_id: str, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [
            line for line in server.log().splitlines() if f"[{inference_id}]" in line and "POST /invocations ->" in line
        ]
        if lines:
            return lines[-1]
        time.sleep(0.05)
    raise AssertionError(f"no completion line for {inference_id}")


def test_streamed_requests_are_taken_by_the_main_loop_whole_or_in_pieces_on_a_kept_connection(server, tmp_path):
    """A request that asks for a stream is sent to the worker by gthread's main loop, with no
    request thread (container/frontend/early.py): sent whole, sent in pieces (its head, then its
    body), pipelined; each gets its whole answer on the one connection and its completion line."""
    import socket

    from tests.server import metric

    gate = tmp_path / "gate"
    gate.write_text("open")
    payload = {"lines": ["a", "b", "c"], "gate": str(gate), "stream": True}
    expected = b"".join(json.dumps({"outputs": f"{x}\n"}).encode() + b"\n" for x in "abc")
    before = metric(server, "sagelmi_requests_read_early_total")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_post(payload, "early-whole"))
        answers = _read_responses(sock, 1)
        request = _post(payload, "early-pieces")
        head_end = request.index(b"\r\n\r\n") + 4
        for piece in (request[:20], request[20:head_end], request[head_end:]):
            sock.sendall(piece)
            time.sleep(0.1)
        answers += _read_responses(sock, 1)
        sock.sendall(_post(payload, "early-piped-1") + _post(payload, "early-piped-2"))
        answers += _read_responses(sock, 2)
    assert [(status, body) for status, _, body in answers] == [(200, expected)] * 4
    assert all(headers["transfer-encoding"] == "chunked" for _, headers, _ in answers)
    assert metric(server, "sagelmi_requests_read_early_total") - before == 4
    for name in ("early-whole", "early-pieces", "early-piped-1", "early-piped-2"):
        assert "-> 200 completed" in _completion_line(server, name)


def test_a_request_taken_early_that_fails_before_its_head_gets_the_routes_error_and_keeps_its_connection(server):
    import socket

    from tests.server import metric

    before = metric(server, "sagelmi_requests_read_early_total")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_post({"fail": "the model is unhappy", "stream": True}))
        ((status, headers, body),) = _read_responses(sock, 1)
        taken = metric(server, "sagelmi_requests_read_early_total") - before
        sock.sendall(_post({"inputs": "after", "stream": True}))  # the thread that answered may serve it
        ((after, _, _),) = _read_responses(sock, 1)
    assert taken == 1
    assert (status, headers["content-type"]) == (424, "application/json")
    assert json.loads(body) == {"code": 424, "message": "invoke handler failure", "error": "the model is unhappy"}
    assert after == 200


def test_a_request_taken_early_times_out_or_loses_its_client_as_any_other(server):
    """No thread follows it, yet predict_timeout (3 s here) answers 504 in the route's envelope,
    and a client that leaves before the answer has it logged as gone (499)."""
    import socket

    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_post({"sleep": 6, "stream": True}, "early-slow"))
        ((status, _, body),) = _read_responses(sock, 1)
    assert 3 <= time.monotonic() - started < 5.5
    assert status == 504 and json.loads(body)["code"] == 504
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_post({"sleep": 2, "stream": True}, "early-gone"))
        time.sleep(0.3)
    left = time.monotonic()
    assert "-> 499 client_gone" in _completion_line(server, "early-gone")
    assert time.monotonic() - left < 1.5
    assert server.invoke({"inputs": "after"}).status_code == 200


def test_a_head_gunicorn_takes_reaches_the_handler_from_rank_0_with_the_headers_gunicorn_gives(server):
    """A header repeated reaches the handler once, its values joined with "," as gunicorn's WSGI
    environ joins them; a name with "_" is dropped as gunicorn drops it; 100 headers are not too
    many. Rank 0 reads all of it (no request thread)."""
    import socket

    from tests.server import metric

    many = "".join(f"X-F{i}: v\r\n" for i in range(94)).encode()  # 100 headers kept
    request = _post({"inputs": "x"}, "joined").replace(
        b"Host: test\r\n", b"Host: test\r\nX-Note: a\r\nX_Skip: b\r\nx-note: c\r\n" + many
    )
    before = metric(server, "sagelmi_requests_read_early_total")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        ((status, _, body),) = _read_responses(sock, 1)
    assert status == 200
    props = json.loads(body)["properties"]
    assert props["X-Note"] == "a,c" and props["X-F93"] == "v"
    assert not any("skip" in name.lower() for name in props)
    assert metric(server, "sagelmi_requests_read_early_total") - before == 1


def test_a_connection_handed_to_the_worker_unread_is_served_there_whatever_its_head_and_body_ask(
    server, tmp_path
):
    """gthread's main loop hands a connection whose request is for the handler to rank 0 unread
    (container/worker/handoff.py), whatever its body asks, however slowly the body comes (rank 0
    waits for it), and with a head gunicorn takes that is not plain (a header repeated). Each is
    served on the same connection."""
    import socket

    from tests.server import metric

    gate = tmp_path / "gate"
    gate.write_text("open")
    payload = {"lines": ["a", "b"], "gate": str(gate), "stream": True}
    expected = b"".join(json.dumps({"outputs": f"{x}\n"}).encode() + b"\n" for x in "ab")
    repeated = _post(payload, "declined-repeated").replace(b"Host: test\r\n", b"Accept: a\r\nAccept: b\r\n")
    in_a_header = _post({"lines": ["a", "b"], "gate": str(gate)}, "declined-header").replace(
        b"Host: test", b'X-Note: "stream": true'
    )
    slow = _post(payload, "declined-slow")
    head_end = slow.index(b"\r\n\r\n") + 4
    before = metric(server, "sagelmi_requests_read_early_total")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(repeated)
        answers = _read_responses(sock, 1)
        sock.sendall(in_a_header)
        answers += _read_responses(sock, 1)
        sock.sendall(slow[:head_end])
        time.sleep(1.0)  # the body comes a second after the head
        sock.sendall(slow[head_end:])
        answers += _read_responses(sock, 1)
    handed = metric(server, "sagelmi_requests_read_early_total") - before
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_post(payload, "taken-after"))
        answers += _read_responses(sock, 1)
    assert [(status, body) for status, _, body in answers] == [(200, expected)] * 4
    assert handed == 3  # the repeated header, the stream asked in a header, the slow body
    assert metric(server, "sagelmi_requests_read_early_total") - before == 4
    for name in ("declined-repeated", "declined-header", "declined-slow", "taken-after"):
        assert "-> 200" in _completion_line(server, name)


def test_heads_the_frontend_read_and_requests_gunicorn_read_ahead_are_answered_by_rank_0(server):
    """The main loop reads a head off the socket when it is past 64 KiB or comes in more than a few
    pieces, and gunicorn reads ahead a request pipelined after one a thread answers (GET /ping,
    GET /models): each still goes to rank 0 (with what was read: Attach.prefix) and is answered
    on the same connection."""
    many = b"".join(f"X-F{i}: {'v' * 7000}\r\n".encode() for i in range(11))
    big = _post({"inputs": "big"}, "read-big").replace(b"Host: test\r\n", b"Host: test\r\n" + many)
    assert len(big) > 70 * 1024
    slow = _post({"inputs": "pieces"}, "read-pieces")
    head_end = slow.index(b"\r\n\r\n") + 4
    cuts = [head_end * i // 6 for i in range(6)] + [len(slow)]

    def send(sock):
        sock.sendall(big)
        answers = _read_responses(sock, 1)
        for start, stop in zip(cuts, cuts[1:]):  # the head in 6 pieces, the body with the last
            sock.sendall(slow[start:stop])
            time.sleep(0.1)
        answers += _read_responses(sock, 1)
        for path in ("ping", "models"):  # answered by a thread; gunicorn reads the next request ahead
            name = f"read-after-{path}"
            sock.sendall(f"GET /{path} HTTP/1.1\r\nHost: test\r\n\r\n".encode() + _post({"inputs": name}, name))
            answers += _read_responses(sock, 2)
        return answers

    answers, taken = _taken_by_rank_0(server, send)
    assert [status for status, _, _ in answers] == [200] * 6
    echoed = [json.loads(body)["echo"] for status, _, body in answers if b'"echo"' in body]
    assert echoed == [{"inputs": x} for x in ("big", "pieces", "read-after-ping", "read-after-models")]
    assert taken == 4  # all four handler requests read by rank 0, no request thread
    assert json.loads(answers[0][2])["properties"]["X-F10"] == "v" * 7000
    for name in ("read-big", "read-pieces", "read-after-ping", "read-after-models"):
        assert "-> 200" in _completion_line(server, name)


def test_a_head_larger_than_rank_0_is_handed_is_431_in_the_routes_envelope(server):
    """gunicorn takes heads of up to 100 fields of 8 KiB; the hand-off carries 256 KiB of what the
    frontend read (protocol.MAX_PREFIX_BYTES): past it the main loop refuses the request itself."""
    many = b"".join(f"X-F{i}: {'v' * 8000}\r\n".encode() for i in range(40))
    request = _post({"inputs": "huge"}, "huge-head").replace(b"Host: test\r\n", b"Host: test\r\n" + many)
    assert 256 * 1024 < len(request) < 100 * 8190
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):  # closed after the answer
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ") and b"Connection: close" in head, head
    assert "larger than 256 KiB" in json.loads(body)["error"]
    assert " 431 " in _completion_line(server, "huge-head")


def test_a_head_gunicorn_takes_and_rank_0_does_not_read_is_400_naming_what_to_send(server):
    """HTTP/1.2 (gunicorn takes 1.x; httptools does not parse it plainly) reaches Flask on a handler
    route, which refuses it in the route's envelope instead of serving it some other way."""
    body = b'{"inputs": "x"}'
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /invocations HTTP/1.2\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        head, answer = _whole_answer(sock)
    assert head.split(b" ")[1] == b"400", head
    assert "send HTTP/1.1 (or 1.0)" in json.loads(answer)["error"]


MAX_PAYLOAD = 6 * 1024 * 1024  # the default max_payload_in_mb (6)


def _chunked_post(payload: dict, inference_id: str, pieces: int = 3) -> bytes:
    """A POST /invocations whose JSON body is sent as ``pieces`` HTTP/1.1 chunks."""
    body = json.dumps(payload).encode()
    step = -(-len(body) // pieces)
    chunks = b"".join(b"%X\r\n%s\r\n" % (len(part), part) for part in (body[i : i + step] for i in range(0, len(body), step)))
    return (
        f"POST /invocations HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"X-Amzn-SageMaker-Inference-Id: {inference_id}\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode() + chunks + b"0\r\n\r\n"


def _taken_by_rank_0(server, send) -> tuple[list, float]:
    """``send(sock)`` on a new connection: what it returns and how many requests the main loop
    handed to rank 0 meanwhile."""
    import socket

    from tests.server import metric

    before = metric(server, "sagelmi_requests_read_early_total")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        got = send(sock)
    return got, metric(server, "sagelmi_requests_read_early_total") - before


def test_a_chunked_request_is_read_by_rank_0_and_answered_whole_or_streamed(server, tmp_path):
    gate = tmp_path / "gate"
    gate.write_text("open")
    stream = {"lines": ["a", "b"], "gate": str(gate), "stream": True}

    def send(sock):
        sock.sendall(_chunked_post({"inputs": "whole"}, "chunked-whole"))
        answers = _read_responses(sock, 1)
        request = _chunked_post(stream, "chunked-stream", pieces=4)
        head_end = request.index(b"\r\n\r\n") + 4
        for piece in (request[:head_end], request[head_end : head_end + 20], request[head_end + 20 :]):
            sock.sendall(piece)  # the body's chunks come after the head was handed over
            time.sleep(0.1)
        return answers + _read_responses(sock, 1)

    ((whole_status, whole_headers, whole), (status, headers, streamed)), taken = _taken_by_rank_0(server, send)
    assert taken == 2
    assert whole_status == 200 and json.loads(whole)["echo"] == {"inputs": "whole"}
    assert json.loads(whole)["properties"]["Transfer-Encoding"] == "chunked"  # as gunicorn's environ has it
    assert whole_headers["connection"] == "keep-alive" and whole_headers["x-amzn-sagemaker-inference-id"] == "chunked-whole"
    assert (status, headers["transfer-encoding"]) == (200, "chunked")
    assert streamed == b"".join(json.dumps({"outputs": f"{x}\n"}).encode() + b"\n" for x in "ab")
    for name in ("chunked-whole", "chunked-stream"):
        assert "-> 200" in _completion_line(server, name)


def _answer_then_close(sock) -> tuple[int, dict[str, str], bytes, bytes]:
    """The one answer on ``sock`` and what came after it before the server closed the connection."""
    ((status, headers, body),) = _read_responses(sock, 1)
    rest = b""
    while data := sock.recv(65536):
        rest += data
    return status, headers, body, rest


@pytest.mark.parametrize(
    ("why", "body", "status", "says"),
    [
        ("too large", b"".join(b"100000\r\n" + b"x" * (1 << 20) + b"\r\n" for _ in range(6)) + b"1\r\nx\r\n", 413,
         f"the limit is {MAX_PAYLOAD} bytes"),
        ("cut short", b"5\r\nhello\r\n3\r\nwo", 400, "ended after 7 bytes of a chunked body"),
        ("a chunk size not hex", b"5\r\nhello\r\nzz\r\nworld\r\n0\r\n\r\n", 400, "chunked framing is malformed"),
        ("a chunk longer than its size", b"3\r\nhello\r\n0\r\n\r\n", 400, "chunked framing is malformed"),
    ],
)
def test_a_chunked_body_too_large_cut_short_or_malformed_gets_rank_0s_error_in_the_routes_envelope(
    server, why, body, status, says
):
    """Rank 0 reads a chunked body as it comes: past max_payload_in_mb it stops reading (413), a
    body the client stopped sending is a 400, and so are chunks not framed as HTTP's; each in the
    route's envelope, on a connection closed after it."""
    import socket

    head = b"POST /invocations HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n"

    def send(sock):
        sock.sendall(head + body)
        if why == "cut short":
            sock.shutdown(socket.SHUT_WR)
        return _answer_then_close(sock)

    (got, headers, answer, rest), taken = _taken_by_rank_0(server, send)
    assert taken == 1, why
    assert (got, headers["connection"], rest) == (status, "close", b""), why
    assert json.loads(answer)["code"] == status and says in json.loads(answer)["error"], why
    assert server.invoke({"inputs": "after"}).status_code == 200


def test_a_request_sent_after_a_chunked_one_is_not_served_and_the_connection_closes_after_the_first_answer(server):
    """Rank 0 reads a chunked body off the socket without knowing where it ends: bytes the client
    sent after its end (a pipelined request) are read with it and cannot be given back, so the
    connection closes after the first answer and the second request gets none."""

    def send(sock):
        sock.sendall(_chunked_post({"inputs": "first"}, "chunked-first") + _post({"inputs": "second"}, "piped-second"))
        return _answer_then_close(sock)

    (status, headers, body, rest), taken = _taken_by_rank_0(server, send)
    assert (status, json.loads(body)["echo"], headers["connection"], rest) == (200, {"inputs": "first"}, "close", b"")
    assert taken == 1
    assert "piped-second" not in server.log()
