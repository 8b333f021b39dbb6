"""Priority scheduling end to end on real vLLM: one sequence at a time (max_rolling_batch_size=1)
and option.scheduling_policy=priority. While a long stream holds the engine's only place, requests
queue in vLLM's scheduler; the stream is then dropped, and they are served lowest priority first
(first-come among equals), whether the priority came in LMI's parameters, an OpenAI body or the
X-Priority header, on /invocations and the /v1 routes (Responses and Messages too). The first-come
server's refusals are tests/e2e/test_vllm_engine.py's (vllm_server)."""

import concurrent.futures
import time

import pytest
import requests

from tests.e2e.conftest import EAGER, ENGINE_READY_TIMEOUT, EXACT, VLLM_CPU_ENV
from tests.server import RawStream, Server, metric, wait_idle

pytestmark = pytest.mark.slow

# Each queued request's answer: enough engine steps that, with one request in the engine at a time, one
# ends a second or more after the one before: the client threads that note each end, on a loaded machine,
# do not swap two that ended a few steps apart (48 tokens did, once).
TOKENS = 400


@pytest.fixture(scope="module")
def server(tiny_model):
    # float32 (EXACT): an eager engine's bfloat16 kernels died of SIGILL on its first request on CI's CPUs (2026-11-29)
    env = {**VLLM_CPU_ENV, **EAGER, **EXACT, "OPTION_MAX_ROLLING_BATCH_SIZE": "1", "OPTION_SCHEDULING_POLICY": "priority"}
    with Server(tiny_model, env=env, ready_timeout=ENGINE_READY_TIMEOUT) as s:
        yield s


def _until(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def served_order(server: Server, holder: tuple[str, dict], queued: list[tuple[str, str, dict, dict]]) -> list[str]:
    """The order in which the engine answered ``queued`` ((name, path, body, headers), sent in that
    order, each once the one before waits in vLLM's scheduler) while ``holder`` (path, body: a long
    stream) held its only place; the holder is then dropped (vLLM aborts it)."""
    finished: dict[str, float] = {}

    def send(name: str, path: str, body: dict, headers: dict) -> None:
        r = requests.post(server.url(path), json=body, headers=headers, timeout=120)
        assert r.status_code == 200, (name, r.text)
        finished[name] = time.monotonic()

    stream = RawStream(server.port, holder[0], holder[1], timeout=120)
    with concurrent.futures.ThreadPoolExecutor(len(queued)) as pool:
        try:
            assert stream.response.status == 200 and stream.read_lines(2)  # it runs: the only place is taken
            futures = []
            for n, (name, path, body, headers) in enumerate(queued, start=1):
                futures.append(pool.submit(send, name, path, body, headers))
                _until(lambda: metric(server, "vllm:num_requests_waiting") >= n, f"{name} never waited in vLLM")
            assert not finished and metric(server, "vllm:num_requests_running") == 1
        finally:
            stream.close()  # the engine's place goes to the queue, in the scheduler's order
        for future in futures:
            future.result()
    wait_idle(server)
    return sorted(finished, key=finished.__getitem__)


def lmi(priority: int | None = None) -> dict:
    parameters: dict = {"max_new_tokens": TOKENS, "ignore_eos": True}
    if priority is not None:
        parameters["priority"] = priority
    return {"inputs": "The quick brown fox", "parameters": parameters}


def completion(priority: int | None = None) -> dict:
    body: dict = {"prompt": "The quick brown fox", "max_tokens": TOKENS, "ignore_eos": True}
    return body if priority is None else {**body, "priority": priority}


def test_invocations_serve_a_lower_priority_value_sent_last_before_those_queued_ahead(server):
    holder = ("/invocations", {"inputs": "Hold", "stream": True, "parameters": {"max_new_tokens": 8000,
                                                                                 "ignore_eos": True}})
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": TOKENS, "ignore_eos": True,
            "priority": -2}
    queued = [
        ("default", "/invocations", lmi(), {}),  # priority 0
        ("five", "/invocations", lmi(5), {}),
        ("header", "/invocations", lmi(), {"X-Priority": "-1"}),
        ("header-over-body", "/invocations", lmi(7), {"X-Priority": "-1"}),  # the header wins, as in vLLM
        ("openai-body", "/invocations", completion(-3), {}),
        ("chat-body", "/invocations", chat, {}),
        ("also-default", "/invocations", lmi(), {}),
        ("last", "/invocations", lmi(-9), {}),
    ]
    assert served_order(server, holder, queued) == [
        "last", "openai-body", "chat-body", "header", "header-over-body", "default", "also-default", "five",
    ]


def test_v1_completions_serve_a_lower_priority_value_sent_last_before_those_queued_ahead(server):
    holder = ("/v1/completions", {**completion(), "max_tokens": 8000, "stream": True})
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": TOKENS,
            "ignore_eos": True, "priority": 1}
    messages = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": TOKENS}
    queued = [
        ("default", "/v1/completions", completion(), {}),
        ("three", "/v1/completions", completion(3), {}),
        ("chat", "/v1/chat/completions", chat, {}),
        ("header", "/v1/completions", completion(), {"X-Priority": "-1"}),
        ("responses", "/v1/responses", {"input": "Hi", "max_output_tokens": TOKENS, "priority": -2}, {}),
        ("messages", "/v1/messages", {**messages, "priority": 9}, {"X-Priority": "-3"}),  # the header alone
        ("last", "/v1/completions", completion(-4), {}),
    ]
    order = ["last", "messages", "responses", "header", "default", "chat", "three"]
    assert served_order(server, holder, queued) == order


@pytest.mark.parametrize("path,body,headers,fragment", [
    ("/invocations", lmi(), {"X-Priority": "urgent"}, "X-Priority: 'urgent' is not a whole number"),
    ("/invocations", lmi(), {"X-Priority": str(2**63)}, "X-Priority: 9223372036854775808 is out of range"),
    ("/invocations", {**lmi(), "parameters": {"priority": "soon"}}, {}, "parameters.priority: "),
    ("/invocations", {**lmi(), "parameters": {"priority": 2**63}}, {}, "parameters.priority: "),
    ("/invocations", completion(2**63), {}, "priority: "),
    ("/v1/completions", completion(), {"X-Priority": "1.5"}, "X-Priority: '1.5' is not a whole number"),
    ("/v1/completions", completion(-(2**63) - 1), {}, "priority: "),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "priority": "first"}, {}, "priority: "),
], ids=["header-word", "header-range", "lmi-word", "lmi-range", "openai-on-invocations", "v1-header",
        "v1-range", "chat-word"])
def test_a_priority_that_is_no_int64_is_a_400_naming_its_field(server, path, body, headers, fragment):
    r = requests.post(server.url(path), json=body, headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"] if path.startswith("/v1/") else r.json()["error"]
    assert message.startswith(fragment), message
    assert metric(server, "sagelmi_engine_unfinished_requests") == 0


def test_a_sigterm_stops_the_engine_quietly(server):
    """Last in this module: it stops the module's server (a plain vLLM engine) as SageMaker stops a container.
    vLLM's processes end within the time sagelmi gives them: no force kill (vLLM's or the supervisor's), no
    traceback, exit status 0."""
    since = len(server.log())
    assert server.invoke({"inputs": "Hi", "parameters": {"max_new_tokens": 4}}).status_code == 200
    assert server.stop() == 0
    stop = server.log()[since:]
    assert "sagelmi.serve: stopped" in stop, stop
    for noise in ("force killing", "sending SIGKILL", "did not stop within", "Traceback", "EngineDeadError"):
        assert noise not in stop, f"{noise!r} in the log of a stop:\n{stop}"
