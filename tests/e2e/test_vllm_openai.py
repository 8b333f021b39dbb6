"""OpenAI-compatible routes through the official openai client (and Anthropic's Messages API through
the anthropic client), against real vLLM."""

import json
import time

import anthropic
import openai
import pytest
import requests

from tests.readme import run_shell, section, shell_commands
from tests.server import drop_stream_and_wait_until_idle, metric, send_and_leave_open, wait_idle

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]
DOC_COMMANDS = shell_commands(section("Responses and Messages APIs"))  # docs/engine.md


@pytest.fixture(scope="module")
def client(vllm_server):
    return openai.OpenAI(base_url=vllm_server.url("/v1"), api_key="unused", max_retries=0)


def test_chat_completion(client):
    completion = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                                temperature=0, extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    assert completion.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 6
    assert completion.usage.prompt_tokens > 0
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 6


def test_chat_completion_streaming(client):
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5


def test_chat_logprobs_seed_n_and_stop(client):
    completion = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, logprobs=True,
                                                top_logprobs=2, n=2, seed=3, temperature=1.0)
    assert len(completion.choices) == 2
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens // 2 or len(content) <= 4
    assert len(content[0].top_logprobs) == 2
    again = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, n=2, seed=3,
                                           temperature=1.0)
    assert [c.message.content for c in again.choices] == [c.message.content for c in completion.choices]


def test_completion_and_streaming_completion(client):
    completion = client.completions.create(model="tiny", prompt="Hello world", max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.object == "text_completion"
    assert completion.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Hello world", max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == completion.choices[0].text


def test_completion_stop(client):
    free = client.completions.create(model="tiny", prompt="Hello world", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free.strip()[2:4] or free[2:4]
    stopped = client.completions.create(model="tiny", prompt="Hello world", max_tokens=10, temperature=0,
                                        stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text


def test_models_route(client):
    assert len(client.models.list().data) == 1


def test_chat_on_invocations_and_sse(vllm_server):
    body = vllm_server.invoke({"messages": MESSAGES, "max_tokens": 3}).json()
    assert body["object"] == "chat.completion"
    with vllm_server.invoke({"messages": MESSAGES, "max_tokens": 3, "stream": True}, stream=True) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][len("data: "):])["object"] == "chat.completion.chunk"


def test_openai_errors_are_400_and_the_client_raises(client, vllm_server):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi " * 9000}],
                                       max_tokens=4)
    assert "maximum context length" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=-1)
    r = requests.post(vllm_server.url("/v1/chat/completions"), json={"model": "x"}, timeout=10)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_tokenize_then_detokenize_round_trips_text(vllm_server):
    text = "Hello world, the quick brown fox."
    tokens = requests.post(vllm_server.url("/tokenize"), json={"prompt": text, "add_special_tokens": False},
                           timeout=60).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    back = requests.post(vllm_server.url("/detokenize"), json={"tokens": tokens["tokens"]}, timeout=60).json()
    assert back["prompt"] == text


def test_tokenize_messages_counts_the_chat_prompt(vllm_server, client):
    tokens = requests.post(vllm_server.url("/tokenize"), json={"messages": MESSAGES}, timeout=60).json()
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert tokens["count"] == chat.usage.prompt_tokens


def test_tokenizer_routes_refuse_bad_bodies_in_openais_envelope(vllm_server):
    for path, body in (("/tokenize", {"prompt": 3}), ("/detokenize", {"tokens": "abc"}), ("/tokenize", [1]),
                       ("/detokenize", {"tokens": [1, 10**30]}), ("/detokenize", {"tokens": [-1]})):
        answer = requests.post(vllm_server.url(path), json=body, timeout=60)
        assert answer.status_code == 400, (path, answer.text)
        assert set(answer.json()["error"]) >= {"message", "type", "code"}, answer.text


def test_pooling_routes_on_a_generation_model_are_400_naming_the_task(vllm_server, client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="tiny", input="hello")
    assert "served for text generation" in refused.value.message and "/v1/chat/completions" in refused.value.message
    for path, body in (("/v1/score", {"queries": "a", "documents": ["b"]}),
                       ("/v1/rerank", {"query": "a", "documents": ["b"]})):
        answer = requests.post(vllm_server.url(path), json=body, timeout=60)
        assert answer.status_code == 400, answer.text
        assert "served for text generation" in answer.json()["error"]["message"], answer.text


# -- OpenAI's Responses API and Anthropic's Messages API (vLLM's serving classes)

@pytest.fixture(scope="module")
def claude(vllm_server):
    return anthropic.Anthropic(base_url=vllm_server.url(""), api_key="unused", max_retries=0)


