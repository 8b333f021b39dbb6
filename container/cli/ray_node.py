"""``sagelmi ray-node``: this node's part of the cluster's Ray cluster, and nothing else.

    sagelmi ray-node [--model-dir DIR]

What ``sagelmi serve`` runs beside the engine with ``option.distributed_executor_backend=ray``
(``container.supervisor.ray_node``), without a model: the leader runs Ray's head, a worker node
joins it with the cluster's token, each until stopped (SIGTERM or SIGINT). For checking that the
nodes form a Ray cluster before deploying a model, and for running Ray work of your own on them.
The cluster comes from the environment as for ``serve`` (docs/cluster.md); ``option.ray_port``
from the settings.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from container.core import proc
from container.core.cluster import SECRET_VARIABLES, ClusterConfig, ClusterError
from container.core.ray_cluster import ray_node
from container.core.settings import DEFAULT_MODEL_DIR, Settings
from container.supervisor.processes import StartupError
from container.supervisor.ray_node import RayProcess

log = logging.getLogger("sagelmi.ray")


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "ray-node",
        help="run this node's part of the cluster's Ray cluster (the head on the leader, a joining node "
        "elsewhere) until stopped, as serve does with option.distributed_executor_backend=ray",
    )
    parser.add_argument("--model-dir", default=DEFAULT_MODEL_DIR, help="model directory whose settings to read")


def run(settings: Settings) -> int:
    """Run until SIGTERM or SIGINT; 2 (one line in the log) for a cluster setting that cannot work."""
    try:
        config = ClusterConfig.from_env()
    except ClusterError as exc:
        log.error("%s", exc)
        return 2
    if config is None:
        log.error("ray-node runs on a node of a cluster: set SAGELMI_CLUSTER_SIZE (2 or more) and the leader's address")
        return 2
    for name in SECRET_VARIABLES:  # Ray's processes get the token file, not the secret
        os.environ.pop(name, None)
    proc.adopt_orphans()  # what Ray leaves when its first process dies is stopped with it
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    runtime = Path(tempfile.mkdtemp(prefix="sagelmi-ray-"))
    node = ray_node(config.leader, settings.ray_port, config.is_leader(), config.node_address)
    try:
        ray = RayProcess(node, config.secret, runtime).start()
    except StartupError as exc:
        log.error("%s", exc)
        shutil.rmtree(runtime, ignore_errors=True)
        return 2
    try:
        stopped.wait()
    finally:
        ray.stop()
        shutil.rmtree(runtime, ignore_errors=True)
    log.info("stopped")
    return 0
