"""Observability on the built-in vLLM engine (real vLLM, CPU build): the token counts of
the completion line, vLLM's own log lines with the request id, and vLLM's span in the
request's trace (option.otlp_traces_endpoint), all exported to a local OTLP/HTTP receiver.
Last, on the same server, what a killed worker leaves behind: nothing, and what a stop while its
replacement starts leaves: nothing."""

import os
import re
import secrets
import signal
import subprocess
import time

import pytest
import requests

from tests.e2e.conftest import EAGER, ENGINE_READY_TIMEOUT, EXACT, VLLM_CPU_ENV
from tests.otlp_receiver import OtlpReceiver
from tests.server import Server

pytestmark = pytest.mark.slow

PROMPT = "Hello there, tiny model"


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def server(tiny_model, receiver):
    traces = f"{receiver.endpoint}/v1/traces"
    with Server(tiny_model, env={
        **VLLM_CPU_ENV, **EXACT, **EAGER,  # logs and traces, not the compiled model
        "OPTION_ENABLE_LOG_REQUESTS": "true",  # vLLM logs "Added request ..." in the worker's process
        "OPTION_OTLP_TRACES_ENDPOINT": traces,  # vLLM's own tracing
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": traces,  # sagelmi's (and the protocol for both)
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }, ready_timeout=ENGINE_READY_TIMEOUT) as s:
        yield s


def completion_line(server: Server, request_id: str, timeout: float = 30) -> re.Match:
    pattern = re.compile(rf"frontend \[{re.escape(request_id)}\] sagelmi\.frontend: POST (\S+) -> (\d+) (\w+) in "
                         r"([\d.]+) ms \(first byte ([\d.]+) ms, (\d+) bytes(?:, tokens in (\S+) out (\S+))?\)$", re.M)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pattern.findall(server.log())
        if found:
            assert len(found) == 1, found
            return pattern.search(server.log())
        time.sleep(0.1)
    raise AssertionError(f"no completion line for {request_id}:\n{server.log()[-3000:]}")


def prompt_tokens(server: Server) -> int:
    r = requests.post(server.url("/v1/completions"), json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1},
                      timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_a_streamed_lmi_answer_logs_its_tokens_and_vllm_logs_with_the_request_id(server):
    rid = f"lmi-{secrets.token_hex(4)}"
    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 7, "ignore_eos": True}}
    r = requests.post(server.url("/invocations"), json=body, headers={"X-Amzn-SageMaker-Inference-Id": rid},
                      stream=True, timeout=120)
    text = b"".join(r.iter_content(None))
    assert r.status_code == 200 and text.count(b'"token"') == 7
    line = completion_line(server, rid)
    assert line.group(3) == "completed" and int(line.group(6)) == len(text)
    assert float(line.group(4)) >= float(line.group(5))
    assert (int(line.group(7)), int(line.group(8))) == (prompt_tokens(server), 7)
    # vLLM's own line, in the worker's process, carries the request id and sagelmi's format
    assert re.search(rf"worker-0 \[{re.escape(rid)}\] vllm\.\S+: Added request {re.escape(rid)}-", server.log())


def test_an_openai_chat_logs_the_usage_vllm_answered(server):
    rid = f"chat-{secrets.token_hex(4)}"
    r = requests.post(server.url("/v1/chat/completions"), headers={"X-Amzn-SageMaker-Inference-Id": rid},
                      json={"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5,
                            "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    line = completion_line(server, rid)
    assert (int(line.group(7)), int(line.group(8))) == (usage["prompt_tokens"], usage["completion_tokens"]) != (0, 0)


def test_vllms_span_joins_the_requests_trace(server, receiver):
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    r = requests.post(server.url("/invocations"), headers={"traceparent": f"00-{trace_id}-{parent}-01"},
                      json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    spans = receiver.wait_for(trace_id, 3)
    by_name = {s.name: s for s in spans}
    frontend, worker, engine = by_name["POST /invocations"], by_name["sagelmi.handler"], by_name["llm_request"]
    assert frontend.parent_span_id == parent
    assert worker.parent_span_id == frontend.span_id
    assert engine.parent_span_id == worker.span_id
    assert engine.attributes["gen_ai.usage.completion_tokens"] == 4
    assert frontend.attributes["gen_ai.usage.output_tokens"] == worker.attributes["gen_ai.usage.output_tokens"] == 4


@pytest.mark.parametrize("path,body", [
    ("/v1/responses", {"input": PROMPT, "max_output_tokens": 4, "ignore_eos": True}),
    ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}),
], ids=["responses", "messages"])
def test_the_responses_and_messages_apis_are_traced_and_logged_as_the_other_routes(server, receiver, path, body):
    trace_id, parent, rid = secrets.token_hex(16), secrets.token_hex(8), f"api-{secrets.token_hex(4)}"
    r = requests.post(server.url(path), json=body, timeout=120,
                      headers={"traceparent": f"00-{trace_id}-{parent}-01", "X-Amzn-SageMaker-Inference-Id": rid})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    spans = {s.name: s for s in receiver.wait_for(trace_id, 3)}
    frontend, worker, engine = spans[f"POST {path}"], spans["sagelmi.handler"], spans["llm_request"]
    assert (frontend.parent_span_id, worker.parent_span_id, engine.parent_span_id) == \
        (parent, frontend.span_id, worker.span_id)
    assert frontend.attributes["gen_ai.usage.output_tokens"] == usage["output_tokens"] > 0
    line = completion_line(server, rid)
    assert (line.group(1), line.group(2), line.group(3)) == (path, "200", "completed")
    assert (int(line.group(7)), int(line.group(8))) == (usage["input_tokens"], usage["output_tokens"])


def _group_members(pgid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _gone(pgid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while _group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_killed_engine_worker_leaves_no_engine_processes_behind(server):
    """Last in this module: it kills the worker, then stops the server while the worker started in its
    place is bringing up its engine: the start is given up at once, quietly, and leaves nothing behind
    (the restarted group serving again is tests/e2e/test_lmi_dist.py's)."""
    (worker,) = server.worker_pids()
    assert len(_group_members(worker)) > 1  # vLLM's EngineCore runs beside the worker
    os.kill(worker, signal.SIGKILL)
    assert _gone(worker), "vLLM processes of the killed worker are still running"
    deadline = time.monotonic() + ENGINE_READY_TIMEOUT
    while not ((pids := server.worker_pids()) and pids[0] != worker and len(_group_members(pids[0])) > 1):
        assert time.monotonic() < deadline, "no worker was started again with its engine"
        time.sleep(0.2)
    (restarted,) = pids
    since = len(server.log())
    assert server.stop() == 0
    assert _gone(restarted), "a stop left the starting engine's processes behind"
    stop = server.log()[since:]
    assert "stopping while the model was still loading" in stop, stop
    for noise in ("did not stop within", "sending SIGKILL", "Traceback"):  # vLLM's start given up, not awaited
        assert noise not in stop, f"{noise!r} in the log of a stop:\n{stop}"
