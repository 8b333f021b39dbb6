"""LMI-style handlers (tests/model_dirs/lmi_*), served by `sagelmi serve` and called as
LMI's examples call them: curl-style requests, multipart forms, numpy payloads, CSV,
images, streaming clients that parse JSON lines, dynamic batching."""

import concurrent.futures
import io
import json
import subprocess
import time

import numpy as np
import pytest
import requests
from PIL import Image
from urllib3 import encode_multipart_formdata

from djl_python.np_util import from_nd_list, to_nd_list
from tests.server import MODEL_DIRS, Server


@pytest.fixture(scope="module")
def server():
    with Server(MODEL_DIRS / "lmi_compat") as s:
        yield s


def post(server, op, **kwargs):
    return requests.post(server.url("/invocations"), params={"op": op, **kwargs.pop("params", {})},
                         timeout=30, **kwargs)


def test_properties_every_call_gets_as_in_lmi(server):
    body = post(server, "properties", json={}).json()
    for props in (body["init"], body["request"]):
        assert props["device_id"] == "-1"  # a CPU group, as LMI gives it
        assert props["model_dir"] == str(MODEL_DIRS / "lmi_compat")
        assert props["cluster_size"] == 1
    assert "requestId" in body["request"] and body["request"]["Content-Type"] == "application/json"


def test_curl_style_request_with_query_parameters(server):
    r = subprocess.run(["curl", "-s", "-X", "POST", server.url("/invocations?op=echo&extra=1"),
                        "-H", "Content-Type: application/json", "-d", '{"inputs": "hi"}'],
                       capture_output=True, text=True, timeout=30)
    assert json.loads(r.stdout) == {"echo": {"inputs": "hi"}}


def test_multipart_form_fields_become_content_keys(server):
    r = post(server, "form", data={"prompt": "a cat"}, files={"data": ("blob.bin", b"\x00\x01\x02")})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": "a cat", "data_size": 3, "keys": ["op", "prompt", "data"]}
    r = post(server, "form", data={"prompt": "urlencoded", "data": "xy"})  # application/x-www-form-urlencoded
    assert r.json() == {"prompt": "urlencoded", "data_size": 2, "keys": ["op", "prompt", "data"]}


def test_a_multipart_body_over_max_multipart_parts_is_400_and_one_at_the_limit_is_served(server):
    fields = [("prompt", "a cat"), ("data", "xyz")] + [(f"f{i}", "x") for i in range(998)]
    body, content_type = encode_multipart_formdata(fields)
    r = post(server, "form", data=body, headers={"Content-Type": content_type})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == "a cat" and len(r.json()["keys"]) == 1001  # op and the 1,000 parts
    body, content_type = encode_multipart_formdata(fields + [("one_more", "x")])
    r = post(server, "form", data=body, headers={"Content-Type": content_type})
    assert r.status_code == 400, r.text
    assert "1001 parts; at most 1000" in r.json()["error"] and "max_multipart_parts" in r.json()["error"]


def test_tensor_ndlist_in_and_out(server):
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2, 3], dtype=np.int64)]
    r = post(server, "numpy", data=bytes(to_nd_list(arrays)), headers={"Content-Type": "tensor/ndlist"})
    assert r.status_code == 200 and r.headers["Content-Type"] == "tensor/ndlist"
    back = from_nd_list(r.content)
    assert [a.tolist() for a in back] == [(a * 2).tolist() for a in arrays]


def test_tensor_npz_and_numpy_values_in_json(server):
    buffer = io.BytesIO()
    np.savez(buffer, np.ones((2, 2), dtype=np.float32), np.arange(4))
    r = post(server, "npz", data=buffer.getvalue(), headers={"Content-Type": "tensor/npz"})
    assert r.status_code == 200, r.text
    assert r.json() == {"shapes": [[2, 2], [4]], "sums": [4.0, 6]}  # numpy scalars encoded as LMI does


def test_image_payload(server):
    buffer = io.BytesIO()
    Image.new("RGB", (7, 5), "red").save(buffer, format="PNG")
    r = post(server, "image", data=buffer.getvalue(), headers={"Content-Type": "image/png"})
    assert r.json() == {"size": [7, 5], "mode": "RGB"}
    bad = post(server, "image", data=b"not an image", headers={"Content-Type": "image/png"})
    assert bad.status_code == 424 and "cannot identify image file" in bad.json()["error"]


def test_csv_payload(server):
    r = post(server, "csv", data="inputs,label\nhello,1\nworld,2\n", headers={"Content-Type": "text/csv"})
    assert r.json() == {"rows": [{"inputs": "hello", "label": "1"}, {"inputs": "world", "label": "2"}],
                        "decoded": {"inputs": ["hello", "world"]}}


