import json

import pytest

from djl_python import Input, Output
from djl_python.inputs import Input as Input2
from handlers.api import PairList
from container.errors import InvalidJSON, describe


def test_djl_python_import_paths_are_the_same_classes():
    assert Input is Input2


def test_input_accessors():
    inp = Input({"Content-Type": "application/json", "x-custom": "1"}, b'{"inputs": "hi"}')
    assert not inp.is_empty()
    assert inp.get_as_json() == {"inputs": "hi"}
    assert inp.get_as_string() == '{"inputs": "hi"}'
    assert inp.get_as_bytes() == b'{"inputs": "hi"}'
    assert inp.get_data() == {"inputs": "hi"}
    assert inp.get_property("content-type") == "application/json"  # case-insensitive
    assert inp.get_property("X-CUSTOM") == "1"
    assert inp.get_property("absent") is None
    assert inp.contains_key("data") and not inp.contains_key("other")
    assert inp.get_properties()["x-custom"] == "1"
    assert not inp.is_batch() and inp.get_batches() == [inp]
    assert isinstance(inp.get_content(), PairList)


def test_empty_input_is_the_initialisation_call():
    assert not Input({}, b"").is_empty()  # a request with an empty body is still a request
    inp = Input({"model_dir": "/opt/ml/model"})
    assert inp.is_empty()
    assert inp.get_as_bytes() is None
    assert inp.get_properties() == {"model_dir": "/opt/ml/model"}


def test_malformed_json_is_a_json_decode_error_that_maps_to_400():
    with pytest.raises(json.JSONDecodeError) as err:
        Input({}, b"{nope").get_as_json()
    assert isinstance(err.value, InvalidJSON)
    status, message, error = describe(err.value)
    assert status == 400 and "not valid JSON" in error


def test_batched_input_splits():
    inp = Input({"batch_size": "2", "batch_000_a": "x", "batch_001_a": "y"})
    inp.content.add("batch_000_data", b"first")
    inp.content.add("batch_001_data", b"second")
    first, second = inp.get_batches()
    assert first.get_as_string() == "first" and first.get_property("a") == "x"
    assert second.get_as_string() == "second" and second.get_property("a") == "y"


def test_output_body_and_content_types():
    assert Output().add_as_json({"a": 1}).body() == b'{"a":1}'
    assert Output().add_as_json({"a": 1}).headers()["content-type"] == "application/json"
    assert Output().add("text").headers()["content-type"].startswith("text/plain")
    assert Output().add(b"\x00").headers()["content-type"] == "application/octet-stream"
    explicit = Output().add_property("Content-Type", "text/csv").add("a,b")
    assert explicit.headers() == {"Content-Type": "text/csv"}
    assert Output().add("x", key="other").add("y", key="data").body() == b"y"
    assert Output().body() == b""


def test_output_error_is_lmis_envelope():
    out = Output().error("it broke")
    assert out.code == 424
    assert json.loads(out.body()) == {"code": 424, "message": "prediction failure", "error": "it broke"}
    assert out.set_code(201).code == 201


def test_stream_items_are_formatted():
    out = Output().add_stream_content(iter([b"raw", "text", {"k": 1}]))
    assert [out.format_stream_item(i) for i in out.stream_content] == [b"raw", b"text", b'{"k":1}\n']
    assert out.headers()["content-type"] == "application/jsonlines"
    custom = Output().add_stream_content(iter(["a"]), output_formatter=lambda t: f"<{t}>".encode())
    assert custom.format_stream_item("a") == b"<a>"
