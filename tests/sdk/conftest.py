"""Fixtures of the SDK tests: a moto account (tests/sdk/aws.py), the fake Hub, and the
``sdk_textgen`` handler's directory (tests/conftest.py serves it: LMI and OpenAI chat answers
without an engine)."""

import os

import pytest

from tests.fake_hub import FakeHub, Repo
from tests.sdk.aws import IMAGE, INSTANCE_TYPE, REGION, ROLE, aws, components  # noqa: F401 (fixtures, constants)
from tests.server import MODEL_DIRS

# Before anything imports sagemaker: its v2 deprecation warning is noise here.
os.environ.setdefault("SAGEMAKER_SUPPRESS_V2_WARNING", "1")

TEXTGEN = MODEL_DIRS / "sdk_textgen"


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

