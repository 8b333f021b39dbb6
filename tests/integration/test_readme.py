"""The README and the pages under docs/ stay honest: every command in them is run here, by another test
(named below) or by CI, or is a deploy step that cannot run here (NOT_RUN, with the reason)."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import requests

from container.core.settings import reference_table, resolve_settings
from tests.readme import (README, documents, on_port, python_snippets, quick_start_curls, run_shell, section,
                          section_file, shell_commands)
from tests.server import REPO, clean_env, free_port, wait_healthy

STREAMING_EXAMPLE = [  # docs/handlers.md
    "sagelmi serve --model-dir examples/streaming --port 8080",
    "curl -sN localhost:8080/invocations -d '{\"inputs\": \"one two three\", \"delay\": 0.2}'",
]
BRING_A_MODEL = section("Bring a model.py")  # README.md
(HANDLER,) = python_snippets(BRING_A_MODEL)
HANDLER_COMMANDS = shell_commands(BRING_A_MODEL)
DEPLOY_STEPS = shell_commands(section("Deploy to SageMaker"))  # README.md
# The deploy quick start's commands that no test runs, and why; test_the_deploy_steps_fit_together
# checks what can be checked of them without running them.
NOT_RUN = {
    "make image": "builds the GPU image on NVIDIA's CUDA base image, and no image registry is reachable here "
                  "(tests/container builds and runs the CPU image from the same Dockerfile)",
    "docker run -d --name sagelmi-gpu --gpus all ": "needs an NVIDIA GPU, its driver and the GPU image",
    "aws ecr ": "needs an AWS account; moto mocks ECR's API but has no registry to log in or push to",
    "docker tag ": "tags the GPU image for the registry (above)",
    "docker push ": "pushes to a real ECR registry (above)",
}
(COUNT_TOKENS,) = python_snippets(section("The completion line"))  # docs/observability.md
MAX_README_LINES = 200


def test_every_readme_command_is_covered():
    """Every command of the README and of the pages under docs/ is run by a test (or by CI), or is
    one of the deploy steps that cannot run here; every Python snippet is run by a test."""
    from tests.container.test_cluster import COMMANDS as CLUSTER_COMMANDS
    from tests.container.image_build import readme_commands
    from tests.integration.test_plan_cli import README_COMMANDS as PLAN_COMMANDS
    from tests.e2e.conftest import LMI_DIST_README as LMI_DIST_TRY_OUT
    from tests.e2e.test_readme_run import OPENAI_SNIPPET
    from tests.mpi.test_mpi_mode import TENSOR_PARALLEL_EXAMPLE
    from tests.e2e.test_reasoning_and_templates import README_COMMANDS as REASONING_EXAMPLE
    from tests.e2e.test_tool_calling import README_COMMANDS as TOOL_CALLING_EXAMPLE, README_SNIPPET as TOOL_SNIPPET
    from tests.e2e.test_pooling import README_COMMANDS as POOLING_EXAMPLE, README_SNIPPET as POOLING_SNIPPET
    from tests.e2e.test_vision import DATA_CURL, HTTP_CURL, SERVE, SNIPPET as VISION_SNIPPET, WRITE
    from tests.sdk.test_readme import SNIPPETS as SDK_SNIPPETS
    from tests.integration.test_sm_vllm import DOC_COMMAND as SM_VLLM_CONFIG
    from tests.unit.test_ray_cluster import DOC_COMMANDS as RAY_COMMANDS
    from tests.e2e.test_vllm_openai import DOC_COMMANDS as RESPONSES_AND_MESSAGES

    covered = {
        *LMI_DIST_TRY_OUT,  # tests/e2e/conftest.py (lmi_dist_server)
        *readme_commands(),  # tests/container/test_image.py (docs/image.md)
        *CLUSTER_COMMANDS,  # tests/container/test_cluster.py
        *PLAN_COMMANDS,  # tests/integration/test_plan_cli.py
        *TENSOR_PARALLEL_EXAMPLE,  # tests/mpi/test_mpi_mode.py
        "make run",  # tests/e2e/test_readme_run.py
        "make test",  # .ci/run (test_ci_runs_the_readme_test_command)
        "make bench",  # tests/e2e/test_bench.py
        "sagelmi config --model-dir examples/echo",  # test_config_command
        SM_VLLM_CONFIG,  # tests/integration/test_sm_vllm.py (docs/configuration.md)
        *RAY_COMMANDS,  # tests/unit/test_ray_cluster.py: what sagelmi runs, word for word (tests/container/test_ray_cluster.py runs it)
        *quick_start_curls(),  # tests/e2e/test_readme_run.py
        *STREAMING_EXAMPLE,  # test_streaming_example
        *HANDLER_COMMANDS,  # test_the_handler_quick_start
        *TOOL_CALLING_EXAMPLE,  # tests/e2e/test_tool_calling.py (its server fixture, test_the_readme_examples)
        *REASONING_EXAMPLE,  # tests/e2e/test_reasoning_and_templates.py (its server, test_the_readme_example...)
        *POOLING_EXAMPLE,  # tests/e2e/test_pooling.py (its server fixture, test_the_readme_examples)
        *RESPONSES_AND_MESSAGES,  # tests/e2e/test_vllm_openai.py (test_the_docs_examples)
        WRITE, SERVE, DATA_CURL, HTTP_CURL,  # tests/e2e/test_vision.py (docs/vision.md)
        *shell_commands(documents()["docs/sessions.md"]),  # tests/e2e/test_vllm_sessions.py
        *DEPLOY_STEPS,  # NOT_RUN (test_the_deploy_steps_fit_together)
    }
    every = {name: shell_commands(text) for name, text in documents().items()}
    assert {command for commands in every.values() for command in commands} == covered
    for command in DEPLOY_STEPS:
        assert [start for start in NOT_RUN if command.startswith(start)], f"not run and not said why: {command}"
    # The OpenAI client (tests/e2e/test_readme_run.py), the handler (test_the_handler_quick_start), the
    # tool call (tests/e2e/test_tool_calling.py), the embeddings (tests/e2e/test_pooling.py), the image chat
    # (tests/e2e/test_vision.py), the deploy snippet and the guide's (tests/sdk/test_readme.py), a model.py's
    # token counts (test_the_count_tokens_snippet_counts).
    snippets = [snippet for text in documents().values() for snippet in python_snippets(text)]
    assert sorted(snippets) == sorted([OPENAI_SNIPPET, HANDLER, TOOL_SNIPPET, POOLING_SNIPPET, VISION_SNIPPET,
                                       *SDK_SNIPPETS, COUNT_TOKENS])


def test_the_readme_is_short():
    lines = len(README.splitlines())
    assert lines < MAX_README_LINES, f"README.md has {lines} lines: move reference material to docs/"



def test_the_quick_start_asks_for_the_model_by_the_name_it_is_served_under():
    """The chat request and the OpenAI client name the model ``make run`` serves (its directory's name)."""
    from container.core.served_names import served_names

    tiny_model = re.search(r"^TINY_MODEL \?= (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    served = served_names(resolve_settings({}, REPO / tiny_model)).engine
    quick_start = section("Quick start")
    named = re.findall(r'"model": "([^"]+)"', quick_start) + re.findall(r'model="([^"]+)"', quick_start)
    assert len(named) == 2 and set(named) == {served}, named
    assert f"under the name `{served}`" in " ".join(quick_start.split())


def test_the_quick_start_says_how_large_the_install_is_and_how_to_stop_the_server():
    """The size it states is the size of this run's virtualenv (what ``make install`` made) within a
    quarter; it says how to pick another port and how to stop the server."""
    quick_start = " ".join(section("Quick start").split())
    stated = re.search(r"into `\.venv`: about (\d+(?:\.\d+)?) GB on disk", quick_start)
    assert stated, "the Quick start does not say how large the install is"
    du = subprocess.run(["du", "-s", "--block-size=1", str(Path(sys.prefix).resolve())], capture_output=True,
                        text=True, timeout=120)
    measured = int(du.stdout.split()[0]) / 1e9
    assert abs(measured - float(stated.group(1))) <= 0.25 * measured, f"{measured:.1f} GB on disk"
    assert "`make run PORT=8081` serves on another port" in quick_start
    assert "Ctrl-C in the terminal of `make run` (or of `sagelmi serve`) stops the server" in quick_start

def test_the_benchmarks_page_opens_with_a_short_summary_of_its_current_files():
    """docs/benchmarks/README.md: what to expect and which files are current in at most 15 lines,
    before how the benchmarks work and the dated history."""
    page = (REPO / "docs" / "benchmarks" / "README.md").read_text()
    summary = [line for line in page.split("\n## ", 1)[0].splitlines()[1:] if line.strip()]
    assert len(summary) <= 15, f"the summary has {len(summary)} lines"
    current = sorted(p.name for p in (REPO / "docs" / "benchmarks").glob("*.md") if p.name != "README.md")
    assert current and [name for name in current if f"]({name})" not in "\n".join(summary)] == []
    assert "\n## History, newest first\n" in page


def test_every_page_the_readme_links_exists():
    links = re.findall(r"\]\((docs/[^)#]+)", README)
    assert len(links) >= 10
    assert [link for link in links if not (REPO / link).is_file()] == []


def test_the_deploy_steps_fit_together():
    """The steps that cannot run here still name one image throughout: the one ``make image`` builds
    is tagged, pushed to the registry docker logs in to, in the region it is created in, and is the
    SDK snippet's ``image_uri``; the GPU run serves that image with settings the container accepts."""
    from tests.sdk.test_readme import DEPLOY

    build, run, create, login, tag, push = DEPLOY_STEPS
    dry_run = subprocess.run(["make", "-n", "image"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert build == "make image" and dry_run.returncode == 0, dry_run.stderr
    built = re.search(r" -t (\S+)", dry_run.stdout).group(1)
    image_uri = re.search(r'image_uri="([^"]+)"', DEPLOY).group(1)
    registry, _, repository = image_uri.partition("/")
    region = re.fullmatch(r"\d{12}\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com", registry).group(1)
    assert shlex.split(tag)[2:] == [built, image_uri] and shlex.split(push)[2:] == [image_uri]
    assert f"--repository-name {repository.split(':')[0]} --region {region}" in create
    assert f"get-login-password --region {region} | docker login --username AWS --password-stdin {registry}" in login

    words = shlex.split(run)
    assert words[:3] == ["docker", "run", "-d"] and "--gpus" in words and words[-2:] == [built, "serve"]
    env = dict(words[i + 1].split("=", 1) for i, word in enumerate(words) if word == "-e" and "=" in words[i + 1])
    settings = resolve_settings(env, "/nonexistent")
    assert settings.model_id == re.search(r'model_id="([^"]+)"', DEPLOY).group(1)


def test_the_count_tokens_snippet_counts():
    """docs/observability.md's call, as a model.py's handle makes it while a request is being handled."""
    from handlers.api.usage import RequestUsage, current_usage

    usage = RequestUsage()
    token = current_usage.set(usage)
    try:
        exec(COUNT_TOKENS, {"prompt_ids": [1, 2, 3], "generated_ids": [4, 5]})
        exec(COUNT_TOKENS, {"prompt_ids": [6], "generated_ids": [7]})  # "adds to this request's counts"
    finally:
        current_usage.reset(token)
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 3)


def test_ci_runs_the_readme_test_command():
    assert "exec make test" in (REPO / ".ci" / "run").read_text()


def test_reference_table_is_current():
    assert section_file("Every setting") == "docs/configuration.md"
    assert reference_table() in section("Every setting")


def test_the_handler_quick_start(tmp_path):
    """The README's model.py, saved where it says, configured, served and asked with its commands,
    with ``.venv`` activated as it says (the test's virtual environment, not on PATH otherwise)."""
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "model.py").write_text(HANDLER)
    config, serve, ask = (command.replace("my-model", str(model_dir)) for command in HANDLER_COMMANDS)
    activate = f". {Path(sys.executable).parent / 'activate'} && "
    env = clean_env({"PATH": "/usr/bin:/bin"})

    shown = subprocess.run(activate + config, shell=True, executable="/bin/bash", capture_output=True, text=True,
                           cwd=tmp_path, env=env, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^handler: .*model\.py", shown.stdout, re.M), shown.stdout

    port = free_port()
    process = subprocess.Popen(activate + on_port(serve, port), shell=True, executable="/bin/bash", cwd=tmp_path,
                               env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, 60)
        answered = json.loads(run_shell(ask, port).stdout)
        sent = json.loads(shlex.split(ask)[-1])
        assert answered == {"generated_text": sent["inputs"].upper()}
        assert f"The answer is `{json.dumps(answered)}`" in BRING_A_MODEL  # what the README says it is
        malformed = requests.post(f"http://127.0.0.1:{port}/invocations", data="{", timeout=10)
        assert malformed.status_code == 400 and malformed.json()["code"] == 400, malformed.text
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)


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
