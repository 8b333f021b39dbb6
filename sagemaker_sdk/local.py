"""Running a ``SagelmiModel`` on this machine with the environment SageMaker
would give it: the image under docker or podman, or ``sagelmi serve`` as a
plain process (no container: the ``sagelmi`` package with its runtime extras
must be installed here).

    with LocalEndpoint(model, mode="process", model_dir="my-model") as predictor:
        predictor.predict("Hello", max_new_tokens=16)

The predictor is a ``SagelmiPredictor`` whose requests go over HTTP to the
local port, streams included (read through the same parser as SageMaker's).
"""

from __future__ import annotations

import atexit
import http.client
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from container.core.setting_keys import KEYS
from sagemaker_sdk.predictor import SagelmiPredictor

log = logging.getLogger(__name__)

MODES = ("process", "podman", "docker")
CONTAINER_MODEL_DIR = "/opt/ml/model"
# What a run needs beyond the image's defaults (see docs/image.md): podman refuses
# this machine's default runtime, vLLM starves under low process limits and /dev/shm of 64 MB.
# vLLM's worker processes need more /dev/shm than Docker's 64 MB and many open files. Anything
# a machine needs beyond these (a GPU, an OCI runtime) goes in run_args or the runtime's own config.
CONTAINER_RUN_OPTIONS = ("--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768", "--shm-size=1g")
# invoke_endpoint's arguments that reach the container as headers
_HEADERS = {
    "CustomAttributes": "X-Amzn-SageMaker-Custom-Attributes",
    "TargetModel": "X-Amzn-SageMaker-Target-Model",
    "TargetVariant": "X-Amzn-SageMaker-Target-Variant",
    "InferenceId": "X-Amzn-SageMaker-Inference-Id",
}
_SETTING_NAMES = {name for k in KEYS for name in (*k.env, *k.sagemaker)}
_SETTING_PREFIXES = ("OPTION_", "SERVING_", "SM_VLLM_")  # SM_VLLM_: AWS's vLLM-container names (core.sm_vllm)


