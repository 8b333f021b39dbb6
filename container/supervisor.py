"""``sagelmi serve``: the process that owns everything else.

Order of start-up: bind the HTTP port (so ``/ping`` answers 503 while the model
loads), start the frontend, install ``requirements.txt``, start one model
worker process per worker group. Then watch: a worker that dies after it was
ready is restarted (its in-flight requests already failed in the frontend); a
worker that cannot load the model, or takes longer than
``model_loading_timeout``, stops the server with the reason in the log.

On SIGTERM (or SIGINT): the frontend drains (503 for new requests, in-flight
ones finish within ``shutdown_grace_period``), then the workers stop, and the
process exits 0.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from container.artifacts import ArtifactError, fetch_s3
from container.devices import GroupPlan, discover_devices, plan_groups
from container.frontend.spec import FrontendSpec, GroupSpec, encode_spec as encode_frontend_spec
from container.settings import Settings, SettingsError
from container.worker_client import WorkerLink
from handlers.protocol import EXIT_LOAD_FAILED, WorkerSpec, encode_spec

log = logging.getLogger("sagelmi.serve")

POLL_INTERVAL = 0.1
STOP_TIMEOUT = 10.0
MAX_RESTART_DELAY = 30.0
FRONTEND_MIN_UPTIME = 10.0  # a frontend that dies sooner is broken, not unlucky


class StartupError(Exception):
    """Start-up cannot continue; the message says why."""


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _kill_group(process: subprocess.Popen) -> None:
    """Kill what is left of a child's process group (it leads its own session):
    an engine's helper processes (vLLM's EngineCore ...) must not outlive it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _terminate(process: subprocess.Popen, timeout: float) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop within %gs; killing it", process.pid, timeout)
            process.kill()
            process.wait()
    _kill_group(process)


