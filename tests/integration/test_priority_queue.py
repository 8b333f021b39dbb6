"""The worker's own queue in priority order, on a real server with a synchronous model.py
(tests/model_dirs/lmi_echo: one handler thread) and option.scheduling_policy=priority: requests
waiting for the handler leave lowest X-Priority first, first-come among equals (SageMaker's
custom attribute x-priority counts as the header). vLLM's queue is tests/e2e/test_priority.py's."""

import concurrent.futures
import time

import pytest
import requests

from tests.server import MODEL_DIRS, RawStream, Server, metric


@pytest.fixture(scope="module")
def server():
    with Server(MODEL_DIRS / "lmi_echo", env={"OPTION_SCHEDULING_POLICY": "priority"}) as s:
        yield s


def _wait_in_flight(server: Server, count: int) -> None:
    deadline = time.monotonic() + 10
    while metric(server, "sagelmi_requests_in_flight") < count:
        assert time.monotonic() < deadline, f"fewer than {count} requests in flight"
        time.sleep(0.02)


def test_requests_waiting_for_the_handler_leave_in_priority_order(server, tmp_path):
    gate = tmp_path / "gate"
    # the handler's only thread streams these lines until the gate file exists: the others wait
    holder = RawStream(server.port, "/invocations", {"lines": ["held", "done"], "gate": str(gate)})
    queued = [  # (name, headers), in the order they arrive
        ("a", {}),
        ("b", {"X-Priority": "5"}),
        ("c", {"X-Priority": "-1"}),
        ("d", {"X-Priority": "0"}),
        ("e", {"X-Amzn-SageMaker-Custom-Attributes": "x-priority=-1"}),
        ("f", {"X-Priority": "5"}),
    ]
    finished: dict[str, float] = {}

    def send(name: str, headers: dict) -> None:
        r = server.invoke({"inputs": name, "sleep": 0.1}, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        finished[name] = time.monotonic()

    try:
        with concurrent.futures.ThreadPoolExecutor(len(queued)) as pool:
            _wait_in_flight(server, 1)
            futures = []
            for n, (name, headers) in enumerate(queued):
                futures.append(pool.submit(send, name, headers))
                _wait_in_flight(server, n + 2)  # it arrived before the next one is sent
            time.sleep(0.3)  # the last one has reached the worker's queue
            gate.touch()
            for future in futures:
                future.result()
    finally:
        holder.close()
    order = sorted(finished, key=finished.__getitem__)
    assert order == ["c", "e", "a", "d", "b", "f"]


@pytest.mark.parametrize("value,fragment", [
    ("soon", "X-Priority: 'soon' is not a whole number"),
    (str(2**63), "X-Priority: 9223372036854775808 is out of range"),
])
def test_a_priority_that_is_no_int64_is_a_400_naming_the_header(server, value, fragment):
    r = server.invoke({"inputs": "x"}, headers={"X-Priority": value})
    assert r.status_code == 400 and fragment in r.json()["error"], r.text
    r = requests.post(server.url("/v1/completions"), json={"prompt": "x"}, headers={"X-Priority": value}, timeout=10)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
