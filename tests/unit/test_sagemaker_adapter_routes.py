"""AWS's vLLM-container adapter routes (POST /adapters {"name", "src"}, DELETE /adapters/{name}) on
the frontend's one adapter registry, beside LMI's routes: a frontend with no worker group (the
registry loads an adapter on every group: none here), driven through Flask's test client.
tests/e2e/test_lora.py has them on real vLLM, tests/integration/test_adapter_downloads.py from S3."""

import json

import pytest

from container.core.launch import FrontendLaunch, ModelInfo
from container.frontend.app import create_app

LMI_ENVELOPE = {"code", "message", "error"}


def write_adapter(directory, rank=8):
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    (directory / "adapter_model.safetensors").write_bytes(b"x")
    return directory


@pytest.fixture
def model_dir(tmp_path):
    write_adapter(tmp_path / "more" / "fr")
    write_adapter(tmp_path / "more" / "wide", rank=16)
    return tmp_path


@pytest.fixture
def client(model_dir):
    model = ModelInfo(name="tiny", location=str(model_dir), lora=True, max_lora_rank=8,
                      adapter_dirs=[str(model_dir)], adapter_roots=[str(model_dir)])
    launch = FrontendLaunch(listen_fd=-1, groups=[], job_queue_size=1, max_payload_bytes=1024, predict_timeout=1,
                            grace_period=1, model=model)
    return create_app(launch).test_client()


def registered(client) -> list[str]:
    return [a["name"] for a in client.get("/models/tiny/adapters").get_json()["adapters"]]


def test_register_and_unregister_as_aws_vllm_container_answers(client, model_dir):
    answer = client.post("/adapters", json={"name": "fr", "src": str(model_dir / "more" / "fr")})
    assert (answer.status_code, answer.text, answer.mimetype) == (200, "Adapter fr registered", "text/plain")
    assert registered(client) == ["fr"]  # one registry: LMI's routes see it
    assert client.get("/models/tiny/adapters/fr").get_json() == [{"name": "fr", "src": str(model_dir / "more" / "fr")}]
    answer = client.delete("/adapters/fr")
    assert (answer.status_code, answer.text) == (200, "Adapter fr unregistered")
    assert registered(client) == []
    gone = client.delete("/adapters/fr")
    assert gone.status_code == 404 and set(gone.get_json()) == LMI_ENVELOPE and "'fr'" in gone.get_json()["error"]


def test_without_a_body_the_query_names_it_and_the_alias_header_is_answered(client):
    answer = client.post("/adapters?name=fr&src=more/fr", headers={"X-Amzn-SageMaker-Adapter-Alias": "french"})
    assert (answer.status_code, answer.text) == (200, "Adapter french registered")
    assert client.delete("/models/tiny/adapters/fr").status_code == 200  # LMI's route unregisters it too


def test_a_name_registered_by_either_route_is_a_409_on_the_other(client):
    assert client.post("/models/tiny/adapters?name=fr&src=more/fr").status_code == 200
    taken = client.post("/adapters", json={"name": "fr", "src": "more/fr"})
    assert taken.status_code == 409 and "DELETE /adapters/fr" in taken.get_json()["error"]


@pytest.mark.parametrize("body, expected", [
    ({"src": "more/fr"}, "'name' must be a non-empty string (the adapter's name); got None"),
    ({"name": "", "src": "more/fr"}, "'name' must be a non-empty string"),
    ({"name": ["fr"], "src": "more/fr"}, "'name' must be a non-empty string (the adapter's name); got ['fr']"),
    ({"name": "fr"}, "'src' must be a non-empty string (a directory or an s3:// prefix); got None"),
    ({"name": "fr", "src": 5}, "'src' must be a non-empty string"),
    ({"name": "../fr", "src": "more/fr"}, "adapter name '../fr' is not valid"),
    ({"name": "tiny", "src": "more/fr"}, "adapter name 'tiny' is the base model's name"),
    ({"name": "fr", "src": "https://example.com/fr"}, "local directory or an s3:// prefix"),
    ({"name": "fr", "src": "more/none"}, "does not exist"),
    ({"name": "fr", "src": "more/wide"}, "r=16 is over option.max_lora_rank=8"),
    ("[1, 2]", "the body must be a JSON object"),
    ("{", "request body is not valid JSON"),
    (b"q\x98e\xa4\xfa*", "request body is not valid JSON: it is not UTF-8"),  # found by tests/e2e/test_fuzz.py
])
def test_a_bad_registration_is_a_400_in_lmis_envelope(client, body, expected):
    if isinstance(body, (str, bytes)):
        answer = client.post("/adapters", data=body, content_type="application/json")
    else:
        answer = client.post("/adapters", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.get_json()
    assert set(error) == LMI_ENVELOPE and expected in error["error"], error
    assert registered(client) == []


def test_without_lora_the_routes_say_how_to_serve_adapters(tmp_path):
    launch = FrontendLaunch(listen_fd=-1, groups=[], job_queue_size=1, max_payload_bytes=1024, predict_timeout=1,
                            grace_period=1, model=ModelInfo(name="tiny", location=str(tmp_path)))
    answer = create_app(launch).test_client().post("/adapters", json={"name": "fr", "src": "more/fr"})
    assert answer.status_code == 400 and "option.enable_lora=true" in answer.get_json()["error"]
