"""Client mistakes and abuse against real vLLM (issue #12): range-checked numbers, bounded
stop sequences, 4xx for bad input (logged as one line), no local paths in answers."""

import json
import threading
import time

import pytest
import requests

from tests.server import metric, send_and_leave_open, wait_idle

pytestmark = pytest.mark.slow

INT64_MAX = 2**63 - 1


@pytest.mark.parametrize("parameters,fragment", [
    ({"seed": 1180591620717411303424}, "parameters.seed"),
    ({"seed": -(2**70)}, "parameters.seed"),
    ({"max_new_tokens": 2**64}, "parameters.max_new_tokens"),
    ({"top_k": 2**64}, "parameters.top_k"),
    ({"min_tokens": 2**64}, "parameters.min_tokens"),
    ({"stop_token_ids": [2**64]}, "parameters.stop_token_ids"),
])
def test_out_of_range_numbers_are_400_and_leave_nothing_in_the_engine(vllm_server, parameters, fragment):
    wait_idle(vllm_server)
    for stream in (False, True):
        r = vllm_server.invoke({"inputs": "Hello", "stream": stream, "parameters": {"max_new_tokens": 4, **parameters}})
        assert r.status_code == 400, r.text
        assert fragment in r.json()["error"]
    assert metric(vllm_server, "sagelmi_engine_unfinished_requests") == 0


def test_infinite_floats_are_400(vllm_server):
    r = requests.post(vllm_server.url("/invocations"), data='{"inputs": "Hello", "parameters": {"temperature": '
                      'Infinity, "do_sample": true}}', headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert "parameters.temperature" in r.json()["error"]


def test_too_many_or_too_long_stop_sequences_are_400(vllm_server):
    for parameters, fragment in (({"stop_sequences": ["x"] * 5}, "parameters.stop_sequences"),
                                 ({"stop_sequences": ["x" * 2000]}, "parameters.stop_sequences"),
                                 ({"stop": ["x"] * 5}, "parameters.stop")):
        r = vllm_server.invoke({"inputs": "Hello", "parameters": {"max_new_tokens": 4, **parameters}})
        assert r.status_code == 400, r.text
        assert fragment in r.json()["error"] and "at most" in r.json()["error"]


def test_a_huge_stop_list_does_not_stall_other_requests(vllm_server):
    """400,000 stop strings (4 MB) once kept a concurrent 4-token request waiting 8.5 s."""
    wait_idle(vllm_server)
    answers = {}

    def abuse():
        answers["abuse"] = vllm_server.invoke({"inputs": "Hello", "parameters": {
            "max_new_tokens": 200, "ignore_eos": True, "stop_sequences": [f"s{i}" for i in range(400_000)]}})

    thread = threading.Thread(target=abuse)
    thread.start()
    time.sleep(0.3)
    started = time.monotonic()
    r = vllm_server.invoke({"inputs": "Hello", "parameters": {"max_new_tokens": 4}})
    elapsed = time.monotonic() - started
    thread.join(60)
    assert r.status_code == 200
    assert answers["abuse"].status_code == 400
    assert elapsed < 3, f"a 4-token request took {elapsed:.1f}s next to a huge stop list"
    wait_idle(vllm_server, timeout=10)


def test_deeply_nested_json_is_400_without_a_traceback(vllm_server):
    body = '{"inputs": "Hello", "parameters": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    r = requests.post(vllm_server.url("/invocations"), data=body, headers={"content-type": "application/json"},
                      timeout=60)
    assert r.status_code == 400, r.text
    assert "nested" in r.json()["error"]
    assert "RecursionError" not in vllm_server.log()


def test_an_empty_completion_prompt_is_400(vllm_server):
    for path in ("/v1/completions", "/invocations"):
        r = requests.post(vllm_server.url(path), json={"prompt": "", "max_tokens": 4}, timeout=60)
        assert r.status_code == 400, (path, r.text)
    assert metric(vllm_server, "sagelmi_engine_unfinished_requests") == 0


def test_no_local_path_in_model_names(vllm_server, tiny_model):
    path = str(tiny_model)
    listing = requests.get(vllm_server.url("/v1/models"), timeout=60).json()
    assert [(m["id"], m["root"]) for m in listing["data"]] == [(tiny_model.name, tiny_model.name)]
    chat = requests.post(vllm_server.url("/v1/chat/completions"), timeout=60, json={
        "model": "whatever", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    completion = requests.post(vllm_server.url("/v1/completions"), timeout=60,
                               json={"model": "x", "prompt": "hi", "max_tokens": 2})
    assert chat.json()["model"] == completion.json()["model"] == tiny_model.name
    with requests.post(vllm_server.url("/v1/completions"), stream=True, timeout=60,
                       json={"prompt": "hi", "max_tokens": 2, "stream": True}) as r:
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
    assert events and all(e["model"] == tiny_model.name for e in events)
    metrics = requests.get(vllm_server.url("/metrics"), timeout=60).text
    assert f'model_name="{tiny_model.name}"' in metrics
    assert path not in metrics
    assert path not in json.dumps(listing) + chat.text + completion.text


TOTAL = 48 * 8000  # tokens (48 of the 64 sequences the server batches): a minute or more of the tiny model's decoding, far longer than the test waits


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hello", "n": 48, "max_tokens": 8000, "ignore_eos": True}),
    ("/invocations", {"inputs": ["Hello"] * 48, "parameters": {"max_new_tokens": 8000, "ignore_eos": True}}),
], ids=["openai", "lmi"])
def test_a_non_streaming_request_is_aborted_when_its_client_leaves(vllm_server, path, body):
    """An n=1000 completion whose client left after 3 s once kept the engine busy until
    predict_timeout (120 s), and a concurrent 4-token request took 20 s instead of 0.03 s."""
    wait_idle(vllm_server)
    before = metric(vllm_server, "vllm:generation_tokens_total")
    client = send_and_leave_open(vllm_server.port, path, body)
    deadline = time.monotonic() + 60
    while metric(vllm_server, "vllm:generation_tokens_total") - before < 100:  # the engine is at it
        assert time.monotonic() < deadline, "the engine never started on the request"
        time.sleep(0.1)
    started = time.monotonic()
    short = vllm_server.invoke({"inputs": "Hello", "parameters": {"max_new_tokens": 4}})
    print(f"a 4-token request next to it took {time.monotonic() - started:.2f}s")
    assert short.status_code == 200
    client.close()
    dropped = time.monotonic()
    wait_idle(vllm_server, timeout=30)
    seconds = time.monotonic() - dropped
    generated = metric(vllm_server, "vllm:generation_tokens_total") - before
    print(f"engine empty {seconds:.2f}s after the client left; {generated:.0f} of {TOTAL} tokens generated")
    assert generated < TOTAL, "the request ran to its end"
    assert seconds < 10
    assert f"POST {path} -> 499" in vllm_server.log()
