"""predict_stream's parser on real streamed answers (LMI JSON lines, LMI
server-sent events, OpenAI chat chunks) captured from a running server, cut into
SageMaker PayloadParts at every byte offset, one byte a part, and at random
multi-cuts; and the whole path through the real boto3 client and botocore's
event-stream decoding."""

import json

import boto3
import pytest
from botocore.exceptions import EventStreamError

from sagemaker_sdk import SagelmiPredictor, StreamError, StreamParser, parse_stream
from sagemaker_sdk.sdk_major import Session
from sagemaker_sdk.streaming import item_text, stream_texts
from tests.sdk.conftest import REGION
from tests.sdk.fake_runtime import FakeRuntime, model_stream_error
from tests.sdk.streams import MULTI_BYTE, assert_every_cut_gives, capture, json_lines, sagemaker_items, sse_events

PROMPT = "hello world"
LMI = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 12}}
CHAT = {"messages": [{"role": "user", "content": PROMPT}], "stream": True, "max_tokens": 12}


# -- real streams, cut everywhere ---------------------------------------------------------

def test_lmi_json_lines_cut_at_every_byte(textgen_server):
    raw = capture(textgen_server.port, LMI)
    expected = json_lines(raw)
    assert len(expected) == 12 and "token" in expected[0] and "generated_text" in expected[-1]
    assert_every_cut_gives(raw, expected)
    assert "".join(stream_texts(expected)) == expected[-1]["generated_text"] == \
        textgen_server.invoke({**LMI, "stream": False}).json()["generated_text"]


def test_lmi_server_sent_events_cut_at_every_byte(textgen_sse_server):
    raw = capture(textgen_sse_server.port, LMI)
    assert raw.startswith(b"data: {") and raw.endswith(b"\n\n")
    expected = sse_events(raw)
    assert len(expected) == 12
    assert_every_cut_gives(raw, expected)
    assert "".join(stream_texts(expected)) == expected[-1]["generated_text"]


def test_openai_chat_chunks_cut_at_every_byte(textgen_server):
    raw = capture(textgen_server.port, CHAT)
    assert raw.endswith(b"data: [DONE]\n\n")
    expected = sse_events(raw)
    assert_every_cut_gives(raw, expected)
    reply = textgen_server.invoke({**CHAT, "stream": False}).json()["choices"][0]["message"]["content"]
    assert "".join(stream_texts(expected)) == reply


def test_an_error_after_the_stream_began_raises_after_the_text_before_it(textgen_server):
    raw = capture(textgen_server.port, {**LMI, "fail_after": 3})
    texts = stream_texts(sagemaker_items([raw[i:i + 7] for i in range(0, len(raw), 7)]))
    assert [next(texts) for _ in range(3)] == ["hello", " world", " größer"]
    with pytest.raises(StreamError, match="^424 invoke handler failure: generation failed on purpose$"):
        next(texts)


# -- the parser alone ---------------------------------------------------------------------

def test_server_sent_event_fields_comments_and_line_endings():
    raw = (b": keep-alive\r\nevent: token\r\nid: 1\r\ndata: {\"token\": \r\ndata: {\"text\": \"a\"}}\r\n\r\n"
           b"retry: 100\ndata: {\"token\": {\"text\": \"b\"}}\n\ndata: [DONE]\n\n")
    assert [item_text(i) for i in parse_stream([raw])] == ["a", "b"]


def test_the_last_line_or_event_without_its_ending():
    assert list(parse_stream([b'{"outputs": "x"}\n{"outputs": ["y", "z"]}'])) == [{"outputs": "x"},
                                                                                 {"outputs": ["y", "z"]}]
    assert list(parse_stream([b'data: {"token": {"text": "t"}}'])) == [{"token": {"text": "t"}}]
    parser = StreamParser()
    assert parser.feed(b'{"a": 1}\n{"b"') == [{"a": 1}] and parser.feed(b": 2}") == []
    assert parser.close() == [{"b": 2}]