def test_encode_decode_follow_content_type_and_accept(server):
    r = post(server, "decode", json={"inputs": [1, 2]}, headers={"Accept": "application/json"})
    assert r.json() == [[2.0, 3.0]] and r.headers["Content-Type"] == "application/json"
    r = post(server, "decode", data=bytes(to_nd_list([np.array([1.0, 2.0])])),
             headers={"Content-Type": "tensor/ndlist", "Accept": "tensor/npz"})
    assert r.headers["Content-Type"] == "tensor/npz"
    assert np.load(io.BytesIO(r.content))["arr_0"].tolist() == [[2.0, 3.0]]


def test_none_is_204_and_a_non_output_is_424(server):
    r = post(server, "none", json={})
    assert r.status_code == 204 and r.content == b""
    r = post(server, "not_output", json={})
    assert r.status_code == 424
    assert r.json() == {"code": 424, "message": "invoke handler failure",
                        "error": "Invalid output type: <class 'dict'>"}


def test_finalize_runs_after_the_answer(server, tmp_path):
    marker = tmp_path / "finalized"
    r = post(server, "finalize", params={"path": str(marker)}, json={})
    assert r.text == "done"
    deadline = time.monotonic() + 5
    while not marker.exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_default_stream_lines_parse_as_the_sagemaker_notebooks_do(server):
    with post(server, "stream", json={"inputs": "one two three"}, stream=True) as r:
        assert r.headers["Transfer-Encoding"] == "chunked"
        tokens = [json.loads(line)["outputs"] for line in r.iter_lines() if line]
    assert tokens == ["one", "two", "three"]


def test_sessions_keep_state_between_requests(server):
    first = post(server, "session", json={}).json()
    second = post(server, "session", json={}, headers={"X-Session-Id": first["session"]}).json()
    assert (first["count"], second["count"], second["session"]) == (1, 2, first["session"])


def test_missing_file_is_424_within_a_second(server, tmp_path):
    started = time.monotonic()
    r = post(server, "open", params={"path": str(tmp_path / "missing.txt")}, json={})
    assert time.monotonic() - started < 1
    assert r.status_code == 424 and "No such file or directory" in r.json()["error"]


@pytest.fixture(scope="module")
def async_server():
    with Server(MODEL_DIRS / "lmi_async_mode") as s:
        yield s


def test_async_mode_outputs_are_unpacked(async_server):
    r = async_server.invoke({"inputs": "shout"})
    assert r.status_code == 200 and r.json() == {"generated_text": "SHOUT"}
    r = async_server.invoke({"inputs": "x", "error": "bad parameters"})
    assert r.status_code == 400 and r.json()["error"] == "bad parameters"


def test_async_mode_stream_of_outputs(async_server):
    with async_server.invoke({"inputs": "a b c", "stream": True}, stream=True) as r:
        assert r.headers["Content-Type"] == "application/jsonlines"
        assert [json.loads(line) for line in r.iter_lines() if line] == [
            {"token": "a"}, {"token": "b"}, {"token": "c"}]
    r = async_server.invoke({"inputs": "a b c", "stream": True, "fail_at": 1})
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines[0] == {"token": "a"} and lines[-1]["error"] == "cannot say 'b'"


def test_dynamic_batching_gathers_requests_and_answers_each_client():
    with Server(MODEL_DIRS / "lmi_batching", env={"OPTION_PREDICT_TIMEOUT": "20"}) as server:
        server.invoke({"id": -1})  # warm up: a batch of one, sent unbatched as in LMI
        # an item's error is its status whether the request came in a batch or alone (timing decides)
        alone = server.invoke({"id": 9, "fail": True})
        assert alone.status_code == 424 and alone.json()["error"] == "item 9 cannot be answered", alone.text
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(server.invoke, {"id": i, "fail": i == 5}) for i in range(8)]
            answers = [f.result() for f in futures]
    for i, r in enumerate(answers):
        if i == 5:
            assert r.status_code == 424 and r.json()["error"] == "item 5 cannot be answered"
            continue
        assert r.status_code == 200, r.text
        assert r.json()["id"] == i  # each client gets its own answer
        assert r.json()["request_id"] == r.headers["X-Amzn-SageMaker-Inference-Id"]
    sizes = [r.json()["batch_size"] for i, r in enumerate(answers) if i != 5]
    assert max(sizes) <= 4 and max(sizes) > 1, sizes  # batches of up to batch_size=4
    assert "dynamic batching: up to 4 requests, waiting up to 100 ms" in server.log()


def test_an_lmi_service_entry_point_beside_a_model_py_without_handle_or_formatters_serves_the_service(tmp_path):
    """As LMI: option.entryPoint names its vLLM service; a model.py of helpers (no handle, no formatters)
    does not stop start-up."""
    from container.core.settings import resolve_settings
    from handlers.api.loader import load_handler

    (tmp_path / "model.py").write_text("HELPER = 1\n")
    (tmp_path / "config.json").write_text("{}")
    settings = resolve_settings({"OPTION_ENTRYPOINT": "djl_python.lmi_vllm.vllm_async_service"}, str(tmp_path))
    handler = load_handler(settings)
    assert handler.engine is not None and handler.engine.__name__ == "VllmEngine"
    assert handler.formatters.input is None and handler.formatters.output is None
