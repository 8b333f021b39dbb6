"""SageMaker's stateful sessions with two worker groups and a model.py that keeps
a counter per session with djl_python's SessionManager: a session's requests all
reach the group that opened it, a closed, unknown or malformed session is refused
with 400 naming it, and so is one whose group was killed and restarted. With a
short expiry and a small option.max_sessions: expired sessions leave the disk
without traffic, and a session past the cap gets 429, counted on /metrics."""

import os
import re
import signal
import socket
import time
from datetime import datetime, timezone

import pytest
import requests

from tests.server import MODEL_DIRS, Server, metric

SESSION = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION = "X-Amzn-SageMaker-New-Session-Id"
CLOSED = "X-Amzn-SageMaker-Closed-Session-Id"
GROUP = "X-Sagelmi-Group"
NEW_SESSION_VALUE = re.compile(r"([0-9a-f-]{36}); Expires=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    sessions = tmp_path_factory.mktemp("sessions")
    env = {"SERVING_MIN_WORKERS": "2", "OPTION_SESSIONS_PATH": str(sessions)}
    with Server(MODEL_DIRS / "stateful", env=env) as server:
        server.sessions_path = sessions
        yield server


def open_session(server: Server) -> tuple[str, requests.Response]:
    r = server.invoke({"requestType": "NEW_SESSION"}, headers={SESSION: "NEW_SESSION"})
    assert r.status_code == 200, r.text
    match = NEW_SESSION_VALUE.fullmatch(r.headers[NEW_SESSION])
    assert match, r.headers
    return match.group(1), r


def add(server: Server, session_id: str, n: int = 1) -> requests.Response:
    return server.invoke({"add": n}, headers={SESSION: session_id})


def refused(response: requests.Response, session_id: str, why: str) -> None:
    assert response.status_code == 400, response.text
    body = response.json()  # LMI's envelope on /invocations
    assert body["code"] == 400 and session_id in body["error"] and why in body["error"], body


def test_a_session_sticks_to_its_group_and_keeps_its_state(server):
    # Requests without a session spread over both groups (least in flight, ties in turn) ...
    assert {server.invoke({"requestType": "NEW_SESSION"}).headers[GROUP] for _ in range(6)} == {"0", "1"}
    session_id, created = open_session(server)
    expires = NEW_SESSION_VALUE.fullmatch(created.headers[NEW_SESSION]).group(2)
    lives = datetime.strptime(expires, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp() - time.time()
    assert 1200 - 60 < lives <= 1200  # option.sessions_expiration's default
    assert (server.sessions_path / session_id).is_dir()
    # ... those of a session all reach the group that opened it, whose handler keeps its state.
    answers = [add(server, session_id) for _ in range(20)]
    assert [r.status_code for r in answers] == [200] * 20
    assert {r.headers[GROUP] for r in answers} == {created.headers[GROUP]}
    assert [r.json()["count"] for r in answers] == list(range(1, 21))
    assert len({r.json()["pid"] for r in answers}) == 1


def _raw_post(sock: socket.socket, body: bytes, session: str | None) -> None:
    named = f"{SESSION}: {session}\r\n".encode() if session else b""
    sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n%s"
                 b"Content-Length: %d\r\n\r\n%s" % (named, len(body), body))


def _head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(1 << 16)
    return data


def test_a_sessions_requests_go_to_rank_0_and_one_sent_the_moment_its_session_opened_is_routed(server):
    """Rank 0 reads and answers requests naming a session too; an answer that opens or closes one
    reaches the client only once the frontend's routing knows it, so a client that sends the
    session's next request the moment the opening answer's head arrives is never refused."""
    before = metric(server, "sagelmi_requests_read_early_total")
    rounds = 100
    for _ in range(rounds):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as opener, \
                socket.create_connection(("127.0.0.1", server.port), timeout=30) as follower:
            _raw_post(opener, b'{"requestType": "NEW_SESSION"}', None)  # LMI's form in the body, no header
            match = re.search(rb"X-Amzn-SageMaker-New-Session-Id: ([0-9a-f-]{36});", _head(opener))
            assert match, "the opening answer names its session"
            _raw_post(follower, b'{"add": 1}', match.group(1).decode())  # at once, on another connection
            assert _head(follower).startswith(b"HTTP/1.1 200 "), "the session's next request was routed to it"
    assert metric(server, "sagelmi_requests_read_early_total") - before == 2 * rounds  # every one by rank 0


def test_a_closed_session_is_refused(server):
    session_id, _ = open_session(server)
    assert add(server, session_id, 5).json()["count"] == 5
    closed = server.invoke({"requestType": "CLOSE"}, headers={SESSION: session_id})
    assert closed.status_code == 200, closed.text
    assert closed.headers[CLOSED] == session_id
    assert not (server.sessions_path / session_id).exists()
    refused(add(server, session_id), session_id, "was closed")
    refused(server.invoke({"requestType": "CLOSE"}, headers={SESSION: session_id}), session_id, "was closed")


def test_unknown_and_malformed_sessions_are_refused_naming_them(server):
    unknown = "0b1e5a52-6a43-4c3e-9a4e-7d1c1f0c2b11"
    refused(add(server, unknown), unknown, "is not open on this server")
    r = add(server, "no/such session")
    assert r.status_code == 400 and "'no/such session' is not a session id" in r.json()["error"], r.text
    # OpenAI's routes answer in OpenAI's envelope
    r = requests.post(server.url("/v1/completions"), json={"prompt": "x"}, headers={SESSION: unknown}, timeout=30)
    assert r.status_code == 400 and unknown in r.json()["error"]["message"], r.text


def test_a_session_whose_group_restarted_is_refused(server):
    session_id, created = open_session(server)
    group = created.headers[GROUP]
    pid = add(server, session_id).json()["pid"]
    other_id, other = open_session(server)
    while other.headers[GROUP] == group:  # a session on the other group lives on
        other_id, other = open_session(server)
    os.kill(pid, signal.SIGKILL)
    server.wait_until(lambda r: r.status_code == 503, timeout=10)
    server.wait_until(lambda r: r.status_code == 200, timeout=60)
    refused(add(server, session_id), session_id, f"was held by worker group {group}, which stopped since")
    refused(add(server, session_id), session_id, "which stopped since")  # and stays refused
    kept = add(server, other_id)
    assert kept.status_code == 200 and kept.headers[GROUP] == other.headers[GROUP] and kept.json()["count"] == 1
    fresh_id, _ = open_session(server)  # new sessions open again, on either group
    assert add(server, fresh_id).json()["count"] == 1


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    sessions = tmp_path_factory.mktemp("small-sessions")
    env = {"OPTION_SESSIONS_PATH": str(sessions), "OPTION_SESSIONS_EXPIRATION": "4", "OPTION_MAX_SESSIONS": "2"}
    with Server(MODEL_DIRS / "stateful", env=env) as server:
        server.sessions_path = sessions
        yield server


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_expired_sessions_leave_the_disk_without_traffic(small_server):
    opened = [open_session(small_server)[0] for _ in range(2)]
    assert all((small_server.sessions_path / s).is_dir() for s in opened)
    # no request from here on: the group's SessionManager removes them when they expire (4 s)
    assert wait_for(lambda: not any(small_server.sessions_path.iterdir()), timeout=10), list(
        small_server.sessions_path.iterdir()
    )
    refused(add(small_server, opened[0]), opened[0], "expired at")
    session_id, _ = open_session(small_server)  # they made room
    assert small_server.invoke({"requestType": "CLOSE"}, headers={SESSION: session_id}).status_code == 200


def test_a_session_past_max_sessions_gets_429_and_is_counted(small_server):
    refused_before = metric(small_server, "sagelmi_sessions_refused_total", group="0")
    first, _ = open_session(small_server)
    open_session(small_server)
    r = small_server.invoke({"requestType": "NEW_SESSION"}, headers={SESSION: "NEW_SESSION"})
    assert r.status_code == 429, r.text
    body = r.json()
    assert body["code"] == 429 and "option.max_sessions=2" in body["error"], body
    assert "X-Amzn-SageMaker-New-Session-Id" not in r.headers
    assert metric(small_server, "sagelmi_sessions_refused_total", group="0") == refused_before + 1
    assert len(list(small_server.sessions_path.iterdir())) == 2
    assert small_server.invoke({"requestType": "CLOSE"}, headers={SESSION: first}).status_code == 200
    open_session(small_server)  # a closed session made room
