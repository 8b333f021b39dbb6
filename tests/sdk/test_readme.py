"""The README's "Deploy to SageMaker" quick start and the guide it links (docs/sagemaker.md):
every snippet runs. The deploy snippet (the README's) with the real sagemaker SDK against moto's
AWS (it waits for InService, as on SageMaker: about 30 s under moto); the guide's predictor
snippet against a real server; its local runner snippet for real, on the tiny model (slow)."""

import re
import subprocess
import sys

import pytest

from container.core.settings import resolve_settings
from sagemaker_sdk import EngineOptionError, SagelmiModel, SagelmiPredictor
from sagemaker_sdk.local import LocalSession
from tests.readme import documents, python_snippets, section
from tests.sdk.test_sdk_guide import SNIPPETS as SDK_GUIDE
from tests.server import REPO, clean_env

QUICK_START = section("Deploy to SageMaker")  # README.md
GUIDE = documents()["docs/sagemaker.md"]
(DEPLOY,) = python_snippets(QUICK_START)
USE, LOCAL = python_snippets(GUIDE)
SNIPPETS = [DEPLOY, USE, LOCAL, *SDK_GUIDE]  # docs/sdk.md's run in test_sdk_guide.py


def test_the_deploy_snippet_deploys(aws):
    namespace: dict = {}
    exec(DEPLOY, namespace)
    model, predictor = namespace["model"], namespace["predictor"]
    assert isinstance(predictor, SagelmiPredictor)
    client = aws.client("sagemaker")
    assert client.describe_endpoint(EndpointName=predictor.endpoint_name)["EndpointStatus"] == "InService"
    env = client.describe_model(ModelName=model.name)["PrimaryContainer"]["Environment"]
    settings = resolve_settings(env, "/nonexistent")
    assert (settings.model_id, settings.max_rolling_batch_size) == ("Qwen/Qwen2.5-1.5B-Instruct", 32)
    assert settings.passthrough_options() == {"dtype": "fp16", "max_model_len": "4096"}
    config = client.describe_endpoint_config(EndpointConfigName=predictor.endpoint_name)
    assert config["ProductionVariants"][0]["ContainerStartupHealthCheckTimeoutInSeconds"] == round(600 + 20 * 3.1)


def test_the_quoted_refusal_is_what_the_sdk_says():
    with pytest.raises(EngineOptionError) as refused:
        SagelmiModel(model_id="Qwen/Qwen2.5-1.5B-Instruct", options={"max_num_seq": 8})
    quoted = re.search(r"raises\s+`EngineOptionError: (.*?), \.\.\.`", GUIDE, re.S).group(1)
    assert str(refused.value).startswith(" ".join(quoted.split()))


def test_the_predictor_snippet_gets_answers(textgen_server, capsys):
    exec(USE, {"predictor": SagelmiPredictor("endpoint", LocalSession(textgen_server.port))})
    printed = capsys.readouterr().out
    assert printed.startswith("What is Amazon SageMaker? größer ☃ 日本語 🙂 What is Amazon SageMaker?")
    assert "Write a haiku about GPUs. größer ☃" in printed and "Hi! größer ☃" in printed


@pytest.mark.slow
def test_the_local_runner_snippet_serves_the_tiny_model(monkeypatch, capsys):
    tiny = REPO / ".cache" / "tiny-model"
    if not (tiny / "sagelmi-tiny-model.json").exists():  # what `make run` writes first
        subprocess.run([sys.executable, "-m", "container", "tiny-model", str(tiny)], check=True, cwd=REPO,
                       env=clean_env(), capture_output=True, timeout=300)
    monkeypatch.chdir(REPO)
    exec(LOCAL, {})
    printed = capsys.readouterr().out
    assert printed.count("\n") >= 2 and printed.strip()
