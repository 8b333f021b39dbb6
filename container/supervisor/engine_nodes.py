"""The built-in vLLM engine across a cluster's nodes, on vLLM's own multiprocessing executor
(``nnodes``, ``node_rank``, ``master_addr``, ``master_port``; docs/cluster.md).

The leader's worker group is a Python-mode worker whose engine is vLLM's node 0 (its
``WorkerLaunch.nodes``); each worker node runs vLLM's headless node
(``python -m handlers.engines.vllm_node``) for it: ``HeadlessNode`` here. Which start of the group a
node's part belongs to travels on the cluster's registration channel (``engine-start`` with the
group's incarnation, ``engine-stop``); vLLM's own torch.distributed rendezvous on the leader's
``ClusterConfig.engine_port`` and its message queues carry the model's traffic.

A worker node's part lives exactly as long as one start of the leader's group: started on
``engine-start`` (a part still running from an older start is killed first), killed on
``engine-stop`` or when the registration ends; when it ends by itself the node sends
``engine-exit`` and the leader restarts the whole group (``Leader.engine_exit``).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from container.core.cluster import ClusterConfig
from container.core.devices import GroupPlan
from container.core.launch import EngineNodes, HeadlessLaunch, encode_launch
from container.core.settings import Settings
from container.supervisor.processes import StartupError, _exit_text, _kill_family, _start, engine_env

log = logging.getLogger("sagelmi.cluster")


def check_engine_port(config: ClusterConfig) -> None:
    """On the leader, before anything loads: the engine's rendezvous port must be free (vLLM's
    own error for a taken port comes only once the model loads, deep in a traceback)."""
    host = config.node_address or "0.0.0.0"
    try:
        with socket.create_server((host, config.engine_port)):
            pass
    except OSError as exc:
        raise StartupError(
            f"cluster: the built-in engine's rendezvous port {config.engine_port} (SAGELMI_CLUSTER_PORT + 1) "
            f"cannot be bound on {host}: {exc.strerror}; set another SAGELMI_CLUSTER_PORT on every node"
        ) from None


def start_message(incarnation: int, nodes: EngineNodes, address: str) -> dict:
    """What the leader sends a worker node to start its part of one start of the group:
    ``nodes`` with the node's own rank, ``address`` the node's address as the leader sees it
    (where vLLM on the node listens for the leader, ``VLLM_HOST_IP``)."""
    return {
        "type": "engine-start",
        "incarnation": incarnation,
        "nnodes": nodes.nnodes,
        "node_rank": nodes.node_rank,
        "master_addr": nodes.master_addr,
        "master_port": nodes.master_port,
        "address": address,
    }


def _parse_start(message: dict) -> tuple[int, EngineNodes, str]:
    """``start_message``'s fields, checked (``ValueError`` naming the first wrong one)."""
    numbers = ("incarnation", "nnodes", "node_rank", "master_port")
    for name in numbers:
        if not isinstance(message.get(name), int) or isinstance(message.get(name), bool) or message[name] < 0:
            raise ValueError(f"engine-start: {name} is not a number")
    for name in ("master_addr", "address"):
        value = message.get(name)
        if not isinstance(value, str) or not value or len(value) > 255 or any(c.isspace() for c in value):
            raise ValueError(f"engine-start: {name} is not an address")
    nodes = EngineNodes(message["nnodes"], message["node_rank"], message["master_addr"], message["master_port"])
    return message["incarnation"], nodes, message["address"]


class HeadlessNode:
    """This worker node's part of the built-in engine (see the module's text)."""

    def __init__(
        self,
        settings: Settings,
        runtime: Path,
        model_location: str,
        plan: GroupPlan,
        environment: dict[str, str],
        cpu_binding: str | None,
    ) -> None:
        self.settings = settings
        self.model_location = model_location
        self.plan = plan
        self.environment = environment  # what LMI options set (engine_environment), as on the leader
        self.cpu_binding = cpu_binding
        self.launch_path = runtime / "vllm-node.json"
        self.process: subprocess.Popen | None = None
        self.incarnation = 0
        self._lock = threading.Lock()

    def handle(self, message: dict, report: Callable[[dict], None]) -> None:
        """A message from the leader: ``engine-start`` or ``engine-stop`` (others are not ours).
        ``report`` sends a message back on the same registration."""
        kind = message.get("type")
        if kind == "engine-stop":
            self.stop()
        elif kind == "engine-start":
            try:
                incarnation, nodes, address = _parse_start(message)
            except ValueError as exc:
                log.error("cluster: ignored a start of the engine from the leader: %s", exc)
                return
            self.start(incarnation, nodes, address, report)

    def _env(self, address: str) -> dict[str, str]:
        env = engine_env(self.environment, self.plan, self.cpu_binding)
        env.setdefault("VLLM_HOST_IP", address)  # where the leader's engine reaches this node's workers
        return env

    def start(self, incarnation: int, nodes: EngineNodes, address: str, report: Callable[[dict], None]) -> None:
        self.stop()  # a part of an older start of the group, if any: its peers are gone
        launch = HeadlessLaunch(self.settings, self.model_location, self.plan.tensor_parallel_degree, nodes)
        self.launch_path.write_bytes(encode_launch(launch))
        env = self._env(address)
        # the model directory, as the leader's worker runs in it
        cwd = self.settings.model_dir if Path(self.settings.model_dir).is_dir() else None
        command = [sys.executable, "-m", "handlers.engines.vllm_node", str(self.launch_path)]
        with self._lock:
            self.process = process = _start(command, env=env, cwd=cwd)
            self.incarnation = incarnation
        log.info(
            "cluster: started vLLM's node %d of %d for the leader's group (start %d, pid %d%s)",
            nodes.node_rank,
            nodes.nnodes,
            incarnation,
            process.pid,
            f", VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}"
            if "VLLM_CPU_OMP_THREADS_BIND" in env
            else "",
        )
        threading.Thread(
            target=self._watch, args=(process, incarnation, report), name="vllm-node-watch", daemon=True
        ).start()

    def _watch(self, process: subprocess.Popen, incarnation: int, report: Callable[[dict], None]) -> None:
        code = process.wait()
        with self._lock:
            if self.process is not process:
                return  # stopped on purpose (or replaced): nobody needs to hear of it
            self.process = None
        reason = f"vLLM's node ended ({_exit_text(code)})"
        log.error("cluster: %s; telling the leader, which restarts its group", reason)
        try:  # first: the leader's engine may be waiting on this node's workers
            report({"type": "engine-exit", "incarnation": incarnation, "reason": reason})
        except OSError as exc:  # the registration is gone: the leader learns of the loss from that
            log.debug("cluster: could not tell the leader: %s", exc)
        _kill_family(process)  # its engine workers, adopted here

    def stop(self) -> None:
        """Kill this node's part and everything below it, if it runs."""
        with self._lock:
            process, self.process = self.process, None
        if process is not None:
            log.info("cluster: stopping vLLM's node (start %d of the leader's group)", self.incarnation)
            _kill_family(process)
