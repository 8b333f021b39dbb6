"""LoRA adapters on real vLLM (CPU build): adapters made with peft on the tiny model,
found at start-up or registered through LMI's management routes or AWS's vLLM container's
(``POST /adapters``), chosen per request by LMI's ``adapters`` field, SageMaker's header or
the OpenAI ``model`` field."""

import os
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from container.core.artifacts import download_dir
from tests.e2e.conftest import EAGER, ENGINE_READY_TIMEOUT, EXACT, LORA, VLLM_CPU_ENV, make_adapter
from tests.server import Server

pytestmark = pytest.mark.slow

HEADER = "X-Amzn-SageMaker-Adapter-Identifier"
PROMPT = "the quick brown fox"
GREEDY = {"max_new_tokens": 12, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def model(lora_model):
    return lora_model


@pytest.fixture(scope="module")
def s3(lora_s3):
    return lora_s3


@pytest.fixture(scope="module")
def server(lora_server):
    """The tiny model with LoRA adapters (tests/e2e/conftest.py), shared with the option matrix."""
    return lora_server


def generate(server, adapters=None, headers=None, inputs=PROMPT) -> str:
    body = {"inputs": inputs, "parameters": GREEDY}
    if adapters is not None:
        body["adapters"] = adapters
    response = server.invoke(body, headers=headers or {})
    assert response.status_code == 200, response.text
    answer = response.json()
    return [a["generated_text"] for a in answer] if isinstance(answer, list) else answer["generated_text"]


def adapters_url(server, name=""):
    return server.url("/models/tiny/adapters" + (f"/{name}" if name else ""))


def test_an_adapter_changes_the_greedy_answer_and_keeps_it(server):
    base = generate(server)
    with_a1 = [generate(server, "a1") for _ in range(3)]
    print(f"base {base!r}, a1 {with_a1[0]!r}")
    assert with_a1[0] != base
    assert with_a1 == [with_a1[0]] * 3
    assert generate(server) == base


def test_the_header_selects_as_the_body_field_does(server):
    assert generate(server, headers={HEADER: "a1"}) == generate(server, "a1")


def test_openai_model_field_and_v1_models(server):
    ids = [m["id"] for m in requests.get(server.url("/v1/models"), timeout=30).json()["data"]]
    assert "a1" in ids and len(ids) >= 2

    def complete(model, headers=None):
        r = requests.post(server.url("/v1/completions"), json={"model": model, "prompt": PROMPT, "max_tokens": 12,
                                                                "temperature": 0, "ignore_eos": True},
                          headers=headers or {}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["model"]

    base_text, base_model = complete("tiny")
    a1_text, a1_model = complete("a1")
    assert a1_model == "a1" and a1_text != base_text
    assert complete("tiny", headers={HEADER: "a1"})[0] == a1_text
    missing = requests.post(server.url("/v1/chat/completions"),
                            json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert missing.status_code == 404 and "nope" in missing.text


def test_unknown_adapter_is_a_404_naming_it(server):
    response = server.invoke({"inputs": PROMPT, "adapters": "missing-one", "parameters": GREEDY})
    assert response.status_code == 404
    assert "missing-one" in response.json()["error"]


def test_register_list_describe_and_two_adapters_in_one_batch(server, model):
    response = requests.post(adapters_url(server), params={"name": "a2", "src": str(model / "extra" / "a2")},
                             timeout=120)
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "Adapter a2 registered"}
    listed = requests.get(adapters_url(server), timeout=30).json()["adapters"]
    assert {a["name"] for a in listed} == {"a1", "a2"}
    assert requests.get(adapters_url(server, "a2"), timeout=30).json()[0]["name"] == "a2"
    models = requests.get(server.url("/models"), timeout=30).json()["models"]
    assert models[0]["modelName"] == "tiny" and models[0]["workerGroups"][0]["state"] == "ready"

    alone = {name: generate(server, name) for name in ("a1", "a2", None)}
    assert len(set(alone.values())) == 3
    # one request with a list of inputs, one adapter each
    assert generate(server, ["a2", "a1"], inputs=[PROMPT] * 2) == [alone["a2"], alone["a1"]]
    # concurrent requests: the engine batches them
    order = ["a1", "a2"] * 6
    with ThreadPoolExecutor(len(order)) as pool:
        answers = list(pool.map(lambda name: generate(server, name), order))
    assert answers == [alone[name] for name in order]


def test_the_base_model_batched_with_adapters(server, model):
    """vLLM 0.32's CPU LoRA kernels give a base-model row of a mixed batch the last adapter's
    weights (slot -1); handlers/engines/vllm_cpu.py fixes that (sagelmi's CPU platform's LoRA wrapper)."""
    if "a2" not in {a["name"] for a in requests.get(adapters_url(server), timeout=30).json()["adapters"]}:
        requests.post(adapters_url(server), params={"name": "a2", "src": str(model / "extra" / "a2")}, timeout=120)
    alone = {name: generate(server, name) for name in ("a1", "a2", None)}
    assert generate(server, ["a2", None, "a1"], inputs=[PROMPT] * 3) == [alone["a2"], alone[None], alone["a1"]]


@pytest.mark.parametrize("src, expected", [
    ("{model}/extra/nothing-here", "does not exist"),
    ("{model}/extra", "no adapter_config.json"),
    ("{model}/extra/wide", "r=16 is over option.max_lora_rank=8"),
    ("{outside}", "outside the directories"),
    ("{model}/extra/../../../outside", "outside the directories"),
    ("{model}/extra/escape", "outside the directories"),
    ("https://example.com/adapter", "local directory or an s3:// prefix"),
])
def test_bad_sources_are_refused_clearly(server, model, tmp_path, src, expected):
    outside = make_adapter(model, tmp_path / "outside", seed=4) if "outside" in src else tmp_path
    escape = model / "extra" / "escape"
    if "escape" in src and not escape.exists():
        escape.symlink_to(make_adapter(model, tmp_path / "target", seed=5))
    src = src.format(model=model, outside=outside)
    response = requests.post(adapters_url(server), params={"name": "bad", "src": src}, timeout=120)
    assert 400 <= response.status_code < 500, response.text
    body = response.json()
    assert set(body) == {"code", "message", "error"} and expected in body["error"]
    assert "Traceback" not in response.text and str(tmp_path) not in response.text and str(model) not in response.text
    assert requests.get(server.url("/ping"), timeout=5).status_code == 200
    assert "bad" not in {a["name"] for a in requests.get(adapters_url(server), timeout=30).json()["adapters"]}


def test_a_registration_survives_a_worker_kill_and_can_be_deleted(server, model):
    if "a2" not in {a["name"] for a in requests.get(adapters_url(server), timeout=30).json()["adapters"]}:
        assert requests.post(adapters_url(server), params={"name": "a2", "src": str(model / "extra" / "a2")},
                             timeout=120).status_code == 200
    before = generate(server, "a2")
    (worker,) = server.worker_pids()
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + ENGINE_READY_TIMEOUT
    while server.worker_pids() in ([worker], []) and time.monotonic() < deadline:
        time.sleep(0.2)
    server.wait_until(lambda r: r.status_code == 200, timeout=ENGINE_READY_TIMEOUT)
    assert generate(server, "a2") == before
    assert requests.delete(adapters_url(server, "a2"), timeout=60).json() == {"status": "Adapter a2 unregistered"}
    assert server.invoke({"inputs": PROMPT, "adapters": "a2", "parameters": GREEDY}).status_code == 404
    assert requests.get(adapters_url(server, "a2"), timeout=30).status_code == 404


def ensure_a2(server, model) -> str:
    """Register a2 (from a local directory) unless it is; its greedy answer."""
    if "a2" not in {a["name"] for a in requests.get(adapters_url(server), timeout=30).json()["adapters"]}:
        response = requests.post(adapters_url(server), params={"name": "a2", "src": str(model / "extra" / "a2")},
                                 timeout=120)
        assert response.status_code == 200, response.text
    return generate(server, "a2")


def test_an_adapter_registered_from_s3(server, model, s3):
    _, client = s3
    for path in (model / "extra" / "a2").iterdir():  # a2's files under another name
        client.upload_file(str(path), "adapters", f"team/a3/{path.name}")
    response = requests.post(adapters_url(server), params={"name": "a3", "src": "s3://adapters/team/a3"}, timeout=120)
    assert response.status_code == 200, response.text
    ensure_a2(server, model)
    assert generate(server, "a3") == generate(server, "a2") != generate(server)
    missing = requests.post(adapters_url(server), params={"name": "a4", "src": "s3://adapters/none"}, timeout=120)
    assert 400 <= missing.status_code < 500 and "no objects under" in missing.json()["error"], missing.text


def test_an_s3_adapter_registered_again_serves_its_changed_objects_and_unregistering_removes_them(server, model, s3):
    _, client = s3
    uri = "s3://adapters/team/a5"

    def upload(source):  # the same keys each time
        for path in source.iterdir():
            client.upload_file(str(path), "adapters", f"team/a5/{path.name}")

    def copies() -> list:
        tmp = Path(tempfile.gettempdir())
        return [*tmp.glob("sagelmi-*/adapters/a5-*"), *[d for d in [download_dir(uri)] if d.exists()]]

    def register_a5():
        response = requests.post(adapters_url(server), params={"name": "a5", "src": uri}, timeout=120)
        assert response.status_code == 200, response.text

    upload(model / "extra" / "a2")
    register_a5()
    assert generate(server, "a5") == ensure_a2(server, model)
    assert requests.delete(adapters_url(server, "a5"), timeout=60).status_code == 200
    upload(model / "adapters" / "a1")
    register_a5()
    assert generate(server, "a5") == generate(server, "a1") != generate(server, "a2")
    assert copies()
    assert requests.delete(adapters_url(server, "a5"), timeout=60).status_code == 200
    assert copies() == []


def test_lmi_dist_serves_adapters_on_both_ranks(server, model):
    """lmi-dist (tensor parallel 2 on vLLM's executor) answers an adapter as the one-process engine does
    (eager: the compiled LoRA model is the shared server's)."""
    env = {**VLLM_CPU_ENV, **EXACT, **EAGER, **LORA, "OPTION_ROLLING_BATCH": "lmi-dist", "TENSOR_PARALLEL_DEGREE": "2"}
    expected = {name: generate(server, name) for name in ("a1", None)}
    with Server(model, env=env, ready_timeout=ENGINE_READY_TIMEOUT) as sharded:
        assert {name: generate(sharded, name) for name in ("a1", None)} == expected
        ensure_a2(sharded, model)  # registered through the route: vLLM loads it on both ranks
        assert generate(sharded, "a2") == ensure_a2(server, model)


def completion(server, body, headers=None, path="/v1/completions"):
    """The text of a greedy OpenAI completion on ``path``."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **body}
    response = requests.post(server.url(path), json=body, headers=headers or {}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_aws_adapter_routes_and_the_header_answer_as_lmis_field(server, model, s3):
    """POST /adapters {"name", "src"} from a directory and from S3 (AWS's vLLM container's route), the
    header choosing each as LMI's field and the OpenAI model do, DELETE /adapters/{name}, then a 404."""
    _, client = s3
    for path in (model / "extra" / "a2").iterdir():
        client.upload_file(str(path), "adapters", f"aws/s2/{path.name}")
    sources = {"s1": str(model / "extra" / "a2"), "s2": "s3://adapters/aws/s2"}
    try:
        for name, src in sources.items():
            response = requests.post(server.url("/adapters"), json={"name": name, "src": src}, timeout=120)
            assert (response.status_code, response.text) == (200, f"Adapter {name} registered")
        taken = requests.post(server.url("/adapters"), json={"name": "a1", "src": sources["s1"]}, timeout=60)
        assert taken.status_code == 409 and "'a1' is already registered" in taken.json()["error"]
        base = generate(server)
        for name in sources:
            field = generate(server, name)
            assert field != base and generate(server, headers={HEADER: name}) == field
            assert generate(server, name, headers={HEADER: name}) == field  # both, the same adapter
            by_model = completion(server, {"model": name})
            assert by_model == completion(server, {"model": "tiny"}, {HEADER: name})  # the header replaces model
            assert completion(server, {}, {HEADER: name}, "/invocations") == by_model  # a completion body there
        assert generate(server, "s1") == generate(server, "s2")  # the same files, from a directory and from S3
        both = server.invoke({"inputs": PROMPT, "adapters": "a1", "parameters": GREEDY}, headers={HEADER: "s1"})
        assert both.status_code == 400 and "header names adapter 's1' and the body's 'adapters' 'a1'" in both.text
    finally:
        for name in sources:
            requests.delete(server.url(f"/adapters/{name}"), timeout=60)
    assert requests.delete(server.url("/adapters/s1"), timeout=60).status_code == 404
    for path, body in (("/invocations", {"inputs": PROMPT, "parameters": GREEDY}),
                       ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4})):
        gone = requests.post(server.url(path), json=body, headers={HEADER: "s1"}, timeout=60)
        assert gone.status_code == 404 and "adapter 's1' is not registered" in gone.text, gone.text


def test_aws_adapter_route_refuses_a_bad_body_before_downloading(server):
    for body, expected in (({"name": "x"}, "'src' must be a non-empty string"),
                           ({"name": "x", "src": "s3://adapters/none"}, "no objects under"),
                           ({"name": "x y", "src": "s3://adapters/aws/s2"}, "adapter name 'x y' is not valid")):
        response = requests.post(server.url("/adapters"), json=body, timeout=60)
        assert response.status_code == 400 and expected in response.json()["error"], response.text
