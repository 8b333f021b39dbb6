"""One real vLLM server (CPU build) on the built-in tiny model, shared by the e2e tests."""

import subprocess
import sys

import pytest

from tests.server import REPO, Server, clean_env

# What vLLM's CPU build needs on a small machine (see docs/troubleshooting.md).
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
# Tests that compare greedy tokens across servers whose sums run in a different order (tensor and
# pipeline shards, other batch shapes) serve in float32: in bfloat16, vLLM's CPU default, near-ties flip.
EXACT = {"OPTION_DTYPE": "float32"}
TINY_CONTEXT = 8192
# A first start compiles the model (later starts reuse vLLM's compile cache): allow for it on 2 busy cores.
ENGINE_READY_TIMEOUT = 240


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-model")
    # A long context, so that a request can run for seconds: the tiny model decodes thousands of tokens a second.
    subprocess.run([sys.executable, "-m", "container", "tiny-model", str(directory), "--max-model-len",
                    str(TINY_CONTEXT)], check=True, cwd=REPO, env=clean_env(), capture_output=True, timeout=300)
    return directory


@pytest.fixture(scope="session")
def tiny_think_model(tmp_path_factory):
    """The tiny model with the special tokens vLLM's reasoning and tool parsers look for."""
    directory = tmp_path_factory.mktemp("tiny-think-model")
    tokens = [f"--special-token={t}" for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")]
    subprocess.run([sys.executable, "-m", "container", "tiny-model", str(directory), *tokens], check=True, cwd=REPO,
                   env=clean_env(), capture_output=True, timeout=300)
    return directory


@pytest.fixture(scope="session")
def vllm_server(tiny_model):
    with Server(tiny_model, env={**VLLM_CPU_ENV, **EXACT, "OPTION_MAX_ROLLING_BATCH_SIZE": "64"},
                ready_timeout=ENGINE_READY_TIMEOUT) as server:
        yield server
