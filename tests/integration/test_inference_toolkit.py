"""SageMaker inference toolkit scripts (code/inference.py), served by `sagelmi serve` and called
as their examples call them (SageMaker's JSONSerializer / NumpySerializer send what `requests`
sends here; two go through the sagemaker SDK's own Predictor and runtime client). Five are public
examples (tests/model_dirs/sm_*/code/inference.py name their source); sm_defaults is sagelmi's own,
for the default input/predict/output functions."""

import importlib.util
import io
import json
import math
import os
import shutil
import sys

import numpy as np
import pytest

os.environ.setdefault("SAGEMAKER_SUPPRESS_V2_WARNING", "1")  # the sagemaker SDK v2 warns at import otherwise
import requests

from tests import models
from tests.server import MODEL_DIRS, Server


def _tiny(directory, arch):
    """A tiny ``arch`` model in ``directory``: a copy of the one kept between runs (tests/models.py)."""
    shutil.copytree(models.tiny_model(f"tiny-{arch}", "--arch", arch), directory)
    return directory


def _model_dir(tmp_path, name, arch=None):
    directory = tmp_path / name
    if arch:
        _tiny(directory, arch)
    shutil.copytree(MODEL_DIRS / name / "code", directory / "code", dirs_exist_ok=True)
    return directory


