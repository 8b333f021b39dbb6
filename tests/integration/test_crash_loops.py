"""No crash loops: a request that kills its group, a group that dies after every start
(tests/model_dirs/crashes) and one that cannot load again (tests/model_dirs/fails_to_reload),
with real processes."""

import json
import re
import socket
import time

import requests

from container.supervisor.processes import CRASH_WINDOW
from tests.reliability import record
from tests.server import MODEL_DIRS, REPO, Server, metric

POISON = {"exit": 5}


def test_a_request_that_stopped_the_engine_twice_is_refused_and_others_are_served():
    with Server(MODEL_DIRS / "crashes") as server:
        answers = []
        for _ in range(2):
            r = server.invoke(POISON, headers={"X-Amzn-SageMaker-Inference-Id": f"poison-{len(answers)}"})
            answers.append(r.status_code)
            assert "stopped while handling the request" in r.json()["error"]
            server.wait_until(lambda r: r.status_code == 200, timeout=30)
        assert answers == [503, 503]
        (group,) = server.group_pids()
        started = time.monotonic()
        third = server.invoke(POISON)
        refused_in = time.monotonic() - started
        assert third.status_code == 422
        body = third.json()
        assert body["code"] == 422 and "stopped the model's engine twice" in body["error"]
        for i in range(5):
            assert server.invoke({"n": i}).json()["echo"] == {"n": i}
        assert server.invoke(POISON).status_code == 422
        handed = metric(server, "sagelmi_requests_read_early_total")
        late = _copy_whose_body_comes_after_its_head(server)  # the frontend cannot see it whole: rank 0 refuses it
        assert metric(server, "sagelmi_requests_read_early_total") - handed == 1  # no request thread read it
        assert late.startswith(b"HTTP/1.1 422 ") and b"Connection: keep-alive" in late
        lmi = json.loads(late.partition(b"\r\n\r\n")[2])
        assert lmi["code"] == 422 and lmi["message"] == "request stopped the engine"
        assert "stopped the model's engine twice" in lmi["error"]
        assert server.group_pids() == [group]  # the refused copies never reached the group
        assert requests.get(server.url("/ping"), timeout=2).status_code == 200
        assert metric(server, "sagelmi_poison_requests_refused_total") == 3
        log = server.log()
        refusals = [line for line in log.splitlines() if "copies of it are refused" in line]
        assert len(refusals) == 1 and "poison-1" in refusals[0] and "ERROR" in refusals[0]
        assert '"exit"' not in log  # the body is never logged
        # the exit status is the handler's: not read as one of sagelmi's own reasons
        assert "exited with code 5 without a reason from sagelmi's worker" in log
        assert "ranks went away" not in log
    record("poison-request", "A request that kills its worker group", {
        "copies 1 and 2": "503 (the group died with them in flight; restarted)",
        "copy 3 and later": f"422 at once ({refused_in * 1000:.0f} ms), the group not restarted",
        "other requests meanwhile": "200"},
        note="tests/model_dirs/crashes: `{\"exit\": 5}` ends the handler's process. The request is known by a "
             "hash of its route and body; the log names its request id, never its body.")


def _copy_whose_body_comes_after_its_head(server) -> bytes:
    """A copy of POISON sent in two writes, its body 0.3 s after its head: the answer."""
    body = json.dumps(POISON).encode()
    head = f"POST /invocations HTTP/1.1\r\nHost: test\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head)
        time.sleep(0.3)
        sock.sendall(body)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
            answer += sock.recv(65536)
    return answer


def _length(answer: bytes) -> int:
    found = re.search(rb"\r\ncontent-length: (\d+)\r\n", answer.partition(b"\r\n\r\n")[0], re.I)
    return int(found.group(1)) if found else 0


def _restart_delays(log: str) -> list[float]:
    return [float(d) if d else 0.0 for d in re.findall(r"died: .*; restarting it(?: in ([\d.]+)s)?$", log, re.M)]