class ModelWorker:
    """One worker group in Python mode: one process, restarted when it dies."""

    def __init__(self, plan: GroupPlan, settings: Settings, runtime: Path, model_id: str | None) -> None:
        self.plan = plan
        self.settings = settings
        self.socket_path = str(runtime / f"worker-{plan.index}.sock")
        self.spec_path = runtime / f"worker-{plan.index}.json"
        properties = settings.handler_properties()
        if model_id is not None:  # where the model really is (an s3:// prefix, downloaded)
            properties["model_id"] = model_id
        if settings.tensor_parallel_degree == "max":  # the handler gets the number: this group's devices
            properties["tensor_parallel_degree"] = str(max(1, len(plan.devices)))
        self.spec_path.write_bytes(encode_spec(WorkerSpec(
            group=plan.index, socket_path=self.socket_path, model_dir=settings.model_dir,
            entry_point=settings.entry_point, properties=properties,
            sync_handler_threads=settings.sync_handler_threads, log_level=settings.log_level)))
        self.process: subprocess.Popen | None = None
        self.link = WorkerLink(f"group-{plan.index}", self.socket_path).start()
        self.started_at = 0.0
        self.ready = False  # this incarnation reported ready
        self.ever_ready = False
        self.crashes = 0
        self.restart_at: float | None = None

    def start(self) -> None:
        env = dict(os.environ)
        if self.plan.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.plan.cuda_visible_devices
        self.process = subprocess.Popen(
            [sys.executable, "-m", "handlers.worker", "--spec", str(self.spec_path)],
            env=env, cwd=self.settings.model_dir, start_new_session=True)
        self.started_at = time.monotonic()
        self.ready = False
        self.restart_at = None
        log.info("started model worker %d (pid %d%s)", self.plan.index, self.process.pid,
                 f", CUDA_VISIBLE_DEVICES={self.plan.cuda_visible_devices}" if self.plan.devices else "")

    def check(self, now: float) -> None:
        """Advance this worker's life: notice readiness, deaths, timeouts.

        Raises ``StartupError`` when the model cannot be served."""
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.start()
            return
        code = self.process.poll()
        if not self.ready and self.link.ready_pid == self.process.pid:
            self.ready = self.ever_ready = True
            self.crashes = 0
            log.info("model worker %d is ready (%.1fs)", self.plan.index, now - self.started_at)
        if code is None:
            if self.link.state == "failed":
                raise StartupError(f"model worker {self.plan.index} could not load the model: {self.link.detail}")
            elif not self.ready and now - self.started_at > self.settings.model_loading_timeout:
                raise StartupError(
                    f"model worker {self.plan.index} did not become ready within "
                    f"{self.settings.model_loading_timeout:g}s (option.model_loading_timeout)")
            return
        _kill_group(self.process)
        if code == EXIT_LOAD_FAILED or not self.ever_ready:
            reason = self.link.detail if self.link.state == "failed" else "see the log above"
            raise StartupError(f"model worker {self.plan.index} could not load the model "
                               f"({_exit_text(code)}): {reason}")
        self.crashes += 1
        delay = 0.0 if self.crashes == 1 else min(MAX_RESTART_DELAY, 2.0 ** (self.crashes - 2))
        log.error("model worker %d (pid %d) died: %s; restarting it%s", self.plan.index, self.process.pid,
                  _exit_text(code), f" in {delay:g}s" if delay else "")
        self.ready = False
        self.restart_at = now + delay

    def stop(self) -> None:
        self.link.close()
        if self.process is not None:
            _terminate(self.process, STOP_TIMEOUT)


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.runtime = Path(tempfile.mkdtemp(prefix="sagelmi-"))
        self.listener: socket.socket | None = None
        self.frontend: subprocess.Popen | None = None
        self.frontend_started = 0.0
        self.workers: list[ModelWorker] = []
        self._stop_signal: int | None = None

    # -- signals
    def _on_signal(self, signum, _frame) -> None:
        if self._stop_signal is None:
            log.info("received %s: shutting down", signal.Signals(signum).name)
        self._stop_signal = signum

    # -- start-up steps
    def _bind(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", self.settings.port))
        except OSError as exc:
            sock.close()
            raise StartupError(f"cannot listen on port {self.settings.port}: {exc.strerror}") from None
        sock.listen(1024)
        sock.set_inheritable(True)
        self.listener = sock
        log.info("listening on port %d", self.settings.port)

    def _start_frontend(self, plans: list[GroupPlan]) -> None:
        spec = FrontendSpec(
            listen_fd=self.listener.fileno(),
            groups=[GroupSpec(index=p.index, socket_path=str(self.runtime / f"worker-{p.index}.sock"),
                              devices=p.cuda_visible_devices) for p in plans],
            job_queue_size=self.settings.job_queue_size, max_payload_bytes=self.settings.max_payload_bytes,
            predict_timeout=self.settings.predict_timeout, grace_period=self.settings.shutdown_grace_period,
            log_level=self.settings.log_level)
        path = self.runtime / "frontend.json"
        path.write_bytes(encode_frontend_spec(spec))
        self.frontend = subprocess.Popen(
            [sys.executable, "-m", "container.frontend.server", str(path)],
            pass_fds=[self.listener.fileno()], start_new_session=True)
        self.frontend_started = time.monotonic()

    def _install_requirements(self) -> None:
        requirements = Path(self.settings.model_dir) / "requirements.txt"
        if not requirements.is_file():
            return
        log.info("installing %s", requirements)
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-input", "-r", requirements.name],
                                cwd=requirements.parent, stdout=sys.stderr, stderr=sys.stderr)
        if result.returncode != 0:
            raise StartupError(f"installing requirements.txt failed (pip exit code {result.returncode}); "
                               f"see pip's output above")
        log.info("requirements installed (%.1fs)", time.monotonic() - started)

    def _fetch_model(self) -> str | None:
        model_id = self.settings.model_id
        if not (model_id and model_id.startswith("s3://")):
            return model_id
        try:
            return str(fetch_s3(model_id))
        except ArtifactError as exc:
            raise StartupError(str(exc)) from None

    # -- main loop
    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            if self.settings.use_mpi:
                raise StartupError("MPI mode (engine=MPI / option.mpi_mode=true) is not supported by this "
                                   "version of sagelmi; use engine=Python")
            devices = discover_devices(self.settings)
            plans = plan_groups(self.settings, devices)
            log.info("%d worker group(s): %s", len(plans),
                     ", ".join(f"{p.index}: {p.cuda_visible_devices or 'cpu'}" for p in plans))
            self._bind()
            self._start_frontend(plans)
            self._install_requirements()
            model_id = self._fetch_model()
            self.workers = [ModelWorker(plan, self.settings, self.runtime, model_id) for plan in plans]
            for worker in self.workers:
                if self._stop_signal is None:
                    worker.start()
            self._watch()
            return 0
        except (StartupError, SettingsError) as exc:
            log.error("start-up failed: %s", exc)
            return 1
        finally:
            self._shutdown()

    def _watch(self) -> None:
        while self._stop_signal is None:
            now = time.monotonic()
            for worker in self.workers:
                worker.check(now)
            if self.frontend.poll() is not None:
                reason = _exit_text(self.frontend.returncode)
                if now - self.frontend_started < FRONTEND_MIN_UPTIME:
                    raise StartupError(f"the HTTP frontend could not start ({reason}); see the log above")
                log.error("the HTTP frontend stopped (%s); restarting it", reason)
                self._start_frontend([w.plan for w in self.workers])
            time.sleep(POLL_INTERVAL)

    def _shutdown(self) -> None:
        if self.frontend is not None:
            # gunicorn drains (503 to new requests) for up to the grace period
            _terminate(self.frontend, self.settings.shutdown_grace_period + STOP_TIMEOUT)
        for worker in self.workers:
            worker.stop()
        if self.listener is not None:
            self.listener.close()
        shutil.rmtree(self.runtime, ignore_errors=True)
        log.info("stopped")


def serve(settings: Settings) -> int:
    return Supervisor(settings).run()
