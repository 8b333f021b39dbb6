"""A worker group as the supervisor sees it: started, watched, restarted as a whole (its
life: docs/architecture.md, "Worker groups and their state")."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

from container.core import proc
from container.core.devices import GroupPlan
from container.core.launch import EngineNodes, GroupNote, WorkerLaunch, encode_launch, write_note
from container.core.logs import redacted_command
from container.core.protocol import WorkerState
from container.core.ray_cluster import uses_ray
from container.core.settings import Settings
from container.frontend.group_client import GroupClient
from container.supervisor.cluster import Leader
from container.supervisor.processes import (
    CRASH_LOOP_DEATHS,
    CRASH_WINDOW,
    LAST_WORDS_WAIT,
    MAX_RESTART_DELAY,
    STOP_TIMEOUT,
    StartupError,
    _exit_text,
    _kill_family,
    _start,
    _terminate,
    engine_env,
    mpirun_command,
)

log = logging.getLogger("sagelmi.serve")


def group_file(runtime: Path, index: int, suffix: str) -> Path:
    """A worker group's file in the runtime directory: its socket (``.sock``), launch file, notes ..."""
    return runtime / f"group-{index}.{suffix}"


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
        cluster: Leader | None = None,
        omp_threads: int | None = None,
    ) -> None:
        self.plan = plan
        self.cluster = cluster  # a cluster's leader: the group spans its nodes
        self.cluster_losses = 0  # the leader's count of lost nodes when this start began
        self._waiting_for = ""  # the missing nodes this group last said it waits for
        self.environment = environment or {}  # what LMI options set (engine_environment)
        self.settings = settings
        self.mpirun = mpirun
        self.cpu_binding = cpu_binding
        self.omp_threads = omp_threads  # MPI ranks on the CPU: OMP_NUM_THREADS for each
        self.name = f"worker group {plan.index}"
        socket_path = str(group_file(runtime, plan.index, "sock"))
        self.launch_path = group_file(runtime, plan.index, "json")
        self.ready_path = group_file(runtime, plan.index, "ready")
        self.note_path = str(group_file(runtime, plan.index, "note"))
        self.launch_keys_path = group_file(runtime, plan.index, "launch")  # a cluster's, for rsh
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
                    nodes=self._engine_nodes(),
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

    def _engine_nodes(self) -> EngineNodes | None:
        """The built-in engine's place across a cluster (rank 0 here): vLLM's own executor, whose
        rendezvous this node holds; ``None`` on one machine, in MPI mode (mpirun spans the nodes) and
        on Ray (vLLM places its workers on the cluster's Ray)."""
        if self.cluster is None or self.mpirun is not None or uses_ray(self.settings):
            return None
        assert self.cluster.local_address, "the group starts once the worker nodes registered"
        config = self.cluster.config
        return EngineNodes(config.size, 0, self.cluster.local_address, config.engine_port)

    def _env(self) -> dict[str, str]:
        env = engine_env(self.environment, self.plan, self.cpu_binding)
        if self.cluster is not None and self.cluster.local_address:
            env["MASTER_ADDR"] = self.cluster.local_address  # rank 0's node, as the others reach it
            if self.mpirun is None:  # where the other nodes' vLLM workers reach this engine's message queue
                env.setdefault("VLLM_HOST_IP", self.cluster.local_address)
        if self.omp_threads is not None and "OMP_NUM_THREADS" not in env:
            # mpirun, unlike vLLM's own launcher, gives its CPU ranks no OMP_NUM_THREADS: without it
            # each rank's OpenMP starts at its default (every core the unbound rank may use), and the
            # ranks of a group oversubscribe the cores they share.
            env["OMP_NUM_THREADS"] = str(self.omp_threads)
        # vLLM's own cap on a completion's prompt list, the same as the server's on every route
        env.setdefault("VLLM_MAX_COMPLETION_PROMPTS", str(self.settings.max_prompts_per_request))
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
            *mpirun_command(self.mpirun, self.settings, self.plan, worker, env, self._hosts(), self.launch_keys_path),
        ]

    def _hosts(self) -> list[str] | None:
        if self.cluster is None:
            return None
        return self.cluster.hosts(self.plan.world_size // self.cluster.config.size)

    def start(self) -> None:
        self.incarnation += 1
        if self.cluster is not None:
            self.cluster_losses = self.cluster.losses
            self._waiting_for = ""
            nodes = self._engine_nodes()
            if nodes is not None:
                self.cluster.start_engines(self.incarnation, nodes)  # each worker node's part of vLLM
            else:
                self.cluster.write_launch_keys(self.launch_keys_path)  # one-use keys for this start
        env = self._env()
        command = self.command(env)
        # the model directory, as LMI runs handlers in it; none is needed when option.model_id names the model
        cwd = self.settings.model_dir if Path(self.settings.model_dir).is_dir() else None
        self.process = _start(command, env=env, cwd=cwd)
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
        if self.omp_threads is not None:
            details.append(f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
        log.info("started %s (%s)", self.name, ", ".join(details))
        log.debug("%s command: %s", self.name, " ".join(redacted_command(command)))

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
            if now >= self.restart_at and (self.cluster is None or self._cluster_complete()):
                self.start()
            return
        process = self.process
        assert process is not None, "check() before start()"  # the supervisor starts every group before watching
        code = process.poll()
        if self.cluster is not None and self.cluster.losses != self.cluster_losses:
            # A node went away: its ranks are gone, so the group cannot answer. End it now (its
            # in-flight requests fail at once) and start it again when every node is back.
            _kill_family(process)
            self._died(now, process.pid, f"cluster: {self.cluster.loss_reason()}")
            return
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

    def _cluster_complete(self) -> bool:
        assert self.cluster is not None
        if self.cluster.complete():
            return True
        reason = f"waiting for {self.cluster.describe_missing()} to register again"
        if self._waiting_for != reason:  # said once, not rewritten at every check
            self._waiting_for = reason
            log.warning("%s: %s", self.name, reason)
            write_note(self.note_path, GroupNote(last_exit=reason, crash_loop=self.crash_loop, restarts=self.crashes))
        return False

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
        if self.cluster is not None and self.mpirun is None:
            self.cluster.stop_engines()  # the other nodes' parts of this start: their peer is gone
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
        if self.cluster is not None and self.mpirun is None:
            self.cluster.stop_engines()