class InvocationError(RuntimeError):
    """The local server answered with an error status; ``status`` and ``body`` say what."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"the endpoint answered {status}: {body}")
        self.status = status
        self.body = body


def container_command(
    runtime: str,
    image: str,
    port: int,
    env_names: Sequence[str],
    model_dir: Path | None = None,
    name: str | None = None,
    run_args: Sequence[str] = (),
) -> list[str]:
    """``<runtime> run`` for the image as SageMaker runs it (``IMAGE serve``), on
    ``127.0.0.1:<port>``, ``model_dir`` mounted read-only at /opt/ml/model. The
    variables are passed by name (``-e NAME``): their values come from the
    runtime's own environment, so secrets such as ``HF_TOKEN`` stay off the
    command line."""
    command = [runtime, "run", "--rm", *CONTAINER_RUN_OPTIONS, "-p", f"127.0.0.1:{port}:8080"]
    if name:
        command += ["--name", name]
    if model_dir is not None:
        command += ["-v", f"{Path(model_dir).absolute()}:{CONTAINER_MODEL_DIR}:ro"]
    for env_name in env_names:
        command += ["-e", env_name]
    return [*command, *run_args, image, "serve"]


def serve_command(model_dir: Path, port: int) -> list[str]:
    """``sagelmi serve`` in this Python, without a container."""
    return [sys.executable, "-m", "container", "serve", "--model-dir", str(model_dir), "--port", str(port)]


def endpoint_env(model_env: Mapping[str, str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """This machine's environment without its own sagelmi settings (the endpoint
    sees only the model's), plus the model's environment."""
    base = os.environ if base is None else base
    kept = {k: v for k, v in base.items() if not k.startswith(_SETTING_PREFIXES) and k not in _SETTING_NAMES}
    return {**kept, **model_env}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRuntimeClient:
    """The two calls of SageMaker's runtime client a predictor makes
    (``invoke_endpoint``, ``invoke_endpoint_with_response_stream``), answered over
    HTTP by a server on this machine, in the shapes boto3 returns."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 600) -> None:
        self.host, self.port, self.timeout = host, port, timeout

    def _post(self, args: Mapping[str, Any]) -> http.client.HTTPResponse:
        headers = {
            "Content-Type": args.get("ContentType", "application/json"),
            "Accept": args.get("Accept", "application/json"),
        }
        for arg, header in _HEADERS.items():  # as SageMaker passes them to the container
            if args.get(arg):
                headers[header] = args[arg]
        body = args["Body"]
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        conn.request("POST", "/invocations", body=body.encode() if isinstance(body, str) else body, headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            text = response.read().decode(errors="replace")
            conn.close()
            raise InvocationError(response.status, text)
        return response

    def invoke_endpoint(self, **args) -> dict:
        response = self._post(args)
        return {"Body": response, "ContentType": response.getheader("Content-Type", "")}

    def invoke_endpoint_with_response_stream(self, **args) -> dict:
        response = self._post(args)
        return {"Body": self._payload_parts(response), "ContentType": response.getheader("Content-Type", "")}

    @staticmethod
    def _payload_parts(response: http.client.HTTPResponse) -> Iterator[dict]:
        try:
            while piece := response.read1(65536):
                yield {"PayloadPart": {"Bytes": piece}}
        finally:
            response.close()


class LocalSession:
    """What a ``sagemaker`` ``Predictor`` needs of a session, for a local server."""

    local_mode = True

    def __init__(self, port: int, timeout: float = 600) -> None:
        self.sagemaker_runtime_client = LocalRuntimeClient(port, timeout=timeout)


class LocalEndpoint:
    """``model`` served on this machine: ``mode`` ``"process"`` (``sagelmi serve``
    in this Python), ``"podman"`` or ``"docker"`` (``image``, default the model's
    ``image_uri``). ``model_dir`` is the model directory (default: the model's
    ``handler_dir``; a model given only as ``model_id`` needs none; S3
    ``model_data`` is not fetched: download it and pass ``model_dir``).

    As a context manager it starts the server, waits until ``/ping`` answers 200
    (``ready_timeout`` seconds), gives a ``SagelmiPredictor`` on it, and stops it
    with SIGTERM on exit. ``log_path`` is the server's output."""

    def __init__(
        self,
        model,
        mode: str = "process",
        *,
        model_dir: str | Path | None = None,
        image: str | None = None,
        port: int | None = None,
        ready_timeout: float = 1800,
        run_args: Sequence[str] = (),
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self.model = model
        self.model_dir = Path(model_dir).absolute() if model_dir is not None else model.handler_dir
        if self.model_dir is None and model.model_data is not None:
            raise ValueError(
                "LocalEndpoint does not fetch model_data: download it and pass model_dir=, "
                "or give the model as model_id='s3://...'"
            )
        self.image = image or model.image_uri
        if mode != "process" and not self.image:
            raise ValueError(f"mode={mode!r} needs an image: image= or the model's image_uri")
        self.port = port or _free_port()
        self.ready_timeout = ready_timeout
        self.run_args = tuple(run_args)
        self.env = endpoint_env(model.env)
        self.process: subprocess.Popen | None = None
        self._empty_dir: tempfile.TemporaryDirectory | None = None
        descriptor, log_path = tempfile.mkstemp(prefix="sagelmi-local-", suffix=".log")
        os.close(descriptor)
        self.log_path = Path(log_path)

    def command(self) -> list[str]:
        if self.mode == "process":
            if self.model_dir is None:
                self._empty_dir = tempfile.TemporaryDirectory(prefix="sagelmi-model-")
                return serve_command(Path(self._empty_dir.name), self.port)
            return serve_command(self.model_dir, self.port)
        return container_command(
            self.mode,
            self.image,
            self.port,
            sorted(self.model.env),
            self.model_dir,
            name=self.container_name,
            run_args=self.run_args,
        )

    @property
    def container_name(self) -> str:
        return f"sagelmi-local-{self.port}"

    # -- lifecycle
    def start(self) -> SagelmiPredictor:
        command = self.command()
        log.info("starting %s (log: %s)", " ".join(command), self.log_path)
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(
                command, env=self.env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        atexit.register(self.stop)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.predictor()

    def predictor(self) -> SagelmiPredictor:
        return SagelmiPredictor(f"local-{self.port}", LocalSession(self.port))

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        process = self.process
        assert process is not None  # start() started it
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {process.returncode} before it was ready; "
                    f"its log ({self.log_path}) ends:\n{self.log_tail()}"
                )
            if self.ping() == 200:
                return
            time.sleep(0.25)
        raise TimeoutError(
            f"/ping did not answer 200 within {self.ready_timeout}s; the log ({self.log_path}) ends:\n{self.log_tail()}"
        )

    def ping(self) -> int | None:
        """``/ping``'s status, or None when nothing answers."""
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            conn.request("GET", "/ping")
            status = conn.getresponse().status
            conn.close()
            return status
        except OSError:
            return None

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM, then wait (``timeout`` s) and kill; the exit status."""
        atexit.unregister(self.stop)
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the server did not stop within %ss; killing it", timeout)
                self.process.kill()
                self.process.wait()
                if self.mode != "process":
                    subprocess.run([self.mode, "rm", "-f", self.container_name], capture_output=True)
        if self._empty_dir is not None:
            self._empty_dir.cleanup()
            self._empty_dir = None
        return self.process.returncode if self.process is not None else None

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> SagelmiPredictor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
