"""The serving image, built from the Dockerfile and run as SageMaker runs it.

The commands are docs/image.md's ("Test the image locally"), read from that page and run on this
machine: podman instead of Docker (no Docker engine here), always with the runc runtime and the
limits its containers need, a local base image (no image registry is reachable) and the wheel
folder pip is configured with. See ``on_this_machine``.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests

from tests.container.conftest import (
    IMAGE,
    MEASURED,
    PODMAN,
    RUN_LIMITS,
    STOP_WITHIN,
    logs,
    podman,
)
from tests.container.image_build import readme_command
from tests.readme import run_shell, section, shell_commands
from tests.server import MODEL_DIRS, REPO, free_port

pytestmark = [
    pytest.mark.container,
    pytest.mark.slow,
    pytest.mark.timeout(1800),  # the first test builds the image: minutes without a layer cache
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed (.ci/run installs it)"),
]


def on_this_machine(command: str, name: str, substitutions: dict[str, str] | None = None) -> list[str]:
    """A README ``docker ...`` command as this machine runs it: podman with runc, the limits
    every run needs here, the test's own container name, port and paths."""
    for old, new in (substitutions or {}).items():
        command = command.replace(old, new)
    words = shlex.split(command.replace("$PWD", str(REPO)))
    assert words[0] == "docker", command
    words[:1] = PODMAN
    if words[len(PODMAN)] == "run":
        words[len(PODMAN) + 1:len(PODMAN) + 1] = RUN_LIMITS
        if "--name" in words:
            words[words.index("--name") + 1] = name
    if words[len(PODMAN)] == "stop":
        words[-1] = name
    return words


def wait_ping(port: int, name: str, timeout: float) -> float:
    """Seconds until /ping says 200 (the container must stay up meanwhile)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if requests.get(f"http://127.0.0.1:{port}/ping", timeout=2).status_code == 200:
                return time.monotonic() - started
        except requests.RequestException:
            pass
        state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
        assert state == "running", f"container {state}:\n{logs(name)}"
        time.sleep(1)
    raise AssertionError(f"/ping never said 200 in {timeout} s:\n{logs(name)}")


def start(command: str, name: str, port: int, substitutions: dict[str, str] | None = None) -> None:
    """Run the README's ``docker run -d ...`` on ``port`` as container ``name``."""
    run = on_this_machine(command, name, {"127.0.0.1:8080:": f"127.0.0.1:{port}:", **(substitutions or {})})
    result = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def stop(command: str, name: str) -> tuple[float, int]:
    """Run the README's stop command (SIGTERM, SIGKILL 30 s later): seconds taken, exit code."""
    started = time.monotonic()
    result = subprocess.run(on_this_machine(command, name), capture_output=True, text=True, timeout=STOP_WITHIN + 30)
    seconds = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    return seconds, int(podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout)


