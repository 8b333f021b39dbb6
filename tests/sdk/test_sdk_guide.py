"""docs/sdk.md's examples run, each on its major of the sagemaker SDK, under moto (tests/sdk/aws.py):
"With the SDK 2.x" or "3.x" on that major, the inference-component example on both, and the
README's deploy snippet on 3.x (test_readme.py runs it on 2.x). Runs under
both majors (tests/sdk/test_other_major.py runs it in the other one); the examples use the
default boto3 session, which is the moto account's here."""

import boto3
import pytest

from container.core.settings import resolve_settings
from sagemaker_sdk import SDK_MAJOR, SagelmiPredictor
from tests.readme import python_snippets, section
from tests.sdk.aws import IMAGE, ROLE, aws, components  # noqa: F401 (fixtures)

BY_MAJOR = {major: python_snippets(section(f"With the SDK {major}.x")) for major in (2, 3)}
(COMPONENT,) = python_snippets(section("Deploying as an inference component"))
SNIPPETS = [*(snippet for snippets in BY_MAJOR.values() for snippet in snippets), COMPONENT]  # docs/sdk.md's


@pytest.fixture
def default_session(aws, monkeypatch):
    """boto3's default session (what the SDK's own sessions use unless given one) on the moto account."""
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", aws)
    return aws


def run(snippet: str) -> dict:
    namespace: dict = {}
    exec(snippet, namespace)
    return namespace


def test_the_example_for_this_major(default_session, capsys):
    (snippet,) = BY_MAJOR[SDK_MAJOR]
    namespace = run(snippet)
    model, predictor = namespace["model"], namespace["predictor"]
    assert isinstance(predictor, SagelmiPredictor)
    client = default_session.client("sagemaker")
    container = client.describe_model(ModelName=model.name)["PrimaryContainer"]
    assert container["Image"] == IMAGE
    assert resolve_settings(container["Environment"], "/nonexistent").model_id == "Qwen/Qwen2.5-1.5B-Instruct"
    assert client.describe_endpoint(EndpointName=predictor.endpoint_name)["EndpointStatus"] == "InService"
    printed = capsys.readouterr().out.split()
    assert printed[0] == model.name and printed[1] == (predictor.endpoint_name if SDK_MAJOR == 2 else "InService")


def test_the_inference_component_example(default_session, components, capsys):
    namespace = run(COMPONENT)
    model, predictor = namespace["model"], namespace["predictor"]
    assert capsys.readouterr().out.split() == [predictor.component_name]
    config = components.request("CreateEndpointConfig")
    assert config["ExecutionRoleArn"] == ROLE and "ModelName" not in config["ProductionVariants"][0]
    assert config["ProductionVariants"][0]["ManagedInstanceScaling"] == {
        "Status": "ENABLED", "MinInstanceCount": 0, "MaxInstanceCount": 2}
    component = components.request("CreateInferenceComponent")
    assert component["Specification"]["ModelName"] == model.name
    assert component["Specification"]["ComputeResourceRequirements"] == {
        "MinMemoryRequiredInMb": 8192, "NumberOfAcceleratorDevicesRequired": 2}  # tensor parallel 2
    assert component["RuntimeConfig"] == {"CopyCount": 2}


@pytest.mark.skipif(SDK_MAJOR == 2, reason="test_readme.py runs it on 2.x (where it waits for the endpoint: 30 s)")
def test_the_readmes_deploy_snippet(default_session):
    """The README's deploy snippet, the same code on 3.x."""
    (snippet,) = python_snippets(section("Deploy to SageMaker"))
    namespace = run(snippet)
    env = default_session.client("sagemaker").describe_model(ModelName=namespace["model"].name)["PrimaryContainer"]
    settings = resolve_settings(env["Environment"], "/nonexistent")
    assert (settings.model_id, settings.max_rolling_batch_size) == ("Qwen/Qwen2.5-1.5B-Instruct", 32)
    assert namespace["model"].endpoint.endpoint_status == "InService"
