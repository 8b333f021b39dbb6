"""LMI's schema on /invocations against real vLLM (tests/e2e/conftest.py)."""

import json
import time

import pytest
import requests

from tests.e2e.conftest import TINY_CONTEXT

pytestmark = pytest.mark.slow


def generate(server, prompt="Hello world", **parameters):
    r = server.invoke({"inputs": prompt, "parameters": parameters})
    assert r.status_code == 200, r.text
    return r.json()


def test_non_streaming_answer(vllm_server):
    body = generate(vllm_server, max_new_tokens=8)
    assert set(body) == {"generated_text"}
    assert isinstance(body["generated_text"], str) and body["generated_text"]


def test_details_carry_per_token_log_probs(vllm_server):
    body = generate(vllm_server, max_new_tokens=6, details=True, ignore_eos=True)
    details = body["details"]
    assert details["finish_reason"] == "length"
    assert details["generated_tokens"] == 6
    assert details["inputs"] == "Hello world"
    assert len(details["tokens"]) == 6
    for token in details["tokens"]:
        assert isinstance(token["id"], int)
        assert isinstance(token["text"], str)
        assert token["log_prob"] <= 0
    assert "".join(t["text"] for t in details["tokens"]) == body["generated_text"]


def test_top_n_tokens(vllm_server):
    details = generate(vllm_server, max_new_tokens=3, details=True, top_n_tokens=2)["details"]
    assert len(details["top_tokens"]) == 3
    for candidates in details["top_tokens"]:
        assert len(candidates) == 2
        assert candidates[0]["log_prob"] >= candidates[1]["log_prob"]


def test_streaming_is_json_lines_ending_with_the_text(vllm_server):
    with vllm_server.invoke({"inputs": "Hello world", "stream": True,
                             "parameters": {"max_new_tokens": 5, "ignore_eos": True, "details": True}},
                            stream=True) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/jsonlines"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert len(lines) == 5
    for line in lines:
        assert set(line["token"]) == {"id", "text", "log_prob"}
    assert "generated_text" not in lines[0]
    last = lines[-1]
    assert last["generated_text"] == "".join(line["token"]["text"] for line in lines)
    assert last["details"]["finish_reason"] == "length"
    assert last["details"]["generated_tokens"] == 5


def test_a_list_of_inputs_gets_a_list(vllm_server):
    r = vllm_server.invoke({"inputs": ["Hello world", "The quick brown fox"], "parameters": {"max_new_tokens": 4}})
    assert r.status_code == 200
    body = r.json()
    assert isinstance(body, list) and len(body) == 2
    assert all(set(item) == {"generated_text"} for item in body)


def test_return_full_text(vllm_server):
    body = generate(vllm_server, max_new_tokens=3, return_full_text=True)
    assert body["generated_text"].startswith("Hello world")


def test_stop_sequences_end_the_answer(vllm_server):
    free = generate(vllm_server, max_new_tokens=12, ignore_eos=True, details=True)
    text = free["generated_text"]
    stop = next(t["text"] for t in free["details"]["tokens"][2:] if t["text"].strip())
    stopped = generate(vllm_server, max_new_tokens=12, ignore_eos=True, details=True, stop_sequences=[stop])
    assert stopped["details"]["finish_reason"] == "stop_sequence"
    assert stopped["generated_text"] == text[:text.index(stop)]


def test_seed_makes_sampling_reproducible(vllm_server):
    def sample(seed):
        return generate(vllm_server, max_new_tokens=16, do_sample=True, temperature=1.0, top_k=50, seed=seed,
                        ignore_eos=True)["generated_text"]

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in (1, 2, 3)}) > 1


@pytest.mark.parametrize("parameters,fragment", [
    ({"max_new_tokens": "many"}, "parameters.max_new_tokens"),
    ({"temperature": -1}, "parameters.temperature"),
    ({"top_p": 3}, "parameters.top_p"),
    ({"stop_sequences": 5}, "parameters.stop_sequences"),
    ({"top_k": -5}, "top_k"),
])
def test_bad_parameters_are_400_naming_them(vllm_server, parameters, fragment):
    r = vllm_server.invoke({"inputs": "Hello", "parameters": parameters})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]
    assert generate(vllm_server, max_new_tokens=2)["generated_text"] is not None


def test_bad_bodies_are_400(vllm_server):
    for body in ({"inputs": 5}, {"inputs": []}, {"parameters": {}}, {"inputs": "a", "stream": "yes"},
                 {"inputs": ["a", "b"], "stream": True}):
        r = vllm_server.invoke(body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["code"] == 400


def test_over_long_prompt_is_400_quickly_and_the_server_stays_healthy(vllm_server):
    started = time.monotonic()
    r = vllm_server.invoke({"inputs": "hello " * 9000, "parameters": {"max_new_tokens": 4}})
    assert time.monotonic() - started < 5
    assert r.status_code == 400
    assert f"maximum context length is {TINY_CONTEXT} tokens" in r.json()["error"]
    assert "9000" in r.json()["error"] or str(TINY_CONTEXT + 1) in r.json()["error"]
    streamed = vllm_server.invoke({"inputs": "hello " * 9000, "stream": True})
    assert streamed.status_code == 400
    assert requests.get(vllm_server.url("/ping"), timeout=2).status_code == 200
    assert generate(vllm_server, max_new_tokens=2)["generated_text"] is not None


def test_lmi_prompts_reach_vllm_rendered_without_its_deprecation_warning(vllm_server):
    # vLLM renders a raw prompt string inside add_request too, but warns that it is deprecated and
    # will be removed: a warning every LMI user would find in their log, caused by the container
    generate(vllm_server, max_new_tokens=2)
    streamed = vllm_server.invoke({"inputs": "Hello world", "stream": True, "parameters": {"max_new_tokens": 2}})
    assert streamed.status_code == 200 and streamed.text.strip().splitlines()
    assert "Passing raw prompts to InputProcessor is deprecated" not in vllm_server.log()