def script(directory):
    """The model directory's code/inference.py, imported here: what it computes outside the server."""
    spec = importlib.util.spec_from_file_location(f"inference_{directory.name}", directory / "code" / "inference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def local_session(server):
    """The sagemaker SDK's LocalSession, its runtime client posting to the server's /invocations."""
    import boto3

    from sagemaker_sdk.sdk_major import LocalSession  # the installed major's (2.x and 3.x have one)

    session = LocalSession(boto_session=boto3.Session(region_name="us-east-1"))
    session.sagemaker_runtime_client.config = {"local": {"serving_port": server.port}}
    return session


def post(server, body, content_type="application/json", accept=None):
    headers = {"Content-Type": content_type, **({"Accept": accept} if accept else {})}
    data = json.dumps(body) if content_type == "application/json" and not isinstance(body, (bytes, str)) else body
    return requests.post(server.url("/invocations"), data=data, headers=headers, timeout=60)


def test_hugging_face_embeddings_script(tmp_path):
    with Server(_model_dir(tmp_path, "sm_hf_embeddings", "bert")) as server:
        sentences = ["the cat sat", "a dog ran far away", "the cat sat"]
        r = post(server, {"inputs": sentences})  # predictor.predict({"inputs": sentences})
        assert r.status_code == 200, r.text
        assert r.headers["Content-Type"].startswith("application/json")
        vectors = r.json()["vectors"]
        assert len(vectors) == 3 and len({len(v) for v in vectors}) == 1 and len(vectors[0]) > 1
        assert all(math.isclose(math.hypot(*v), 1.0, rel_tol=1e-4) for v in vectors)  # normalised, as the script does
        assert vectors[0] == vectors[2] and vectors[0] != vectors[1]
        assert "code/inference.py" in server.log() and "SageMaker inference toolkit script: model_fn, predict_fn" in server.log()


def test_hugging_face_generation_script(tmp_path):
    with Server(_model_dir(tmp_path, "sm_hf_generate", "llama")) as server:
        body = {"inputs": "hello world", "parameters": {"max_new_tokens": 8, "do_sample": False}}
        first, again = post(server, body), post(server, body)
        assert first.status_code == 200, first.text
        answer = first.json()
        assert isinstance(answer, list) and set(answer[0]) == {"generated_text"}
        assert answer[0]["generated_text"].startswith("hello world") and len(answer[0]["generated_text"]) > 11
        assert again.json() == answer  # greedy


def test_hugging_face_summarization_script_with_its_notebook_call(tmp_path):
    """aws/amazon-sagemaker-examples' summarizer: input_fn and predict_fn, the default output_fn."""
    from sagemaker_sdk import SDK_MAJOR

    if SDK_MAJOR != 2:
        pytest.skip("the notebook's call is the sagemaker SDK 2.x's Predictor, which 3.x does not have")
    from sagemaker.deserializers import JSONDeserializer
    from sagemaker.predictor import Predictor
    from sagemaker.serializers import JSONSerializer

    directory = _model_dir(tmp_path, "sm_hf_summarization", "t5")
    texts = ["Lovely dress, the fabric is soft and it fits well. I would buy it again."]
    inputs = {  # the notebook's request: four summaries of one text, each with its own parameters
        "inputs": texts,
        "parameters_list": [
            {"length_penalty": 2, "num_beams": 5, "do_sample": True},
            {"length_penalty": 1, "num_beams": 5, "do_sample": True},
            {"length_penalty": 0.6, "num_beams": 3, "do_sample": True},
            {"max_length": 25, "top_p": 0.92, "top_k": 50, "do_sample": True},
        ],
    }
    greedy = {"inputs": texts, "parameters_list": [{"num_beams": 3, "max_length": 12}, {"max_length": 6}]}
    with Server(directory) as server:
        predictor = Predictor("summarization-endpoint", sagemaker_session=local_session(server),
                              serializer=JSONSerializer(), deserializer=JSONDeserializer())
        summaries = predictor.predict(inputs)
        answer = predictor.predict(greedy)
    assert len(summaries) == 4 and all(len(s) == 1 and isinstance(s[0], str) for s in summaries)
    code = script(directory)
    expected = code.predict_fn(code.input_fn(json.dumps(greedy), "application/json"), code.model_fn(str(directory)))
    assert answer == expected and len(answer) == 2 and answer[0] != answer[1]


def test_hugging_face_transform_fn_script_with_its_notebook_call(tmp_path):
    """aws/amazon-sagemaker-examples' token classifier: model_fn and transform_fn, an own content
    type, the body as bytes, no Accept (the default, application/json), sagemaker_inference's encoder
    (installed from code/requirements.txt)."""
    directory = _model_dir(tmp_path, "sm_hf_ner", "bert")
    (directory / "integer_to_label.json").write_text(json.dumps({"0": "O", "1": "B-PER", "2": "I-PER"}))
    payload = [["John", "Smith", "lives", "in", "Berlin"], ["R.H.", "Macy"], ["hello"]]  # sentences as words
    with Server(directory) as server:
        client = local_session(server).sagemaker_runtime_client  # the notebook's query_endpoint, over it
        response = client.invoke_endpoint(EndpointName="ner-finetune", ContentType="application/list-text",
                                          Body=json.dumps(payload).encode("utf-8"))
        answer = json.loads(response["Body"].read())
        assert response["Body"].headers["Content-Type"].startswith("application/json")
        refused = post(server, payload)  # application/json: the script's own error, a 500 as the toolkit answers
        assert "sagemaker-inference" in server.log() and "code/requirements.txt" in server.log()
    assert refused.status_code == 500 and "unsupported content type application/json" in refused.json()["error"]
    code = script(directory)
    expected = code.transform_fn(code.model_fn(str(directory)), json.dumps(payload).encode("utf-8"),
                                 "application/list-text", "application/json")
    assert answer == json.loads(expected)
    assert [len(words) for words in answer["predict_label"]] == [len(t) for t in answer["token"]]
    assert answer["token"][2][0] == "[CLS]" and len({len(t) for t in answer["token"]}) == 3  # ragged, as sent


@pytest.fixture(scope="module")
def mnist(tmp_path_factory):
    import torch

    directory = _model_dir(tmp_path_factory.mktemp("mnist"), "sm_pytorch_mnist")
    sys.path.insert(0, str(directory / "code"))
    try:
        from inference import Net  # the script's own network
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    torch.save(Net().state_dict(), directory / "model.pth")
    with Server(directory) as server:
        yield server


def test_pytorch_mnist_script(mnist):
    images = np.random.default_rng(0).random((2, 1, 28, 28)).round(3).tolist()
    r = post(mnist, {"inputs": images})  # predictor.predict({"inputs": images}), JSONSerializer
    assert r.status_code == 200, r.text
    rows = r.json()
    assert len(rows) == 2 and all(len(row) == 10 for row in rows)
    assert all(math.isclose(sum(math.exp(x) for x in row), 1.0, rel_tol=1e-4) for row in rows)  # log_softmax
    assert post(mnist, {"inputs": images}).json() == rows  # eval(): no dropout


def test_a_failing_script_answers_500_with_its_message_as_the_toolkit_does(mnist):
    r = post(mnist, "1,2,3", content_type="text/csv")  # the script asserts JSON
    assert r.status_code == 500, r.text
    assert r.json()["error"] == "Invalid Request" and "Traceback" not in r.text  # a bare assert: the toolkit's words
    r = post(mnist, {"no_inputs": 1})
    assert r.status_code == 500 and r.json()["error"] == "'inputs'"


@pytest.fixture(scope="module")
def defaults(tmp_path_factory):
    with Server(_model_dir(tmp_path_factory.mktemp("defaults"), "sm_defaults")) as server:
        yield server


def test_default_functions_decode_json_csv_and_npy(defaults):
    r = post(defaults, [[1, 2], [3, 4]])
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json")
    assert r.json() == [[3.0, 5.0], [7.0, 9.0]]
    r = post(defaults, "1,2\n3,4\n", content_type="text/csv", accept="text/csv")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/csv")
    assert np.genfromtxt(io.StringIO(r.text), delimiter=",").tolist() == [[3.0, 5.0], [7.0, 9.0]]
    buffer = io.BytesIO()
    np.save(buffer, np.arange(4, dtype=np.float32))
    r = post(defaults, buffer.getvalue(), content_type="application/x-npy", accept="application/x-npy")
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/x-npy"
    assert np.load(io.BytesIO(r.content)).tolist() == [1.0, 3.0, 5.0, 7.0]
    assert "code/requirements.txt" in defaults.log()  # installed before the worker started


def test_default_functions_refuse_a_type_they_cannot_decode(defaults):
    r = post(defaults, b"hello", content_type="text/plain")
    assert r.status_code == 500
    assert r.json()["error"].startswith("Content type text/plain is not supported by the default handlers")
    r = post(defaults, [1], accept="image/png")
    assert r.status_code == 500 and "Content type image/png is not supported" in r.json()["error"]


def test_dynamic_batching_runs_the_script_once_per_request(tmp_path):
    import concurrent.futures

    env = {"SERVING_BATCH_SIZE": "4", "SERVING_MAX_BATCH_DELAY": "300"}
    with Server(_model_dir(tmp_path, "sm_defaults"), env=env) as server:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: post(server, [i]), range(4)))
        assert [a.json() for a in answers] == [[2.0 * i + 1] for i in range(4)]
        assert "batch of" in server.log() or "dynamic batching: up to 4 requests" in server.log()


def test_model_py_beside_code_inference_py_stops_start_up_naming_both(tmp_path):
    directory = _model_dir(tmp_path, "sm_defaults")
    shutil.copy(MODEL_DIRS / "lmi_echo" / "model.py", directory / "model.py")
    server = Server(directory).start(wait_ready=False)
    assert server.wait_exit(60) == 1
    assert ("the model directory has both model.py (LMI's handler) and code/inference.py (the SageMaker inference "
            "toolkit's): set option.entryPoint (OPTION_ENTRYPOINT) or SAGEMAKER_PROGRAM to choose one") in server.log()
    with Server(directory, env={"SAGEMAKER_PROGRAM": "inference.py"}) as server:
        assert post(server, [1]).json() == [3.0]
    with Server(directory, env={"OPTION_ENTRYPOINT": "model.py"}) as server:
        assert "loading handler from option.entryPoint=model.py" in server.log()
