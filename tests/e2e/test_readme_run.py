"""The README's run command, on a copy of the checkout, and its quick-start requests."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import ENGINE_READY_TIMEOUT
from tests.readme import python_snippets, quick_start_curls, run_shell, section
from tests.server import REPO, clean_env, free_port, installed_venv, wait_healthy

pytestmark = pytest.mark.slow

OPENAI_SNIPPET = next(s for s in python_snippets(section("Quick start")) if "openai.OpenAI(" in s)


def checkout_copy(dest: Path) -> None:
    """The files a fresh clone would have: tracked ones, plus new ones not ignored."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)


def test_make_run_serves_the_tiny_model_and_the_quick_start_works(tmp_path):
    venv = installed_venv()
    stamp = venv / ".sagelmi-installed"
    checkout_copy(tmp_path)
    port = free_port()
    # -o: never reinstall into the shared venv from the copy (that would repoint its editable install)
    process = subprocess.Popen(["make", "-o", str(stamp), "run", f"VENV={venv}", f"PORT={port}"], cwd=tmp_path,
                               env=clean_env(), start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(port, ENGINE_READY_TIMEOUT)  # a cold start, compiling the model, beside the other lanes
        assert (tmp_path / ".cache" / "tiny-model" / "config.json").exists()  # written by the copy's make run
        ping, lmi, stream, chat = (run_shell(c, port) for c in quick_start_curls())
        assert json.loads(ping.stdout)["status"] == "Healthy"
        details = json.loads(lmi.stdout)["details"]
        assert details["generated_tokens"] >= 1 and details["tokens"][0]["log_prob"] <= 0
        lines = [json.loads(line) for line in stream.stdout.splitlines()]
        assert "token" in lines[0] and "generated_text" in lines[-1]
        assert json.loads(chat.stdout)["object"] == "chat.completion"

        result = subprocess.run([sys.executable, "-c", OPENAI_SNIPPET.replace("localhost:8080", f"localhost:{port}")],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        output = process.communicate(timeout=90)[0]
    assert "Try:" in output and "curl -s localhost:" in output
