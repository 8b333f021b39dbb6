import subprocess
import sys

import pytest

from tests.e2e.conftest import ENGINE_READY_TIMEOUT, EXACT, HUB_TOKEN, TINY_CONTEXT, VLLM_CPU_ENV
from tests.server import REPO, Server, clean_env


def pytest_sessionfinish(session, exitstatus):
    from tests.server import Server

    left = Server.stop_leftovers()  # a server must never outlive the run, whatever failed
    if left:
        print(f"\nstopped {len(left)} server(s) a test left running: {', '.join(left)}")
    # A run that selects no tests is a broken run, never a green one.
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-model")
    # A long context, so that a request can run for seconds: the tiny model decodes thousands of tokens a second.
    subprocess.run([sys.executable, "-m", "container", "tiny-model", str(directory), "--max-model-len",
                    str(TINY_CONTEXT)], check=True, cwd=REPO, env=clean_env(), capture_output=True, timeout=300)
    return directory


@pytest.fixture(scope="session")
def vllm_server(tiny_model):
    """One real vLLM server (CPU build) on the tiny model, in float32: the single-process reference
    of the e2e and container tests. It has a Hub token (unused: the model is local)."""
    env = {**VLLM_CPU_ENV, **EXACT, "OPTION_MAX_ROLLING_BATCH_SIZE": "64", "OPTION_HF_TOKEN": HUB_TOKEN}
    with Server(tiny_model, env=env, ready_timeout=ENGINE_READY_TIMEOUT) as server:
        yield server
