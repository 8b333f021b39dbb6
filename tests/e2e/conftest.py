"""What the e2e tests share: the settings vLLM's CPU build needs here, the tiny model with the reasoning
and tool tokens. The tiny model and the one vLLM server on it are in tests/conftest.py (the container
tests compare with it too)."""

import subprocess
import sys

import pytest

from tests.server import REPO, clean_env

# What vLLM's CPU build needs on a small machine (see docs/troubleshooting.md).
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
# Tests that compare greedy tokens across servers whose sums run in a different order (tensor and
# pipeline shards, other batch shapes) serve in float32: in bfloat16, vLLM's CPU default, near-ties flip.
EXACT = {"OPTION_DTYPE": "float32"}
# A Hub token in the reference server's settings: vLLM gets it, a local model never sends it anywhere,
# and the log shows it as ***.
HUB_TOKEN = "hf_e2eTokenThatMustNeverBeLogged0123"
TINY_CONTEXT = 8192
# A first start compiles the model (later starts reuse vLLM's compile cache): allow for it on 2 busy cores.
ENGINE_READY_TIMEOUT = 240


@pytest.fixture(scope="session")
def tiny_think_model(tmp_path_factory):
    """The tiny model with the special tokens vLLM's reasoning and tool parsers look for."""
    directory = tmp_path_factory.mktemp("tiny-think-model")
    tokens = [f"--special-token={t}" for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")]
    subprocess.run([sys.executable, "-m", "container", "tiny-model", str(directory), *tokens], check=True, cwd=REPO,
                   env=clean_env(), capture_output=True, timeout=300)
    return directory