def test_a_group_that_dies_after_every_start_backs_off_and_ping_says_why(tmp_path):
    dying_starts = 4
    env = {"OPTION_DIE_AFTER_SECONDS": "1", "OPTION_DIE_STARTS": str(dying_starts),
           "OPTION_START_COUNT_FILE": str(tmp_path / "starts")}
    with Server(MODEL_DIRS / "crashes", env=env) as server:
        started = time.monotonic()
        server.wait_until(lambda r: r.json()["workers"][0].get("crash_loop"), timeout=60)
        looping_at = time.monotonic()
        pings = []
        while not (tmp_path / "starts").exists() or int((tmp_path / "starts").read_text()) <= dying_starts:
            pings.append(requests.get(server.url("/ping"), timeout=2))
            time.sleep(0.1)
            assert time.monotonic() - started < 120
        # the last start stays up; /ping stays 503 until it has stayed up CRASH_WINDOW seconds
        while time.monotonic() - looping_at < 5:
            pings.append(requests.get(server.url("/ping"), timeout=2))
            time.sleep(0.1)
        assert pings and all(p.status_code == 503 for p in pings)
        worker = pings[-1].json()["workers"][0]
        assert worker["crash_loop"] is True and worker["restarts"] >= 3
        assert "exited with code 9 without a reason from sagelmi's worker" in worker["last_exit"]
        recovered = server.wait_until(lambda r: r.status_code == 200, timeout=CRASH_WINDOW + 30)
        recovered_in = time.monotonic() - started
        assert "crash_loop" not in recovered.json()["workers"][0]
        assert server.invoke({"after": 1}).status_code == 200
        log = server.log()
    delays = _restart_delays(log)
    assert delays == [0.0, 1.0, 2.0, 4.0], delays  # growing intervals
    assert log.count("is crash-looping") == 1
    assert "no longer crash-looping" in log
    record("crash-loop", "A worker group that dies 1 s after every start", {
        "deaths before it stayed up": dying_starts, "delays before the restarts (s)": ", ".join(f"{d:g}" for d in delays),
        "/ping while crash-looping": f"503 ({len(pings)} polls), naming the exit",
        f"seconds until /ping was 200 (the last start stayed up {CRASH_WINDOW:g} s)": f"{recovered_in:.1f}"},
        note="tests/model_dirs/crashes with option.die_after_seconds=1 in its first 4 starts.")


def _poll(url: str, condition, timeout: float = 120) -> requests.Response:
    """The first answer of ``url`` that meets ``condition`` (an answer slower than 10 s on a loaded
    machine, or none yet, is asked again, as one that does not meet it yet)."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            answer = requests.get(url, timeout=10)
        except requests.Timeout:
            continue
        except requests.ConnectionError:  # the frontend not listening yet
            time.sleep(0.1)
            continue
        if condition(answer):
            return answer
        last = answer.text
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer as expected within {timeout:g} s; last: {last}")


def test_ping_and_models_say_why_a_group_cannot_load_again_without_local_paths(tmp_path):
    """The worker's error names the file it could not read: /ping and /models show the error
    with the path replaced, the log keeps it whole."""
    model_dir = MODEL_DIRS / "fails_to_reload"
    # not waited for ready: the first start ends 1 s after it loaded, and on a loaded machine the
    # frontend may come up only after that
    server = Server(model_dir, env={"OPTION_MARKER": str(tmp_path / "loaded-once")}).start(wait_ready=False)
    try:
        ping = _poll(server.url("/ping"), lambda r: "No such file" in r.json()["workers"][0].get("last_exit", ""))
        models = _poll(server.url("/models"), lambda r: "No such file" in r.text)
        log = server.log()
    finally:
        server.stop()
    assert "worker group 0 is ready" in log  # the first start loaded
    worker = ping.json()["workers"][0]
    assert ping.status_code == 503 and worker["detail"].endswith("No such file or directory: '<path>'")
    assert worker["last_exit"].endswith("FileNotFoundError: [Errno 2] No such file or directory: '<path>'")
    assert models.json()["models"][0]["workerGroups"][0]["detail"].endswith("No such file or directory: '<path>'")
    for text in (ping.text, models.text):
        assert str(REPO) not in text and "missing-weights" not in text
    assert f"No such file or directory: '{model_dir / 'missing-weights.bin'}'" in log