@pytest.mark.parametrize("item, message", [
    ({"code": 503, "message": "service unavailable", "error": "the worker group went away"},
     "503 service unavailable: the worker group went away"),
    ({"error": {"message": "context too long", "type": "BadRequestError", "code": 400}}, "context too long"),
    ({"error": "Request failed during generation", "error_type": "generation"}, "Request failed during generation"),
])
def test_error_items_raise(item, message):
    with pytest.raises(StreamError) as raised:
        item_text(item)
    assert str(raised.value) == message and raised.value.item == item


def test_items_without_text():
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"choices": [], "usage": {"completion_tokens": 3}},
              {"choices": [{"index": 1, "text": "other choice"}]},
              {"choices": [{"index": 0, "text": "completion"}]}]
    assert list(stream_texts(chunks)) == ["completion"]


# -- the whole path: boto3, botocore's event-stream decoding, sagemaker's Predictor ---------

@pytest.fixture
def runtime(monkeypatch):
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(name, value)
    with FakeRuntime() as fake:
        boto_session = boto3.Session(region_name=REGION)
        client = boto_session.client("sagemaker-runtime", endpoint_url=fake.url)
        fake.predictor = SagelmiPredictor(
            "my-endpoint", Session(boto_session=boto_session, sagemaker_runtime_client=client))
        yield fake


def test_predict_stream_through_boto3(runtime, textgen_server):
    raw = capture(textgen_server.port, {**LMI, "parameters": {"max_new_tokens": 8}})
    expected = list(stream_texts(json_lines(raw)))
    inside = raw.index(MULTI_BYTE) + 1
    for pieces in ([raw], [raw[:inside], raw[inside:]], [raw[i:i + 1] for i in range(len(raw))],
                   [raw[i:i + 5] for i in range(0, len(raw), 5)]):
        runtime.respond(pieces)
        assert list(runtime.predictor.predict_stream(PROMPT, max_new_tokens=8)) == expected
    request = runtime.requests[-1]
    assert request["path"] == "/endpoints/my-endpoint/invocations-response-stream"
    assert json.loads(request["body"]) == {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}, "stream": True}
    assert request["headers"]["Content-Type"] == "application/json"

    runtime.respond([raw[:inside], raw[inside:]])
    items = list(runtime.predictor.predict_stream(PROMPT, parameters={"max_new_tokens": 8}, raw=True))
    assert items == json_lines(raw)

    # The second argument is the sagemaker Predictor's initial_args: it reaches SageMaker's runtime API.
    runtime.respond([raw])
    options = {"ContentType": "application/json; charset=utf-8", "CustomAttributes": "trace=1"}
    assert list(runtime.predictor.predict_stream(PROMPT, options, parameters={"max_new_tokens": 8})) == expected
    request = runtime.requests[-1]
    assert request["headers"]["Content-Type"] == "application/json; charset=utf-8"
    assert request["headers"]["X-Amzn-SageMaker-Custom-Attributes"] == "trace=1"
    assert json.loads(request["body"]) == {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}, "stream": True}


def test_chat_stream_through_boto3(runtime, textgen_server):
    raw = capture(textgen_server.port, CHAT)
    runtime.respond([raw[i:i + 3] for i in range(0, len(raw), 3)], content_type="text/event-stream")
    reply = list(runtime.predictor.chat_stream(CHAT["messages"], max_tokens=12))
    assert reply == list(stream_texts(sse_events(raw)))
    assert json.loads(runtime.requests[-1]["body"]) == {**CHAT}


def test_a_model_stream_error_event_raises(runtime, textgen_server):
    raw = capture(textgen_server.port, LMI)
    runtime.respond([raw[:40]], error=model_stream_error("the model took too long"))
    stream = runtime.predictor.predict_stream(PROMPT)
    with pytest.raises(EventStreamError, match="the model took too long"):
        list(stream)
