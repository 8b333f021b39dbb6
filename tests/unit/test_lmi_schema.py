import json

import pytest

from container.core.errors import InputError
from handlers.engines.lmi_schema import Formatter, Generation, TokenInfo, finish_reason, parse_request

SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "repetition_penalty",
                   "logprobs", "prompt_logprobs", "ignore_eos", "min_p", "presence_penalty", "output_kind", "n"}


def parse(body):
    return parse_request(body, SAMPLING_FIELDS)


def test_defaults_are_lmis_greedy_30_tokens():
    request = parse({"inputs": "hi"})
    assert request.prompts == ["hi"] and not request.batched and not request.stream
    assert request.sampling == {"max_tokens": 30, "logprobs": 0, "temperature": 0.0}


def test_parameters_map_to_vllm_names():
    sampling = parse({"inputs": "hi", "parameters": {
        "max_new_tokens": 5, "do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 10, "seed": 3,
        "stop_sequences": ["\n"], "repetition_penalty": 1.1, "top_n_tokens": 2, "decoder_input_details": True,
        "ignore_eos_token": True, "min_p": 0.05, "watermark": True}}).sampling
    assert sampling == {"max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 10, "seed": 3, "stop": ["\n"],
                        "repetition_penalty": 1.1, "logprobs": 2, "prompt_logprobs": 1, "ignore_eos": True,
                        "min_p": 0.05}


def test_do_sample_false_is_greedy_even_with_a_temperature():
    assert parse({"inputs": "x", "parameters": {"do_sample": False, "temperature": 0.9}}).sampling["temperature"] == 0
    assert parse({"inputs": "x", "parameters": {"temperature": 0.9}}).sampling["temperature"] == 0.9
    assert parse({"inputs": "x", "parameters": {"stop_sequences": "END"}}).sampling["stop"] == ["END"]


