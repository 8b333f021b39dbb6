"""The SDK on the major of the sagemaker SDK that this virtual environment does not have (3.x
beside a 2.x one, 2.x beside a 3.x one): a second virtual environment (tests/sdk/venvs.py: made
once by ``pip install '<checkout>[sdk]'`` on that major, with moto and pytest, and kept in the
user's cache directory) runs the tests that hold on both majors (MAJOR_TESTS) against this
checkout's sources, under moto."""

import subprocess

import pytest

from tests.sdk.venvs import OTHER_MAJOR as OTHER
from tests.sdk.venvs import python, sagemaker_version, sdk_venv
from tests.server import REPO, clean_env

pytestmark = pytest.mark.slow

MAJOR_TESTS = [
    "tests/sdk/test_sdk_majors.py",
    "tests/sdk/test_sdk_guide.py",
    "tests/sdk/test_predictor.py",
    "tests/sdk/test_djl_model.py",
    "tests/sdk/test_light_import.py",
]


@pytest.mark.timeout(1800)  # it waits for the environment the run builds in the background
def test_the_tests_of_both_majors_pass_on_the_other_major():
    venv = sdk_venv(OTHER)
    version = sagemaker_version(venv)
    env = clean_env({"PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1",
                     "SAGEMAKER_SUPPRESS_V2_WARNING": "1"})
    # This checkout's sources (PYTHONPATH) on the other major; no conftest: these files import their fixtures.
    run = subprocess.run([python(venv), "-m", "pytest", "-p", "no:cacheprovider", "--noconftest", "-o", "addopts=",
                          "-q", "-rs", *MAJOR_TESTS], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, f"sagemaker {version}:\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert " passed" in run.stdout.strip().splitlines()[-1]
    # DJLModel (test_djl_model.py) is 2.x's: it runs, not skips, where 2.x is installed
    assert any("test_djl_model.py" in line for line in skipped) == (OTHER == 3), skipped
