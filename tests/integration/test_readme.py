"""The README stays honest: every command in it is run here, in tests/e2e/test_readme_run.py, or by CI."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from container.core.settings import reference_table
from tests.readme import README, on_port, python_snippets, quick_start_curls, run_shell, shell_commands
from tests.server import REPO, clean_env, free_port, wait_healthy

STREAMING_EXAMPLE = [
    "sagelmi serve --model-dir examples/streaming --port 8080",
    "curl -sN localhost:8080/invocations -d '{\"inputs\": \"one two three\", \"delay\": 0.2}'",
]


def test_every_readme_command_is_covered():
    from tests.container.test_image import README_COMMANDS as IMAGE_COMMANDS
    from tests.integration.test_plan_cli import README_COMMANDS as PLAN_COMMANDS
    from tests.e2e.test_lmi_dist import README_COMMANDS as LMI_DIST_TRY_OUT
    from tests.mpi.test_mpi_mode import TENSOR_PARALLEL_EXAMPLE
    from tests.e2e.test_reasoning_and_templates import README_COMMANDS as REASONING_EXAMPLE
    from tests.e2e.test_tool_calling import README_COMMANDS as TOOL_CALLING_EXAMPLE
    from tests.e2e.test_pooling import README_COMMANDS as POOLING_EXAMPLE
    from tests.sdk.test_readme import SNIPPETS as SDK_SNIPPETS

    covered = {
        *LMI_DIST_TRY_OUT,  # tests/e2e/test_lmi_dist.py (its server fixture)
        *IMAGE_COMMANDS,  # tests/container/test_image.py
        *PLAN_COMMANDS,  # tests/integration/test_plan_cli.py
        *TENSOR_PARALLEL_EXAMPLE,  # tests/mpi/test_mpi_mode.py
        "make run",  # tests/e2e/test_readme_run.py
        "make test",  # .ci/run (test_ci_runs_the_readme_test_command)
        "make bench",  # tests/e2e/test_bench.py
        "sagelmi config --model-dir examples/echo",  # test_config_command
        *quick_start_curls(),  # tests/e2e/test_readme_run.py
        *STREAMING_EXAMPLE,  # test_streaming_example
        *TOOL_CALLING_EXAMPLE,  # tests/e2e/test_tool_calling.py (its server fixture, test_the_readme_examples)
        *REASONING_EXAMPLE,  # tests/e2e/test_reasoning_and_templates.py (its server, test_the_readme_example...)
        *POOLING_EXAMPLE,  # tests/e2e/test_pooling.py (its server fixture, test_the_readme_examples)
    }
    assert sorted(shell_commands()) == sorted(covered)
    # The handler sketch (shape only), the OpenAI client (run in e2e), the tool call (tests/e2e/test_tool_calling.py),
    # the embeddings (tests/e2e/test_pooling.py); "Deploy to SageMaker" (tests/sdk/test_readme.py).
    assert len(python_snippets()) == 4 + len(SDK_SNIPPETS)


def test_ci_runs_the_readme_test_command():
    assert "exec make test" in (REPO / ".ci" / "run").read_text()


def test_reference_table_is_current():
    assert reference_table() in README


def test_config_command():
    result = run_shell("sagelmi config --model-dir examples/echo", 0)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^job_queue_size\s+1000\s+default$", result.stdout, re.M)


def test_streaming_example():
    port = free_port()
    env = clean_env({"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    process = subprocess.Popen(on_port(STREAMING_EXAMPLE[0], port), shell=True, cwd=REPO, env=env,
                               start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, 30)
        lines = [json.loads(line) for line in run_shell(STREAMING_EXAMPLE[1], port).stdout.splitlines()]
        assert [line.get("token") for line in lines[:3]] == ["one", "two", "three"]
        assert lines[-1] == {"generated_text": "one two three"}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)
