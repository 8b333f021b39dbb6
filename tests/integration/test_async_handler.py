"""Streaming and cancellation with an async handler (tests/model_dirs/async_worker)."""

import http.client
import json
import time
import uuid

import pytest
import requests

from tests.server import MODEL_DIRS, RawStream, Server


# Long enough that a cancellation the frontend notices at once comes well before it, on a loaded
# machine too; a cancellation only the timeout caused comes after it.
PREDICT_TIMEOUT = 8


@pytest.fixture(scope="module")
def server():
    with Server(MODEL_DIRS / "async_worker", env={"OPTION_PREDICT_TIMEOUT": str(PREDICT_TIMEOUT)}) as s:
        yield s


def _wait_for_file(path, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.02)
    return None


def test_first_chunk_arrives_before_the_last_is_produced(server, tmp_path):
    gate = tmp_path / "gate"
    with server.invoke({"stream": ["a", "b", "c"], "gate": str(gate)}, stream=True, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["Transfer-Encoding"] == "chunked"
        assert r.headers["content-type"] == "application/jsonlines"
        lines = r.iter_lines()
        assert json.loads(next(lines)) == {"outputs": {"item": "a"}}  # LMI's default stream lines
        assert json.loads(next(lines)) == {"outputs": {"item": "b"}}
        gate.write_text("open")  # only now may the handler produce the last item
        assert [json.loads(line) for line in lines] == [{"outputs": {"item": "c"}}]


def test_an_error_after_the_stream_began_is_the_last_line(server):
    r = server.invoke({"stream_fail": "ran out of tokens"})
    assert r.status_code == 200
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines[0] == {"outputs": {"item": "first"}}
    assert lines[-1] == {"code": 424, "message": "invoke handler failure", "error": "ran out of tokens"}


def test_timeout_cancels_the_handlers_work(server, tmp_path):
    marker = tmp_path / "marker"
    started = time.monotonic()
    r = server.invoke({"sleep": 30, "marker": str(marker)})
    assert r.status_code == 504
    assert PREDICT_TIMEOUT <= time.monotonic() - started < PREDICT_TIMEOUT + 10  # not the sleep's 30 s
    assert _wait_for_file(marker, 10) == "cancelled"


def test_client_disconnect_cancels_the_stream_in_the_worker(server, tmp_path):
    marker = tmp_path / "marker"
    stream = RawStream(server.port, "/invocations", {"stream_forever": str(marker)})
    assert len(stream.read_lines(3)) == 3
    stream.close()  # the frontend notices at its next write and cancels
    assert _wait_for_file(marker, 10) == "cancelled"
    # the handler writes its marker inside the cancelled task; the worker counts the request done
    # just after, so /ping may still show it for a moment on a loaded machine
    server.wait_until(lambda r: r.json()["workers"][0]["in_flight"] == 0, timeout=10)


def test_concurrent_requests_run_at_once_on_one_worker(server, tmp_path):
    import concurrent.futures
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: server.invoke({"sleep": 1, "marker": str(tmp_path / uuid.uuid4().hex)}),
                                range(8)))
    assert [r.status_code for r in results] == [200] * 8
    assert time.monotonic() - started < 6  # 8 one-second sleeps overlapped (one after another: 8 s)


def test_a_client_that_leaves_before_its_answer_cancels_the_work(server, tmp_path):
    marker = tmp_path / "marker"
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    sent = time.monotonic()
    conn.request("POST", "/invocations", body=json.dumps({"sleep": 30, "marker": str(marker)}),
                 headers={"Content-Type": "application/json"})
    server.wait_until(lambda r: r.json()["workers"][0]["in_flight"] == 1, timeout=5)
    conn.sock.close()  # gone without waiting for the answer (no stream to fail writing to)
    assert _wait_for_file(marker, PREDICT_TIMEOUT) == "cancelled"
    # noticed when the client left, not at predict_timeout after the request
    assert time.monotonic() - sent < PREDICT_TIMEOUT
    server.wait_until(lambda r: r.json()["workers"][0]["in_flight"] == 0, timeout=10)
