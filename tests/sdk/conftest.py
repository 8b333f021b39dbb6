"""Fixtures of the SDK tests: a moto account, and real servers of the
``sdk_textgen`` handler (LMI and OpenAI chat answers without an engine)."""

import os

import pytest

from tests.server import MODEL_DIRS, Server

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


@pytest.fixture(scope="module")
def textgen_server():
    with Server(TEXTGEN) as server:
        yield server


@pytest.fixture(scope="module")
def textgen_sse_server():
    with Server(TEXTGEN, env={"OPTION_OUTPUT_FORMATTER": "sse"}) as server:
        yield server
