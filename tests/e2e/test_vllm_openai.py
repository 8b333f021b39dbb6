"""OpenAI-compatible routes through the official openai client, against real vLLM."""

import json

import openai
import pytest
import requests

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]


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
