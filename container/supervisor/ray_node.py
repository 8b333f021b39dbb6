"""This node's Ray process, for ``option.distributed_executor_backend=ray`` across a cluster
(``container.core.ray_cluster`` says what runs where): ``ray start ... --block`` as a child of
the supervisor (or of ``sagelmi ray-node``), started again whenever it exits (a worker node's
Ray stops when the head goes, and must join the head that comes back), and stopped with
everything it started.

Ray's token is written to a file in the supervisor's private runtime directory (mode 0600):
Ray's processes and the leader's engine read it through ``RAY_AUTH_TOKEN_PATH``, and it is in no
process's environment.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from container.core.cluster import ClusterConfig
from container.core.handler_choice import mpirun_groups
from container.core.ray_cluster import RayNode, auth_environment, ray_node, ray_token, uses_ray
from container.core.settings import Settings
from container.supervisor.processes import StartupError, _exit_text, _start, _terminate

log = logging.getLogger("sagelmi.ray")

RESTART_DELAY = 5.0  # seconds between Ray's exit and its next start
STOP_TIMEOUT = 30.0  # Ray's processes stop on SIGTERM within seconds; then they are killed


def find_ray() -> str:
    """The ``ray`` command beside this Python (the image's venv), else on PATH. Raises
    ``StartupError`` naming the extra to install."""
    beside = Path(sys.executable).parent / "ray"
    found = str(beside) if beside.is_file() else shutil.which("ray")
    if found is None:
        raise StartupError(
            "option.distributed_executor_backend=ray needs Ray on every node: pip install '.[ray]' from "
            "sagelmi's checkout (the image has it)"
        )
    return found


class RayProcess:
    """``ray start --block`` for this node, kept running until ``stop``."""

    def __init__(self, node: RayNode, secret: bytes, runtime: Path, ray: str | None = None) -> None:
        self.node = node
        self.ray = ray or find_ray()
        self.token_path = runtime / "ray-token"
        self._secret = secret
        self._stopping = threading.Event()
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.starts = 0

    def driver_environment(self) -> dict[str, str]:
        """What the leader's engine needs to reach this cluster's head (``RayNode.driver_environment``)."""
        return self.node.driver_environment(str(self.token_path))

    def start(self) -> RayProcess:
        descriptor = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as token:
            token.write(ray_token(self._secret))
        self._launch()
        threading.Thread(target=self._keep_running, name="ray-node", daemon=True).start()
        return self

    def _launch(self) -> None:
        command = self.node.start_command(self.ray)
        env = {**os.environ, **auth_environment(str(self.token_path))}
        with self._lock:
            if self._stopping.is_set():
                return
            self.starts += 1
            self._process = _start(command, env=env, stdin=subprocess.DEVNULL)
        role = "head" if self.node.head else f"node joining the head at {self.node.head_address}"
        log.info("ray: started this node's Ray (%s): %s", role, " ".join(command))

    def _keep_running(self) -> None:
        while not self._stopping.is_set():
            process = self._process
            if process is None or process.poll() is None:
                self._stopping.wait(1.0)
                continue
            reason = _exit_text(process.returncode)
            log.warning("ray: this node's Ray stopped (%s); starting it again in %gs", reason, RESTART_DELAY)
            if not self._stopping.wait(RESTART_DELAY):
                self._launch()

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            process = self._process
        if process is not None:
            _terminate(process, STOP_TIMEOUT)
        self.token_path.unlink(missing_ok=True)


def ray_process(
    settings: Settings, config: ClusterConfig | None, runtime: Path, ray: str | None = None
) -> RayProcess | None:
    """This node's Ray process when the built-in engine runs on Ray across a cluster (Python mode:
    a user's handler in MPI mode runs its groups as ``mpirun`` jobs), else ``None``;
    ``ray``: the ``ray`` command (default: ``find_ray``). Raises ``StartupError`` when Ray is not
    installed (before anything starts or downloads)."""
    if config is None or mpirun_groups(settings) or not uses_ray(settings):
        return None
    node = ray_node(config.leader, settings.ray_port, config.is_leader(), config.node_address)
    return RayProcess(node, config.secret, runtime, ray)
