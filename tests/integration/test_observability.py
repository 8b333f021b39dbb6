"""Completion log lines, JSON logs, the request metrics and tracing, against a real
server running tests/model_dirs/observed, its spans sent to a local OTLP/HTTP receiver
(tests/otlp_receiver.py) by the real OpenTelemetry exporters."""

import json
import secrets
import threading
import time

import pytest
import requests

from tests.otlp_receiver import OtlpReceiver
from tests.server import MODEL_DIRS, RawStream, Server, metric

QUEUE = 2


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def server(receiver):
    with Server(MODEL_DIRS / "observed", env={
        "SAGELMI_LOG_FORMAT": "json",
        "SERVING_JOB_QUEUE_SIZE": str(QUEUE),
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_SERVICE_NAME": "observed-test",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }) as s:
        yield s


def records(server: Server) -> list[dict]:
    """The server's JSON log records (lines before the settings were read are text)."""
    found = []
    for line in server.log().splitlines():
        if line.startswith("{"):
            found.append(json.loads(line))
    return found


def completions(server: Server, request_id: str) -> list[dict]:
    return [r for r in records(server) if r.get("request_id") == request_id and "outcome" in r]


def wait_completion(server: Server, request_id: str, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = completions(server, request_id)
        if lines:
            time.sleep(0.3)  # a second line would come now
            lines = completions(server, request_id)
            assert len(lines) == 1, lines
            return lines[0]
        time.sleep(0.05)
    raise AssertionError(f"no completion line for {request_id}:\n{server.log()[-3000:]}")


def test_a_stream_logs_one_completion_line_when_it_has_ended(server, tmp_path):
    gate = tmp_path / "gate"
    rid = f"stream-{secrets.token_hex(4)}"
    stream = RawStream(server.port, "/invocations", {"stream": ["a", "b", "c"], "gate": str(gate), "tokens": [5, 3]},
                       headers={"X-Amzn-SageMaker-Inference-Id": rid})
    assert len(stream.read_lines(2)) == 2
    time.sleep(0.6)
    assert completions(server, rid) == []  # the answer has not ended: no line yet
    gate.touch()
    lines = stream.read_lines(3)
    body = stream._buffer
    assert [json.loads(line)["outputs"]["item"] for line in lines] == ["a", "b", "c"]
    line = wait_completion(server, rid)
    assert line["outcome"] == "completed" and line["streamed"] is True and line["status"] == 200
    assert line["route"] == "/invocations" and line["method"] == "POST"
    assert line["duration_ms"] >= 600 > line["first_byte_ms"]
    assert line["bytes"] == len(body)
    assert (line["prompt_tokens"], line["completion_tokens"]) == (5, 3)
    assert line["level"] == "INFO" and line["component"] == "frontend"
    assert "completed in" in line["message"] and "tokens in 5 out 3" in line["message"]


def test_a_stream_the_client_leaves_is_logged_as_client_gone(server):
    rid = f"gone-{secrets.token_hex(4)}"
    stream = RawStream(server.port, "/invocations", {"forever": True}, headers={"X-Amzn-SageMaker-Inference-Id": rid})
    assert len(stream.read_lines(2)) == 2
    stream.close()
    line = wait_completion(server, rid)
    assert line["outcome"] == "client_gone" and line["streamed"] is True
    assert line["bytes"] > 0 and line["prompt_tokens"] is None


def test_a_whole_answer_logs_its_length_and_the_handlers_own_lines_carry_the_request_id(server):
    rid = f"whole-{secrets.token_hex(4)}"
    r = server.invoke({"say": "hello"}, headers={"X-Amzn-SageMaker-Inference-Id": rid})
    assert r.status_code == 200
    line = wait_completion(server, rid)
    assert line["outcome"] == "completed" and line["streamed"] is False
    assert line["bytes"] == len(r.content)
    said = [rec for rec in records(server) if rec["message"] == "saying hello"]
    assert said and said[0]["request_id"] == rid and said[0]["component"] == "worker-0"
    assert said[0]["logger"] == "observed_model"


def test_json_lines_everywhere_once_the_settings_are_read(server):
    lines = server.log().splitlines()
    first_json = next(i for i, line in enumerate(lines) if line.startswith("{"))
    later = [line for line in lines[first_json:] if line.strip()]
    assert later and all(line.startswith("{") for line in later), [x for x in later if not x.startswith("{")][:5]
    components = {json.loads(line)["component"] for line in later}
    assert {"serve", "frontend", "worker-0"} <= components


def test_metrics_have_the_durations_queue_wait_and_full_queue_refusals(server, tmp_path):
    refused_before = metric(server, "sagelmi_requests_refused_queue_full_total")
    streams_before = metric(server, "sagelmi_stream_duration_seconds_count", route="/invocations")
    gate = tmp_path / "gate"
    held = [RawStream(server.port, "/invocations", {"stream": ["x", "y"], "gate": str(gate)}) for _ in range(QUEUE)]
    for stream in held:
        assert len(stream.read_lines(1)) == 1
    refused = server.invoke({"say": "one too many"})
    assert refused.status_code == 503 and "job_queue_size" in refused.json()["error"]
    assert metric(server, "sagelmi_requests_refused_queue_full_total") == refused_before + 1
    gate.touch()
    for stream in held:
        assert len(stream.read_lines(2)) == 2
    deadline = time.monotonic() + 10
    while metric(server, "sagelmi_stream_duration_seconds_count", route="/invocations") < streams_before + QUEUE:
        assert time.monotonic() < deadline, "the streams' durations were never observed"
        time.sleep(0.1)
    assert metric(server, "sagelmi_request_duration_seconds_count", route="/invocations") >= QUEUE + 1
    assert metric(server, "sagelmi_request_queue_seconds_count") >= QUEUE
    assert metric(server, "sagelmi_stream_duration_seconds_sum", route="/invocations") > 0


def test_one_trace_from_the_frontend_through_the_worker(server, receiver):
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    rid = f"traced-{secrets.token_hex(4)}"
    r = server.invoke({"say": "traced"}, headers={"traceparent": f"00-{trace_id}-{parent}-01",
                                                   "X-Amzn-SageMaker-Inference-Id": rid})
    assert r.status_code == 200
    spans = receiver.wait_for(trace_id, 2)
    frontend = [s for s in spans if s.resource.get("sagelmi.component") == "frontend"]
    worker = [s for s in spans if s.resource.get("sagelmi.component") == "worker-0"]
    assert len(frontend) == 1 and len(worker) == 1, spans
    assert frontend[0].parent_span_id == parent
    assert worker[0].parent_span_id == frontend[0].span_id
    assert frontend[0].name == "POST /invocations"
    assert frontend[0].attributes["http.response.status_code"] == 200
    assert frontend[0].attributes["sagelmi.request_id"] == worker[0].attributes["sagelmi.request_id"] == rid
    assert frontend[0].resource["service.name"] == "observed-test"


def test_an_xray_trace_header_names_the_trace(server, receiver):
    epoch, unique, parent = f"{int(time.time()):08x}", secrets.token_hex(12), secrets.token_hex(8)
    r = server.invoke({"say": "x-ray"},
                      headers={"X-Amzn-Trace-Id": f"Root=1-{epoch}-{unique};Parent={parent};Sampled=1"})
    assert r.status_code == 200
    spans = receiver.wait_for(epoch + unique, 2)
    assert {s.resource["sagelmi.component"] for s in spans} == {"frontend", "worker-0"}
    assert [s.parent_span_id for s in spans if s.resource["sagelmi.component"] == "frontend"] == [parent]


def test_a_stream_span_ends_with_the_stream(server, receiver, tmp_path):
    gate = tmp_path / "gate"
    trace_id = secrets.token_hex(16)
    stream = RawStream(server.port, "/invocations", {"stream": ["a", "b"], "gate": str(gate), "tokens": [2, 9]},
                       headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    assert len(stream.read_lines(1)) == 1
    timer = threading.Timer(0.5, gate.touch)
    timer.start()
    assert len(stream.read_lines(2)) == 2
    spans = receiver.wait_for(trace_id, 2)
    frontend = next(s for s in spans if s.resource["sagelmi.component"] == "frontend")
    assert frontend.attributes["gen_ai.usage.output_tokens"] == 9
    assert frontend.attributes["sagelmi.outcome"] == "completed"