def curl_json(command: str, port: int) -> dict:
    result = run_shell(command, port, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture
def container(request):
    """A name for this test's container, removed afterwards whatever happened."""
    name = f"sagelmi-{request.node.name}".replace("_", "-")
    podman("rm", "--force", name, check=False)
    yield name
    podman("rm", "--force", "--time", "0", name, check=False)


def test_image_metadata(image):
    config = json.loads(podman("image", "inspect", image).stdout)[0]["Config"]
    assert config["Labels"]["com.amazonaws.sagemaker.capabilities.accept-bind-to-port"] == "true"
    assert "8080/tcp" in config["ExposedPorts"]
    assert config["Entrypoint"] == ["/usr/bin/tini", "--", "/usr/local/bin/sagelmi-entrypoint"]
    assert config["Cmd"] == ["serve"]


def test_other_commands_run_as_given(image, container):
    """`docker run IMAGE <command>` runs that command; only `serve` starts the server."""
    result = subprocess.run(on_this_machine(readme_command("docker run --rm"), container), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^port\s+8080\s+default$", result.stdout, re.M), result.stdout  # sagelmi config
    tools = podman("run", "--rm", *RUN_LIMITS, image, "sh", "-c",
                   "id -un; mpirun --version; g++ --version; python -c 'import vllm, container'").stdout
    assert tools.startswith("root\n") and "Open MPI" in tools and "g++" in tools, tools


def test_vllm_on_the_tiny_model(image, container, tmp_path):
    """Run 1: the built-in vLLM engine on the model in /opt/ml/model, as SageMaker starts it."""
    model = tmp_path / "model"
    made = run_shell(readme_command("sagelmi tiny-model").replace("/tmp/model", str(model)), 0, timeout=120)
    assert made.returncode == 0, made.stderr
    port = free_port()
    start(readme_command("docker run -d --name sagelmi "), container, port, {"/tmp/model:": f"{model}:"})
    ready = wait_ping(port, container, 600)

    began = time.monotonic()
    answer = curl_json(readme_command("curl -s localhost:8080/invocations -d '{\"inputs\": \"Hello\""), port)
    first_answer = time.monotonic() - began
    assert isinstance(answer["generated_text"], str) and answer["generated_text"], answer
    url = f"http://127.0.0.1:{port}"
    stream = requests.post(f"{url}/invocations", timeout=120, stream=True,
                           json={"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 8}})
    lines = [json.loads(line) for line in stream.iter_lines() if line]
    assert stream.status_code == 200 and len(lines) >= 2 and "generated_text" in lines[-1], lines
    chat = requests.post(f"{url}/v1/chat/completions", timeout=120,
                         json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant", chat.text
    assert "OPTION_MAX_ROLLING_BATCH_SIZE" in logs(container)  # the setting from the environment was used

    seconds, code = stop(readme_command("docker stop -t 30 sagelmi"), container)
    MEASURED.append(f"vLLM on the tiny model: /ping 200 after {ready:.0f} s, first answer {first_answer:.1f} s "
                    f"later, stopped in {seconds:.1f} s, exit code {code}")
    assert code == 0 and seconds < STOP_WITHIN, logs(container)


def test_model_py_with_requirements_as_non_root(image, container):
    """Run 2: a model.py whose requirements.txt pip installs at start, as the non-root user."""
    port = free_port()
    start(readme_command("docker run -d --name sagelmi-deps"), container, port)
    ready = wait_ping(port, container, 300)
    answer = curl_json(readme_command("curl -s localhost:8080/invocations -d '{\"inputs\": \"Hello, SageMaker!\"}'"),
                       port)
    assert answer == {"slug": "hello-sagemaker"}
    log = logs(container)
    assert "installing /opt/ml/model/requirements.txt" in log and "Successfully installed" in log, log
    user = podman("exec", container, "id", "-un").stdout.strip()
    assert user == "sagelmi"

    seconds, code = stop(readme_command("docker stop -t 30 sagelmi-deps"), container)
    MEASURED.append(f"model.py with requirements.txt: /ping 200 after {ready:.0f} s (pip install included), "
                    f"stopped in {seconds:.1f} s, exit code {code}")
    assert code == 0 and seconds < STOP_WITHIN, logs(container)


def test_the_sdks_local_runner_serves_the_image(image, tmp_path, monkeypatch):
    """sagemaker_sdk's LocalEndpoint in podman mode: the same image, the model's env, a predictor on it."""
    from sagemaker_sdk import SagelmiModel
    from sagemaker_sdk.local import LocalEndpoint

    conf = tmp_path / "containers.conf"  # this machine's podman needs runc (see ../shared/ENVIRONMENT.md)
    conf.write_text('[engine]\nruntime = "runc"\n')
    monkeypatch.setenv("CONTAINERS_CONF", str(conf))
    model = SagelmiModel(handler_dir=MODEL_DIRS / "sdk_textgen", options={"output_formatter": "sse"}, image_uri=image)
    endpoint = LocalEndpoint(model, mode="podman", ready_timeout=300)
    with endpoint as predictor:
        assert predictor.predict("hello world", max_new_tokens=3) == {"generated_text": "hello world größer"}
        assert list(predictor.predict_stream("hello world", max_new_tokens=4)) == ["hello", " world", " größer", " ☃"]
        assert podman("inspect", "--format", "{{.Config.Image}}", endpoint.container_name).stdout.strip() == image
    assert endpoint.process.returncode == 0, endpoint.log_tail()
