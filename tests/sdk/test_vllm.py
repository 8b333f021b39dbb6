"""The SDK against the real engine: vLLM (CPU build) serving the built-in tiny
model, started by LocalEndpoint in process mode from a SagelmiModel, one server
for the module. Its real streams (LMI JSON lines, OpenAI server-sent events) are
cut into PayloadParts at every byte; the predictors get answers."""


import boto3
import pytest

from sagemaker_sdk import SagelmiModel, SagelmiPredictor
from sagemaker_sdk.local import LocalEndpoint
from sagemaker_sdk.sdk_major import LocalSession
from sagemaker_sdk.streaming import stream_texts
from tests import models
from tests.sdk.conftest import REGION
from tests.sdk.streams import assert_every_cut_gives, capture, json_lines, sse_events

pytestmark = pytest.mark.slow

PROMPT = "Grüße ☃ 日本語"  # multi-byte characters, sent back by return_full_text / echo
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def tiny_model():
    return models.tiny_model("tiny-model-1024")  # tiny-model's default context (kept: tests/models.py)


@pytest.fixture(scope="module")
def endpoint(tiny_model):
    model = SagelmiModel(handler_dir=tiny_model, max_rolling_batch_size=8, options={"max_model_len": 1024, "dtype": "float32", "enforce_eager": True},
                         env=VLLM_CPU_ENV)
    local = LocalEndpoint(model, mode="process", ready_timeout=600)  # a loaded machine's start
    local.predictor_on_it = local.start()
    yield local
    assert local.stop() == 0


def test_predict_predict_stream_and_chat(endpoint):
    predictor = endpoint.predictor_on_it
    answer = predictor.predict(PROMPT, max_new_tokens=8, details=True)
    assert answer["details"]["generated_tokens"] == 8 and answer["details"]["finish_reason"] == "length"
    streamed = "".join(predictor.predict_stream(PROMPT, max_new_tokens=8))
    items = list(predictor.predict_stream(PROMPT, max_new_tokens=8, raw=True))
    assert len(items) == 8 and items[-1]["generated_text"] == answer["generated_text"]  # greedy: the same answer
    assert streamed == "".join(item["token"]["text"] for item in items)
    # The random-weight model emits byte sequences that are not UTF-8: the whole text shows them as U+FFFD,
    # vLLM's streamed pieces leave them out.
    assert streamed == answer["generated_text"].replace("\ufffd", "")
    messages = [{"role": "user", "content": PROMPT}]
    reply = predictor.chat(messages, max_tokens=8, temperature=0)
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] == 8
    chunks = "".join(predictor.chat_stream(messages, max_tokens=8, temperature=0))
    assert chunks.replace("\ufffd", "") == reply["choices"][0]["message"]["content"].replace("\ufffd", "")


def test_a_sagemaker_local_session_predictor(endpoint, monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    session = LocalSession(boto_session=boto3.Session(region_name=REGION))
    session.sagemaker_runtime_client.config = {"local": {"serving_port": endpoint.port}}
    predictor = SagelmiPredictor("tiny", session)
    assert predictor.predict(PROMPT, max_new_tokens=4) == endpoint.predictor_on_it.predict(PROMPT, max_new_tokens=4)


def test_real_lmi_json_lines_cut_at_every_byte(endpoint):
    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 12, "return_full_text": True}}
    raw = capture(endpoint.port, body)
    expected = json_lines(raw)
    assert len(expected) == 12 and expected[-1]["generated_text"].startswith(PROMPT)
    assert_every_cut_gives(raw, expected)


def test_real_openai_server_sent_events_cut_at_every_byte(endpoint):
    body = {"prompt": PROMPT, "stream": True, "echo": True, "max_tokens": 12, "temperature": 0}
    raw = capture(endpoint.port, body)
    assert raw.endswith(b"data: [DONE]\n\n")
    expected = sse_events(raw)
    assert_every_cut_gives(raw, expected)
    assert "".join(stream_texts(expected)).startswith(PROMPT)

    chat = {"messages": [{"role": "user", "content": PROMPT}], "stream": True, "max_tokens": 12}
    raw = capture(endpoint.port, chat)
    expected = sse_events(raw)
    assert_every_cut_gives(raw, expected, multi_byte=b"data: ")
    assert len(list(stream_texts(expected))) >= 1
