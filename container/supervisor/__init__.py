"""``sagelmi serve``: the process that owns everything else.

Order of start-up: bind the HTTP port (so ``/ping`` answers 503 while the model
loads), start the frontend, install ``requirements.txt``, fetch an ``s3://``
model, start each worker group (a process in Python mode, an ``mpirun`` job in
MPI mode). Then watch: a group that dies after it was ready is restarted whole
(its in-flight requests already failed in the frontend); a group that cannot
load the model, or takes longer than ``model_loading_timeout``, stops the
server with the reason in the log.

On SIGTERM (or SIGINT): the frontend drains (503 for new requests, in-flight
ones finish within ``shutdown_grace_period``), then the groups stop, and the
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

from container.core import proc
from container.core.artifacts import ArtifactError, fetch_model
from container.core.devices import GroupPlan, cpu_binding, discover_devices, plan_groups
from container.core.engine_args import EngineOptionError, engine_environment
from container.core.handler_choice import uses_builtin_engine
from container.core.launch import (
    FrontendLaunch,
    GroupAddress,
    GroupNote,
    ModelInfo,
    WorkerLaunch,
    encode_launch,
    write_note,
)
from container.core.plan import Plan
from container.core.protocol import WorkerState
from container.core.served_names import served_names
from container.core.settings import Settings, SettingsError
from container.frontend.group_client import GroupClient
from container.supervisor.plan_check import compare_kv, startup_plan
from container.supervisor.processes import (
    CRASH_LOOP_DEATHS,
    CRASH_WINDOW,
    FRONTEND_MIN_UPTIME,
    LAST_WORDS_WAIT,
    MAX_RESTART_DELAY,
    POLL_INTERVAL,
    STOP_TIMEOUT,
    StartupError,
    _exit_text,
    _kill_family,
    _start,
    _terminate,
    find_mpirun,
    mpirun_command,
)

# find_mpirun and mpirun_command are looked up here when called: tests replace them on this module
__all__ = ["StartupError", "Supervisor", "WorkerGroup", "find_mpirun", "model_info", "mpirun_command", "serve"]

log = logging.getLogger("sagelmi.serve")


def model_info(settings: Settings) -> ModelInfo:
    """The served model for the frontend's management routes: its name (LMI's model
    name, ``served_names``' ``management``), LoRA settings, where start-up adapters are
    and where adapter sources may be."""
    options = settings.passthrough_options()
    location = settings.model_id or settings.model_dir
    dirs = [settings.model_dir] + ([location] if location != settings.model_dir and Path(location).is_dir() else [])
    roots = dirs + [r.strip() for r in settings.adapter_roots.split(",") if r.strip()]
    builtin_schemas = (
        uses_builtin_engine(settings, Path(settings.model_dir))
        and not (Path(settings.model_dir) / "model.py").is_file()
    )
    return ModelInfo(
        name=served_names(settings).management,
        location=location,
        lora=options.get("enable_lora", "").lower() == "true",
        max_lora_rank=int(options.get("max_lora_rank") or 16),
        adapter_dirs=dirs,
        adapter_roots=roots,
        builtin_schemas=builtin_schemas,
    )


class WorkerGroup:
    """One worker group: a process (Python mode) or an ``mpirun`` job of
    ``tp x pp`` ranks (MPI mode), watched and restarted as a whole.

    The supervisor learns the group's state from rank 0 over the wire protocol
    (a ``GroupClient``) and its readiness from the file rank 0 writes; either
    counts only when it comes from the current start of the group (its
    ``incarnation``)."""

    def __init__(
        self,
        plan: GroupPlan,
        settings: Settings,
        runtime: Path,
        model_location: str,
        mpirun: str | None,
        cpu_binding: str | None,
        environment: dict[str, str] | None = None,
    ) -> None:
        self.plan = plan
        self.environment = environment or {}  # what LMI options set (engine_environment)
        self.settings = settings
        self.mpirun = mpirun
        self.cpu_binding = cpu_binding
        self.name = f"worker group {plan.index}"
        socket_path = str(runtime / f"group-{plan.index}.sock")
        self.launch_path = runtime / f"group-{plan.index}.json"
        self.ready_path = runtime / f"group-{plan.index}.ready"
        self.note_path = str(runtime / f"group-{plan.index}.note")
        self.launch_path.write_bytes(
            encode_launch(
                WorkerLaunch(
                    group=plan.index,
                    socket_path=socket_path,
                    ready_path=str(self.ready_path),
                    settings=settings,
                    model_properties=settings.model_properties(
                        model_id=model_location if model_location != settings.model_dir else None,
                        tensor_parallel_degree=plan.tensor_parallel_degree
                        if settings.tensor_parallel_degree == "max"
                        else None,
                    ),
                    model_location=model_location,
                    tensor_parallel_degree=plan.tensor_parallel_degree,
                )
            )
        )
        self.process: subprocess.Popen | None = None
        self.client = GroupClient(str(plan.index), socket_path).start()
        self.incarnation = 0
        self.started_at = 0.0
        self.ready = False  # this incarnation reported ready
        self.ever_ready = False
        self.crashes = 0  # deaths in a row, each within CRASH_WINDOW of its start
        self.crash_loop = False
        self.ready_at: float | None = None  # when this start became ready
        self.restart_at: float | None = None

    def _env(self) -> dict[str, str]:
        env = {**os.environ, **self.environment}
        if self.plan.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.plan.cuda_visible_devices
        if self.cpu_binding is not None and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_binding
        return env

    def command(self, env: dict[str, str]) -> list[str]:
        worker = [
            sys.executable,
            "-m",
            "container.worker",
            "--launch",
            str(self.launch_path),
            "--incarnation",
            str(self.incarnation),
        ]
        if self.mpirun is None:
            return worker  # the worker ties itself to this process (proc.die_with_parent)
        return [
            sys.executable,
            "-m",
            "container.core.proc",  # mpirun, tied to this process
            *mpirun_command(self.mpirun, self.settings, self.plan, worker, env),
        ]

    def start(self) -> None:
        self.incarnation += 1
        env = self._env()
        command = self.command(env)
        self.process = _start(command, env=env, cwd=self.settings.model_dir)
        self.started_at = time.monotonic()
        self.ready = False
        self.ready_at = None
        self.restart_at = None
        details = [f"pid {self.process.pid}"]
        if self.mpirun is not None:
            details.append(f"{self.plan.world_size} MPI ranks")
        if self.plan.devices:
            details.append(f"CUDA_VISIBLE_DEVICES={self.plan.cuda_visible_devices}")
        if env.get("VLLM_CPU_OMP_THREADS_BIND") and self.plan.world_size > 1 and not self.plan.devices:
            details.append(f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}")
        log.info("started %s (%s)", self.name, ", ".join(details))
        log.debug("%s command: %s", self.name, " ".join(command))

    def _ready_incarnation(self) -> int:
        """The last start of this group that became ready: rank 0 writes it to a
        file, which outlives the process (a status message may not reach us
        before a group that dies right after becoming ready is gone)."""
        try:
            return int(self.ready_path.read_text())
        except (OSError, ValueError):
            return 0

    def _reports(self, state: WorkerState) -> bool:
        return self.client.state is state and self.client.incarnation == self.incarnation

    def check(self, now: float) -> None:
        """Advance this group's life: notice readiness, deaths, timeouts.

        Raises ``StartupError`` when the model cannot be served."""
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.start()
            return
        process = self.process
        assert process is not None, "check() before start()"  # the supervisor starts every group before watching
        code = process.poll()
        if not self.ready and self._ready_incarnation() == self.incarnation:  # even if it died since
            self.ready = self.ever_ready = True
            self.ready_at = now
            log.info("%s is ready (%.1fs)", self.name, now - self.started_at)
        if self.ready_at is not None and self.crashes and now - self.ready_at >= CRASH_WINDOW:
            if self.crash_loop:
                log.info("%s has stayed up for %gs: it is no longer crash-looping", self.name, CRASH_WINDOW)
            self.crashes, self.crash_loop = 0, False
            write_note(self.note_path, GroupNote())
        reason = ""
        if code is None and self._reports(WorkerState.FAILED):
            if not self.ever_ready:
                raise StartupError(f"{self.name} could not load the model: {self.client.detail}")
            # It served before: whatever broke the reload may pass. Retry, with back-off.
            reason = f"the model could not be loaded again: {self.client.detail}"
            _terminate(process, STOP_TIMEOUT)
            code = process.returncode
        if code is None:
            if not self.ready and now - self.started_at > self.settings.model_loading_timeout:
                raise StartupError(
                    f"{self.name} did not become ready within "
                    f"{self.settings.model_loading_timeout:g}s (option.model_loading_timeout)"
                )
            return
        _kill_family(process)
        if not self.ever_ready:
            reason = self.client.detail if self._reports(WorkerState.FAILED) else "see the log above"
            raise StartupError(f"{self.name} could not load the model ({_exit_text(code)}): {reason}")
        self._died(now, process.pid, reason or self._exit_reason(code))

    def _exit_reason(self, code: int) -> str:
        """Why the group's process ended: what its worker said before leaving, or else its exit
        status, which is then the handler's (or a library's) doing."""
        deadline = time.monotonic() + LAST_WORDS_WAIT
        while self.client.connected and time.monotonic() < deadline:  # its last Status may be unread
            time.sleep(0.01)
        if self.client.incarnation == self.incarnation and self.client.last_words:
            return f"{self.client.last_words} ({_exit_text(code)})"
        if code < 0:
            return f"its process was {_exit_text(code)} (from outside: the kernel's OOM killer, or a person)"
        return (
            f"its process exited with code {code} without a reason from sagelmi's worker: "
            f"the handler, or a library it called, ended it"
        )

    def _died(self, now: float, pid: int, reason: str) -> None:
        """Schedule the restart: at once after a death that follows a long run, with growing
        delays while the group keeps dying soon after its starts (then it is crash-looping)."""
        soon = self.ready_at is None or now - self.ready_at < CRASH_WINDOW
        self.crashes = self.crashes + 1 if soon else 1
        delay = 0.0 if self.crashes == 1 else min(MAX_RESTART_DELAY, 2.0 ** (self.crashes - 2))
        if self.crashes >= CRASH_LOOP_DEATHS and not self.crash_loop:
            self.crash_loop = True
            log.error(
                "%s is crash-looping: it died %d times in a row within %gs of starting; the last time: %s. "
                "It is restarted with growing delays (up to %gs); /ping answers 503 until a start stays up %gs",
                self.name,
                self.crashes,
                CRASH_WINDOW,
                reason,
                MAX_RESTART_DELAY,
                CRASH_WINDOW,
            )
        log.error("%s (pid %d) died: %s; restarting it%s", self.name, pid, reason, f" in {delay:g}s" if delay else "")
        write_note(self.note_path, GroupNote(last_exit=reason, crash_loop=self.crash_loop, restarts=self.crashes))
        self.ready = False
        self.restart_at = now + delay

    def stop(self) -> None:
        self.client.close()
        if self.process is None:
            return
        # mpirun would pass SIGTERM on but kill the ranks a quarter second later: ask the
        # ranks themselves, so that each stops its engine, and mpirun ends when they have.
        ranks = None
        if self.mpirun is not None:
            ranks = proc.descendants([self.process.pid])
        _terminate(self.process, STOP_TIMEOUT, graceful=ranks)


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.runtime = Path(tempfile.mkdtemp(prefix="sagelmi-"))
        self.listener: socket.socket | None = None
        self.frontend: subprocess.Popen | None = None
        self.frontend_started = 0.0
        self.groups: list[WorkerGroup] = []
        self._stop_signal: int | None = None
        # container.supervisor.plan_check's start-up plan, compared with the engine's KV cache once ready
        self.plan: Plan | None = None

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
        listener = self.listener
        assert listener is not None, "the frontend starts after _bind()"
        launch = FrontendLaunch(
            listen_fd=listener.fileno(),
            groups=[
                GroupAddress(
                    index=p.index,
                    socket_path=str(self.runtime / f"group-{p.index}.sock"),
                    devices=p.cuda_visible_devices,
                    note_path=str(self.runtime / f"group-{p.index}.note"),
                )
                for p in plans
            ],
            job_queue_size=self.settings.job_queue_size,
            max_payload_bytes=self.settings.max_payload_bytes,
            predict_timeout=self.settings.predict_timeout,
            grace_period=self.settings.shutdown_grace_period,
            log_level=self.settings.log_level,
            log_format=self.settings.log_format,
            traces_exporter=self.settings.traces_exporter,
            stateful_sessions=self.settings.enable_stateful_sessions,
            sessions_expiration=self.settings.sessions_expiration,
            model=model_info(self.settings),
            body_read_timeout=self.settings.body_read_timeout,
        )
        path = self.runtime / "frontend.json"
        path.write_bytes(encode_launch(launch))
        self.frontend = _start(
            [sys.executable, "-m", "container.frontend.server", str(path)], pass_fds=[listener.fileno()]
        )
        self.frontend_started = time.monotonic()

    def _install_requirements(self) -> None:
        # LMI's requirements.txt, or the SageMaker inference toolkit's code/requirements.txt
        for requirements in (
            Path(self.settings.model_dir) / "requirements.txt",
            Path(self.settings.model_dir) / "code" / "requirements.txt",
        ):
            if requirements.is_file():
                self._install(requirements)

    def _install(self, requirements: Path) -> None:
        log.info("installing %s", requirements)
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-input", "-r", requirements.name],
            cwd=requirements.parent,
            stdout=sys.stderr,
            stderr=sys.stderr,
        )
        if result.returncode != 0:
            raise StartupError(
                f"installing {requirements.parent.name}/{requirements.name} failed "
                f"(pip exit code {result.returncode}); see pip's output above"
            )
        log.info("requirements installed (%.1fs)", time.monotonic() - started)

    def _fetch_model(self) -> str:
        """Where the model is: the model directory, or what ``option.model_id`` names,
        downloaded first when it is an ``s3://`` prefix or a Hub id."""
        if not self.settings.model_id:
            return self.settings.model_dir
        try:
            return fetch_model(self.settings.model_id, self.settings.revision)
        except ArtifactError as exc:
            raise StartupError(str(exc)) from None

    # -- main loop
    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        proc.adopt_orphans()  # what a group leaves when its first process dies comes here: _kill_family
        try:
            mpirun = find_mpirun() if self.settings.use_mpi else None
            devices = discover_devices(self.settings)
            plans = plan_groups(self.settings, devices)
            log.info(
                "%d worker group(s) in %s mode, %d rank(s) each: %s",
                len(plans),
                "MPI" if mpirun else "Python",
                plans[0].world_size if mpirun else 1,
                ", ".join(f"{p.index}: {p.cuda_visible_devices or 'cpu'}" for p in plans),
            )
            binding = cpu_binding(plans) if not devices else {}
            try:
                environment = engine_environment(self.settings)
            except EngineOptionError as exc:
                raise StartupError(str(exc)) from None
            self._bind()
            self._start_frontend(plans)
            self._install_requirements()
            model_location = self._fetch_model()
            first = plans[0]
            self.plan = startup_plan(
                self.settings,
                model_location,
                list(first.devices),
                first.tensor_parallel_degree,
                first.pipeline_parallel_degree,
            )
            self.groups = [
                WorkerGroup(
                    plan,
                    self.settings,
                    self.runtime,
                    model_location,
                    mpirun,
                    binding.get(plan.index) if plan.world_size > 1 else None,
                    environment,
                )
                for plan in plans
            ]
            for group in self.groups:
                if self._stop_signal is None:
                    group.start()
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
            for group in self.groups:
                group.check(now)
            if self.plan is not None and self.groups and self.groups[0].ready:
                compare_kv(self.plan, self.groups[0].client)
                self.plan = None  # once
            frontend = self.frontend
            assert frontend is not None, "watching before _start_frontend()"  # run() starts it first
            if frontend.poll() is not None:
                reason = _exit_text(frontend.returncode)
                if now - self.frontend_started < FRONTEND_MIN_UPTIME:
                    raise StartupError(f"the HTTP frontend could not start ({reason}); see the log above")
                log.error("the HTTP frontend stopped (%s); restarting it", reason)
                _kill_family(frontend)  # a gunicorn worker left behind would still take connections
                self._start_frontend([group.plan for group in self.groups])
            time.sleep(POLL_INTERVAL)

    def _shutdown(self) -> None:
        if self.frontend is not None:
            # gunicorn drains (503 to new requests) for up to the grace period
            _terminate(self.frontend, self.settings.shutdown_grace_period + STOP_TIMEOUT)
        for group in self.groups:
            group.stop()
        if self.listener is not None:
            self.listener.close()
        shutil.rmtree(self.runtime, ignore_errors=True)
        log.info("stopped")


def serve(settings: Settings) -> int:
    return Supervisor(settings).run()
