"""What the e2e tests share: the settings vLLM's CPU build needs here, the tiny model with the reasoning
and tool tokens, the lmi-dist server. The tiny model and the one vLLM server on it are in
tests/conftest.py (the container tests compare with it too)."""

import subprocess
import sys

import pytest

from tests.readme import run_shell, section, serve_settings, shell_commands
from tests.server import REPO, Server, clean_env, shared

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


# The lmi-dist try-out (docs/large_models.md): write the tiny model, serve it split over two ranks.
LMI_DIST_README = shell_commands(section("The lmi-dist engine"))
LMI_DIST_README_ENV = {"OPTION_ROLLING_BATCH": "lmi-dist", "TENSOR_PARALLEL_DEGREE": "2", **VLLM_CPU_ENV}
# What the option matrix's lmi-dist cell adds (prefix caching is vLLM's default on x86; the README's model
# has a context of 1024 already): the cell is served by the same server.
LMI_DIST_CELL = {"OPTION_ENABLE_PREFIX_CACHING": "true", "OPTION_MAX_MODEL_LEN": "1024"}


@pytest.fixture(scope="session")
def lmi_dist_server(tmp_path_factory):
    """The README's lmi-dist try-out, in float32 (its tokens are compared with ``vllm_server``'s)."""
    directory = str(tmp_path_factory.mktemp("readme-tiny"))
    write, serve = (command.replace("/tmp/tiny-model", directory) for command in LMI_DIST_README)
    written = run_shell(write, 0, timeout=300)
    assert written.returncode == 0, written.stderr
    env, model_dir = serve_settings(serve)
    assert env == LMI_DIST_README_ENV
    with Server(model_dir, env={**env, **EXACT, **LMI_DIST_CELL}, ready_timeout=ENGINE_READY_TIMEOUT) as server:
        yield shared("lmi_dist_server", server)
