"""The README stays honest: every command in it is run here or by CI."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from container.settings import reference_table
from tests.server import REPO, Server, clean_env, free_port

README = (REPO / "README.md").read_text()

QUICK_START_CURLS = [
    "curl -s localhost:8080/invocations -H 'Content-Type: application/json' -d '{\"inputs\": \"hello\"}'",
    "curl -s localhost:8080/ping",
]
STREAMING = [
    "sagelmi serve --model-dir examples/streaming --port 8080",
    "curl -sN localhost:8080/invocations -d '{\"inputs\": \"one two three\", \"delay\": 0.2}'",
]
# Every command in the README's bash blocks, and the test that runs it.
COVERED = {
    "make run": "test_make_run_on_a_copy_of_the_checkout",
    "make test": "test_ci_runs_the_readme_test_command (CI runs it)",
    "sagelmi config --model-dir examples/echo": "test_config_command",
    **{c: "test_quick_start_curls" for c in QUICK_START_CURLS},
    **{c: "test_streaming_example" for c in STREAMING},
}


def readme_commands() -> list[str]:
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                commands.append(line)
    return commands


def run_shell(command: str, port: int, **kwargs) -> subprocess.CompletedProcess:
    command = command.replace("localhost:8080", f"localhost:{port}").replace("--port 8080", f"--port {port}")
    env = clean_env({"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    return subprocess.run(command, shell=True, capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=60, **kwargs)


def test_every_readme_command_is_covered():
    assert sorted(readme_commands()) == sorted(COVERED)


def test_ci_runs_the_readme_test_command():
    assert "exec make test" in (REPO / ".ci" / "run").read_text()


def test_reference_table_is_current():
    assert reference_table() in README


def test_config_command():
    result = run_shell("sagelmi config --model-dir examples/echo", 0)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^job_queue_size\s+1000\s+default$", result.stdout, re.M)


def test_quick_start_curls():
    with Server(REPO / "examples" / "echo") as server:
        answer = run_shell(QUICK_START_CURLS[0], server.port)
        assert json.loads(answer.stdout)["echo"] == {"inputs": "hello"}
        assert json.loads(run_shell(QUICK_START_CURLS[1], server.port).stdout)["status"] == "Healthy"


def test_streaming_example():
    port = free_port()
    serve = STREAMING[0].replace("--port 8080", f"--port {port}")
    env = clean_env({"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    process = subprocess.Popen(serve, shell=True, cwd=REPO, env=env, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(port, 30)
        lines = [json.loads(line) for line in run_shell(STREAMING[1], port).stdout.splitlines()]
        assert [line.get("token") for line in lines[:3]] == ["one", "two", "three"]
        assert lines[-1] == {"generated_text": "one two three"}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)


def _wait_healthy(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/ping", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"nothing healthy on port {port} after {timeout}s")


def _checkout_copy(dest: Path) -> None:
    """The files a fresh clone would have (tracked, plus new files not ignored)."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def test_make_run_on_a_copy_of_the_checkout(tmp_path):
    venv = Path(sys.prefix)
    if not (venv / ".sagelmi-installed").exists():
        pytest.fail(f"{venv} was not installed by `make install`; run the tests through `make test`")
    _checkout_copy(tmp_path)
    port = free_port()
    # -o: never reinstall into the shared venv from the copy (that would repoint the editable install)
    process = subprocess.Popen(["make", "-o", str(venv / ".sagelmi-installed"), "run", f"VENV={venv}",
                                f"PORT={port}"], cwd=tmp_path,
                               env=clean_env(), start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(port, 120)
        r = requests.post(f"http://127.0.0.1:{port}/invocations", json={"inputs": "hello"}, timeout=30)
        assert r.status_code == 200
        assert r.json()["model_dir"] == str(tmp_path / "examples" / "echo")  # served from the copy
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    assert "curl -s localhost:" in output
