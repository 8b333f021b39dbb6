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
from container.core.devices import GroupPlan, cpu_binding, cpu_threads, discover_devices, plan_groups
from container.core.engine_args import EngineOptionError, engine_environment
from container.core.handler_choice import mpirun_groups, uses_builtin_engine
from container.core.launch import (
    FrontendLaunch,
    GroupAddress,
    ModelInfo,
    encode_launch,
)
from container.core.plan import Plan
from container.core.protocol import fd_channel_path
from container.core.served_names import served_names
from container.core.settings import Settings, SettingsError
from container.supervisor.cluster import Leader, serve_worker_node
from container.supervisor.cluster_setup import (
    cluster_config,
    cluster_plan,
    cluster_share,
    withhold_secret,
)
from container.supervisor.engine_nodes import HeadlessNode, check_engine_port
from container.supervisor.groups import WorkerGroup, group_file
from container.supervisor.plan_check import compare_kv, startup_plan
from container.supervisor.processes import (
    FRONTEND_MIN_UPTIME,
    POLL_INTERVAL,
    STOP_TIMEOUT,
    StartupError,
    _exit_text,
    _kill_family,
    _start,
    _terminate,
    find_mpirun,
    install_requirements,
    mpirun_command,
)
from container.supervisor.ray_node import RayProcess, ray_process

__all__ = ["StartupError", "Supervisor", "WorkerGroup", "find_mpirun", "model_info", "mpirun_command", "serve"]

log = logging.getLogger("sagelmi.serve")


def model_info(settings: Settings, adapter_downloads: str = "") -> ModelInfo:
    """The served model for the frontend's management routes: its name (LMI's model
    name, ``served_names``' ``management``), LoRA settings, where start-up adapters are,
    where adapter sources may be and where ``s3://`` adapters are downloaded to."""
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
        adapter_downloads=adapter_downloads,
        max_adapter_bytes=settings.max_adapter_bytes,
        builtin_schemas=builtin_schemas,
    )


# The longest Unix socket path the runtime directory holds, after the temporary directory (mkdtemp's
# name, then a group's descriptor channel): a socket's path has at most 107 bytes (sun_path), so a
# TMPDIR that leaves too little room moves the runtime directory to /tmp.
_SOCKET_ROOM = len(fd_channel_path(str(group_file(Path("/sagelmi-XXXXXXXX"), 9999, "sock"))))
_SUN_PATH = 107


def runtime_directory() -> Path:
    """A new directory for this server's sockets and notes, in the temporary directory when the
    worker groups' sockets fit under it, else in /tmp."""
    base = tempfile.gettempdir()
    if len(os.fsencode(base)) + _SOCKET_ROOM > _SUN_PATH:
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix="sagelmi-", dir=base))


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.runtime = runtime_directory()
        self.listener: socket.socket | None = None
        self.frontend: subprocess.Popen | None = None
        self.frontend_started = 0.0
        self.groups: list[WorkerGroup] = []
        self._stop_signal: int | None = None
        # container.supervisor.plan_check's start-up plan, compared with the engine's KV cache once ready
        self.plan: Plan | None = None
        self.cluster: Leader | None = None
        self.ray: RayProcess | None = None  # this node's Ray, with option.distributed_executor_backend=ray

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
                    socket_path=str(group_file(self.runtime, p.index, "sock")),
                    devices=p.cuda_visible_devices,
                    note_path=str(group_file(self.runtime, p.index, "note")),
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
            model=model_info(self.settings, str(self.runtime / "adapters")),  # removed with the runtime directory
            body_read_timeout=self.settings.body_read_timeout,
            header_read_timeout=self.settings.header_read_timeout,
            max_connections_per_client=self.settings.connections_per_client,
        )
        path = self.runtime / "frontend.json"
        path.write_bytes(encode_launch(launch))
        self.frontend = _start(
            [sys.executable, "-m", "container.frontend.server", str(path)], pass_fds=[listener.fileno()]
        )
        self.frontend_started = time.monotonic()

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
            cluster = cluster_config(self.settings)
            self.ray = ray_process(self.settings, cluster, self.runtime)
            withhold_secret(cluster)
            mpirun = find_mpirun() if mpirun_groups(self.settings) else None
            if cluster is not None and not cluster.is_leader():
                return self._serve_as_worker_node(cluster)
            devices = discover_devices(self.settings)
            plans = cluster_plan(self.settings, devices, cluster) if cluster else plan_groups(self.settings, devices)
            log.info(
                "%d worker group(s) in %s mode, %d rank(s) each: %s",
                len(plans),
                "MPI" if mpirun else "Python",
                plans[0].world_size if mpirun else 1,
                ", ".join(f"{p.index}: {p.cuda_visible_devices or 'cpu'}" for p in plans),
            )
            local_plans = cluster_share(plans, cluster) if cluster else plans
            binding = cpu_binding(local_plans) if not devices else {}
            # MPI ranks on the CPU: each rank's OpenMP threads (WorkerGroup._env says why)
            rank_threads = cpu_threads(local_plans) if mpirun and not devices else None
            try:
                environment = engine_environment(self.settings)
            except EngineOptionError as exc:
                raise StartupError(str(exc)) from None
            if self.ray is not None:  # the leader's engine is a driver of the cluster's Ray
                environment = {**environment, **self.ray.driver_environment()}
            elif cluster is not None and mpirun is None:
                check_engine_port(cluster)
            self._bind()
            if cluster is not None:
                self.cluster = Leader(cluster).start()  # workers register while the model downloads
            if self.ray is not None:
                self.ray.start()  # Ray's head: worker nodes join it while the model downloads
            self._start_frontend(plans)
            model_location = self._prepare_model()
            if self.cluster is not None:
                self.cluster.wait(self.cluster.config.join_timeout, lambda: self._stop_signal is not None)
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
                    self.cluster,
                    omp_threads=rank_threads,
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

    def _serve_as_worker_node(self, cluster) -> int:
        engine = None
        # the built-in engine: vLLM's headless node for the leader
        if not mpirun_groups(self.settings) and self.ray is None:
            devices = discover_devices(self.settings)
            (plan,) = cluster_plan(self.settings, devices, cluster)
            binding = cpu_binding(cluster_share([plan], cluster)) if not devices else {}
            try:
                environment = engine_environment(self.settings)
            except EngineOptionError as exc:
                raise StartupError(str(exc)) from None

            def engine(location: str) -> HeadlessNode:
                return HeadlessNode(self.settings, self.runtime, location, plan, environment, binding.get(plan.index))

        self._bind()
        assert self.listener is not None
        if self.ray is not None:
            self.ray.start()  # joins the leader's Ray head, and again whenever it comes back
        stopping = lambda: self._stop_signal is not None  # noqa: E731
        return serve_worker_node(cluster, self.listener, self._prepare_model, stopping, engine)

    def _prepare_model(self) -> str:
        install_requirements(Path(self.settings.model_dir))
        return self._fetch_model()

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
        if self.ray is not None:
            self.ray.stop()
        if self.cluster is not None:
            self.cluster.close()
        if self.listener is not None:
            self.listener.close()
        shutil.rmtree(self.runtime, ignore_errors=True)
        log.info("stopped")


def serve(settings: Settings) -> int:
    return Supervisor(settings).run()