@pytest.mark.parametrize("body,fragment", [
    ([1, 2], "JSON object"),
    ({"inputs": 3}, "'inputs'"),
    ({"inputs": ["a", 1]}, "'inputs'"),
    ({"inputs": ""}, "empty prompt"),
    ({"inputs": "x", "stream": "true"}, "'stream'"),
    ({"inputs": ["a", "b"], "stream": True}, "streaming takes one prompt"),
    ({"inputs": "x", "parameters": []}, "'parameters'"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
    ({"inputs": "x", "parameters": {"top_p": 1.5}}, "parameters.top_p"),
    ({"inputs": "x", "parameters": {"details": "maybe"}}, "parameters.details"),
    ({"inputs": "x", "parameters": {"n": 2}}, "n > 1"),
])
def test_bad_requests_name_the_field(body, fragment):
    with pytest.raises(InputError) as err:
        parse(body)
    assert fragment in str(err.value)


def test_finish_reasons():
    assert finish_reason("stop", None) == "eos_token"
    assert finish_reason("stop", "\n") == "stop_sequence"
    assert finish_reason("length", None) == "length"


def _generation():
    tokens = [TokenInfo(5, "He", -0.5, [TokenInfo(5, "He", -0.5), TokenInfo(9, "Hi", -1.0)]),
              TokenInfo(6, "llo", -0.25, [TokenInfo(6, "llo", -0.25), TokenInfo(7, "y", -2.0)])]
    return Generation(prompt="Say", text="Hello", tokens=tokens, finish_reason="length")


def test_non_streaming_forms():
    request = parse({"inputs": "Say", "parameters": {"details": True, "top_n_tokens": 2}})
    body = Formatter("jsonlines", tgi=False).body([_generation()], request)
    assert body["generated_text"] == "Hello"
    assert body["details"]["tokens"][0] == {"id": 5, "text": "He", "log_prob": -0.5}
    assert body["details"]["top_tokens"][1][1] == {"id": 7, "text": "y", "log_prob": -2.0}
    assert body["details"]["finish_reason"] == "length" and body["details"]["inputs"] == "Say"
    full = Formatter("jsonlines", tgi=False).body([_generation()], parse({"inputs": "Say",
                                                                          "parameters": {"return_full_text": True}}))
    assert full == {"generated_text": "SayHello"}


def test_tgi_compatible_forms():
    tgi = Formatter("jsonlines", tgi=True)
    body = tgi.body([_generation()], parse({"inputs": "Say"}))
    assert isinstance(body, list) and body[0]["details"]["tokens"][0] == {"id": 5, "text": "He", "logprob": -0.5}
    assert Formatter("json", tgi=True).stream_content_type == "text/event-stream"


def test_stream_lines_and_events():
    gen, params = _generation(), parse({"inputs": "Say", "parameters": {"details": True}}).parameters
    lines = Formatter("jsonlines", tgi=False)
    first = json.loads(lines.stream_item(gen.tokens[0], gen, params, last=False))
    assert first == {"token": {"id": 5, "text": "He", "log_prob": -0.5}}
    last = json.loads(lines.stream_item(gen.tokens[1], gen, params, last=True))
    assert last["generated_text"] == "Hello" and last["details"]["generated_tokens"] == 2
    assert "tokens" not in last["details"]
    event = Formatter("sse", tgi=False).stream_item(gen.tokens[0], gen, params, last=False)
    assert event.startswith(b"data: {") and event.endswith(b"\n\n")
    with pytest.raises(ValueError, match="output_formatter"):
        Formatter("xml", tgi=False)


@pytest.mark.parametrize("parameters,fragment", [
    ({"seed": 1180591620717411303424}, "parameters.seed"),
    ({"seed": -(2**63) - 1}, "parameters.seed"),
    ({"max_new_tokens": 2**63}, "parameters.max_new_tokens"),
    ({"top_k": 2**64}, "parameters.top_k"),
    ({"top_n_tokens": 2**64}, "parameters.top_n_tokens"),
    ({"temperature": float("inf")}, "parameters.temperature"),
    ({"repetition_penalty": float("nan")}, "parameters.repetition_penalty"),
    ({"min_p": float("inf")}, "parameters.min_p"),
    ({"presence_penalty": 2**64}, "parameters.presence_penalty"),
    ({"logit_bias": {"5": 2**70}}, "parameters.logit_bias.5"),
    ({"stop_token_ids": [1, 2**64]}, "parameters.stop_token_ids"),
])
def test_numbers_the_engine_cannot_take_are_refused_naming_the_field(parameters, fragment):
    with pytest.raises(InputError) as err:
        parse({"inputs": "hi", "parameters": parameters})
    assert fragment in str(err.value)


def test_int64_bounds_are_accepted():
    sampling = parse({"inputs": "hi", "parameters": {"seed": 2**63 - 1, "min_p": 0.5, "presence_penalty": -(2**63)}})
    assert sampling.sampling["seed"] == 2**63 - 1


@pytest.mark.parametrize("parameters,fragment", [
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "parameters.stop_sequences: 5 stop sequences; at most 4"),
    ({"stop_sequences": "x" * 1001}, "parameters.stop_sequences: a stop sequence of 1001 characters; at most 1000"),
    ({"stop": [str(i) for i in range(400_000)]}, "parameters.stop: 400000 stop sequences; at most 4"),
])
def test_stop_sequences_are_bounded(parameters, fragment):
    with pytest.raises(InputError) as err:
        parse({"inputs": "hi", "parameters": parameters})
    assert fragment in str(err.value)


def test_the_stop_bound_follows_the_engines():
    assert parse({"inputs": "hi", "parameters": {"stop_sequences": ["a"] * 4, "stop": "x" * 1000}}).sampling["stop"]
    body = {"inputs": "hi", "parameters": {"stop_sequences": ["a"] * 6}}
    assert parse_request(body, SAMPLING_FIELDS, max_stop_sequences=6).sampling["stop"] == ["a"] * 6


def test_adapters_name_one_per_prompt_and_null_is_the_base_model():
    assert parse_request({"inputs": ["a", "b"], "adapters": ["x", None]}, set()).prompts == ["a", "b"]
    with pytest.raises(InputError, match="'adapters' must be"):
        parse_request({"inputs": "a", "adapters": 3}, set())