def test_responses_through_the_openai_client(client, vllm_server):
    response = client.responses.create(model="tiny", instructions="You are terse.", input="Say hello",
                                       max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert response.object == "response" and response.output_text
    assert response.usage.output_tokens == 6 and response.usage.input_tokens > 0
    assert "POST /v1/responses -> 200 completed" in vllm_server.log()


def test_a_streamed_response_through_the_openai_client_is_the_same_answer(client):
    asked = dict(model="tiny", input=[{"role": "user", "content": "Say hello"}], instructions="You are terse.",
                 max_output_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    whole = client.responses.create(**asked)
    events = list(client.responses.create(**asked, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed", kinds
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert streamed == events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == 5


def test_messages_through_the_anthropic_client(claude):
    asked = dict(model="tiny", system="You are terse.", messages=[{"role": "user", "content": "Say hello"}],
                 max_tokens=6, extra_body={"temperature": 0})  # (the anthropic client has no sampling arguments)
    message = claude.messages.create(**asked)
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "text"
    assert message.content[0].text
    assert message.stop_reason in ("max_tokens", "end_turn") and 0 < message.usage.output_tokens <= 6
    with claude.messages.stream(**asked) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == message.content[0].text == final.content[0].text
    assert final.usage.output_tokens == message.usage.output_tokens


def test_the_docs_examples(vllm_server):
    response, message = (json.loads(run_shell(command, vllm_server.port).stdout) for command in DOC_COMMANDS)
    # (the tiny model's sampled answer may end at its first token: an output message with no text)
    assert response["object"] == "response" and response["output"][-1]["type"] == "message"
    assert all(part["type"] == "output_text" for part in response["output"][-1]["content"]), response
    assert message["type"] == "message" and all(part["type"] == "text" for part in message["content"]), message


def test_a_streamed_message_is_anthropics_event_sequence(vllm_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8, "temperature": 0,
            "stream": True}
    with requests.post(vllm_server.url("/v1/messages"), json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        names = [line[len("event: "):] for line in r.iter_lines(decode_unicode=True) if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert "content_block_delta" in names and "[DONE]" not in names


def test_count_tokens_is_the_chat_prompts_token_count(claude, vllm_server):
    system, messages = "You are terse.", [{"role": "user", "content": "Say hello to the nice people"}]
    counted = claude.messages.count_tokens(model="tiny", system=system, messages=messages).input_tokens
    tokenized = requests.post(vllm_server.url("/tokenize"), timeout=60,
                              json={"messages": [{"role": "system", "content": system}, *messages]}).json()
    answered = claude.messages.create(model="tiny", system=system, messages=messages, max_tokens=1)
    assert counted == tokenized["count"] == answered.usage.input_tokens > 0


@pytest.mark.parametrize("path,body,fragment", [
    ("/v1/responses", {"input": 5}, "input"),
    ("/v1/responses", [1, 2], "JSON object"),
    ("/v1/responses", {"input": "hi", "background": True}, "background"),
    ("/v1/responses", {"input": "hi", "temperature": -1}, "temperature"),
    ("/v1/responses", {"input": "hi " * 9000}, "maximum context length"),
    ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ("/v1/messages", {"model": "tiny", "messages": "hello", "max_tokens": 4}, "messages"),
    ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                      "stream": True, "top_p": 5}, "top_p"),
    ("/v1/messages/count_tokens", {"model": "tiny"}, "messages"),
])
def test_bad_bodies_are_4xx_in_the_routes_envelope(vllm_server, path, body, fragment):
    r = requests.post(vllm_server.url(path), json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    if path == "/v1/responses":
        assert r.json()["error"]["code"] == r.status_code and fragment in r.json()["error"]["message"], r.text
    else:  # Anthropic's envelope, as vLLM's server answers there
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert fragment in r.json()["error"]["message"], r.text
    assert "Traceback" not in r.text and "Traceback" not in vllm_server.log()


def test_the_clients_raise_their_own_errors(client, claude):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="hi", max_output_tokens=4, temperature=-1)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model="tiny", messages=[{"role": "user", "content": "hi " * 9000}], max_tokens=4)
    assert "maximum context length" in refused.value.message


# The Messages API has no ignore_eos, and the tiny model ends its turn within a few hundred tokens: a JSON
# schema of at least 4000 numbers keeps it at work (vLLM's structured output allows no end before).
LONG_MESSAGE = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8000,
                "output_config": {"format": {"type": "json_schema", "schema": {
                    "type": "array", "items": {"type": "integer"}, "minItems": 4000}}}}


@pytest.mark.parametrize("path,body", [
    ("/v1/responses", {"input": "Hello", "stream": True, "max_output_tokens": 8000, "ignore_eos": True}),
    ("/v1/messages", {**LONG_MESSAGE, "stream": True}),
], ids=["responses", "messages"])
def test_a_dropped_stream_leaves_no_request_in_the_engine(vllm_server, path, body):
    seconds, generated = drop_stream_and_wait_until_idle(vllm_server, path, body, tokens=8000)
    print(f"{path}: engine empty {1000 * seconds:.0f} ms after the client went away, {generated:.0f} tokens")


@pytest.mark.parametrize("path,body", [
    ("/v1/responses", {"input": "Hello", "max_output_tokens": 8000, "ignore_eos": True}),
    ("/v1/messages", LONG_MESSAGE),
], ids=["responses", "messages"])
def test_a_whole_answer_is_aborted_when_its_client_leaves(vllm_server, path, body):
    wait_idle(vllm_server)
    before = metric(vllm_server, "vllm:generation_tokens_total")
    client = send_and_leave_open(vllm_server.port, path, body)
    sent = time.monotonic()
    while metric(vllm_server, "vllm:generation_tokens_total") - before < 100:  # the engine is at it
        assert time.monotonic() < sent + 60, "the engine never started on the request"
        time.sleep(0.1)
    client.close()
    left = time.monotonic()
    wait_idle(vllm_server, timeout=30)
    seconds, generated = time.monotonic() - left, metric(vllm_server, "vllm:generation_tokens_total") - before
    print(f"{path}: engine empty {seconds:.2f}s after the client left; {generated:.0f} of 8000 tokens generated")
    assert generated < 8000 and seconds < 10
    assert f"POST {path} -> 499" in vllm_server.log()
