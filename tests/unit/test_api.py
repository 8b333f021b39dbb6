import json

import pytest

from djl_python import Input, Output
from djl_python.inputs import Input as Input2
from handlers.api import PairList
from container.core.errors import InvalidJSON, describe


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


def test_batched_input_splits_with_lmis_key_names():
    inp = Input({"batch_size": "2", "batch_000.a": "x", "batch_001.a": "y", "device_id": "-1"})
    inp.content.add("batch_000.data", b"first")
    inp.content.add("batch_001.data", b"second")
    first, second = inp.get_batches()
    assert first.get_as_string() == "first" and first.get_property("a") == "x"
    assert second.get_as_string() == "second" and second.get_property("a") == "y"
    assert "device_id" not in first.get_properties()  # as in LMI: top-level properties stay on the batch


def test_output_body_and_content_types():
    assert Output().add_as_json({"a": 1, "b": "é"}).body() == '{\n  "a":1,\n  "b":"é"\n}'.encode()  # LMI's form
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
    assert json.loads(out.body()) == {"code": 424, "message": "invoke handler failure", "error": "it broke"}
    assert out.set_code(201).code == 201


def test_stream_items_are_formatted_as_lmi_does():
    out = Output().add_stream_content(iter(["text", {"k": 1}]))
    assert [out.format_stream_item(i) for i in out.stream_content] == [b'{"outputs": "text"}\n',
                                                                        b'{"outputs": {"k": 1}}\n']
    assert out.headers()["content-type"] == "application/jsonlines"
    raw = Output().add_stream_content(iter([]), output_formatter=None)
    assert [raw.format_stream_item(i) for i in (b"raw", "text", [1])] == [b"raw", b"text", b"[\n  1\n]"]
    custom = Output().add_stream_content(iter(["a"]), output_formatter=lambda t: f"<{t}>")
    assert custom.format_stream_item("a") == b"<a>"


def test_pair_list_forms_and_none_values():
    assert PairList(keys=["a"], values=[1]).get("a") == 1
    assert PairList(pair_list=[("a", 1), ("b", 2)]).get_keys() == ["a", "b"]
    assert PairList(pair_map={"a": 1}).value_at(0) == 1
    with pytest.raises(ValueError):
        PairList(keys=["a", "b"], values=[1])
    pairs = PairList()
    pairs.add("a", None)  # as in LMI: a None value is not added
    assert pairs.is_empty()
    pairs.add(pair=("a", None))
    pairs.add("b", 2, index=0)
    pairs.add_all({"c": 3})
    pairs.add_all(PairList(pair_list=[("d", 4)]))
    assert list(zip(pairs.get_keys(), pairs.get_values())) == [("b", 2), ("a", None), ("c", 3), ("d", 4)]


def test_numpy_values_and_lmi_defaults():
    import datetime
    import numpy as np
    out = Output().add_as_json({"i": np.int64(3), "f": np.float32(0.5), "a": np.arange(3), "b": np.bool_(True),
                                "t": datetime.datetime(2024, 1, 2)})
    assert json.loads(out.body()) == {"i": 3, "f": 0.5, "a": [0, 1, 2], "b": True, "t": "2024-01-02 00:00:00"}
    assert Output().add(None).body() == b"null"
    assert Output().add("x", batch_index=0).content.get_keys() == ["batch_0."]
    assert Output().get_property("x") is None and Output().add_property("A", 1).get_properties() == {"A": 1}
    with pytest.raises(AttributeError, match="is_empty"):
        Input({}).get_as_string()  # LMI raises AttributeError there too; this one says what to do


def test_numpy_round_trips_through_ndlist_and_npz():
    import numpy as np
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2], dtype=np.int64)]
    ndlist = Output().add_as_numpy(arrays).body()
    assert ndlist[:4] == b"\x00\x00\x00\x02" and ndlist[4:10] == b"\x00\x04NDAR"
    for content_type, body in (("tensor/ndlist", ndlist), ("tensor/npz", Output().add_as_npz(arrays).body())):
        back = Input({"Content-Type": content_type}, body).get_data()
        assert [a.tolist() for a in back] == [a.tolist() for a in arrays]
        assert [a.dtype for a in back] == [a.dtype for a in arrays]


def test_binary_encode_and_finalize():
    from container.worker.requests import binary_decode
    encoded = Output.binary_encode({"data": "x\n", "last": True})
    assert encoded == b"\x00\x02" + b"\x00\x00\x00\x04data" + b"\x00\x00\x00\x02x\n" + \
        b"\x00\x00\x00\x04last" + b"\x00\x00\x00\x04True"
    assert binary_decode(encoded) == {"data": "x\n", "last": "True"}
    assert binary_decode(b"plain bytes") is None
    calls = []
    out = Output().finalize(calls.append, "done")
    out.execute_finalize()
    assert calls == ["done"]


def test_json_nested_too_deeply_is_an_input_error_not_a_recursion_error():
    from container.core.errors import InputError, describe
    from handlers.api import MAX_JSON_DEPTH

    for depth in (MAX_JSON_DEPTH + 1, 100_000):
        body = ("[" * depth + "]" * depth).encode()
        with pytest.raises(InputError) as err:
            Input(body=body).get_as_json()
        assert describe(err.value)[0] == 400 and "nested too deeply" in str(err.value)
    ok = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert Input(body=ok.encode()).get_as_json() is not None
    assert Input(body=b'{"a": [1, {"b": 2}], "c": "d"}').get_as_json() == {"a": [1, {"b": 2}], "c": "d"}
