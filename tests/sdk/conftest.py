"""Fixtures of the SDK tests: a moto account, and real servers of the
``sdk_textgen`` handler (LMI and OpenAI chat answers without an engine)."""

import os

import pytest

from tests.fake_hub import FakeHub, Repo
from tests.server import MODEL_DIRS

# Before anything imports sagemaker: its v2 deprecation warning is noise here.
os.environ.setdefault("SAGEMAKER_SUPPRESS_V2_WARNING", "1")

REGION = "us-east-1"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/sagelmi:latest"
ROLE = "arn:aws:iam::123456789012:role/SageMakerRole"
TEXTGEN = MODEL_DIRS / "sdk_textgen"
# moto's list of instance types is old: ml.g5.* is refused, ml.g4dn.xlarge accepted.
INSTANCE_TYPE = "ml.g4dn.xlarge"


@pytest.fixture
def aws(monkeypatch):
    """A moto account; yields a boto3 session on it. No real AWS call can leave."""
    import boto3
    from moto import mock_aws

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with mock_aws():
        yield boto3.Session(region_name=REGION)


# Hub models the deploy tests size: safetensors weights (2 GB) beside the same weights as .bin
HUB_MODELS = {"org/two-gb": Repo({"config.json": b"{}", "model.safetensors": b"x" * 2_000_000,
                                   "pytorch_model.bin": b"x" * 2_000_000})}


@pytest.fixture(scope="session")
def fake_hub():
    with FakeHub(HUB_MODELS) as hub:
        yield hub


@pytest.fixture(autouse=True)
def hub_api(fake_hub, monkeypatch):
    """The Hub the SDK sizes models with is tests/fake_hub.py (these machines cannot reach
    the real one): a model it does not have is unknown, at once."""
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", fake_hub.url)
    # file downloads (hf_hub_download: the fit check's config.json) use a template made at import
    monkeypatch.setattr("huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE",
                        fake_hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    return fake_hub

