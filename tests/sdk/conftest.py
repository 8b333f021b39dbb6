"""Fixtures of the SDK tests: a moto account (tests/sdk/aws.py), the fake Hub, and the
``sdk_textgen`` handler's directory (tests/conftest.py serves it: LMI and OpenAI chat answers
without an engine)."""

import os
import signal
import subprocess
import sys

import pytest

from tests.fake_hub import FakeHub, Repo
from tests.sdk.aws import IMAGE, INSTANCE_TYPE, REGION, ROLE, aws, components  # noqa: F401 (fixtures, constants)
from tests.sdk.venvs import DEFAULT_MAJOR, OTHER_MAJOR
from tests.server import MODEL_DIRS, REPO, clean_env

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


# The tests that run in tests/sdk/venvs.py's environments, by module: the major each needs.
_VENV_MODULES = {"test_install.py": DEFAULT_MAJOR, "test_other_major.py": OTHER_MAJOR}
_building: list[subprocess.Popen] = []


def pytest_collection_finish(session):
    """Make the SDK environments this run's tests need in the background from the start (the first
    takes minutes of pip): tests/sdk/venvs.py's lock makes a test wait for one still being made."""
    if session.config.option.collectonly:
        return
    modules = {item.path.name for item in session.items if item.path.parent == REPO / "tests" / "sdk"}
    majors = sorted({_VENV_MODULES[m] for m in modules & set(_VENV_MODULES)})
    if not majors:
        return
    script = "import sys; from tests.sdk.venvs import sdk_venv; [sdk_venv(int(m)) for m in sys.argv[1:]]"
    # A little below the lanes' CPU priority: at nice 19, a run whose engines kept two cores busy left
    # it no CPU, and the tests waiting for it timed out after 10 minutes.
    _building.append(subprocess.Popen(["nice", "-n", "5", sys.executable, "-c", script, *map(str, majors)], cwd=REPO,
                                      env=clean_env({"PYTHONPATH": str(REPO)}), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))


def pytest_sessionfinish(session):
    for process in _building:  # a run that ended first stops it (pip too); it is made again next time
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(60)
