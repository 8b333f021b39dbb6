"""A cluster's settings checked against the server's, before anything loads, and what each node
runs of a worker group (the cluster itself: ``container.supervisor.cluster``)."""

from __future__ import annotations

import os
from pathlib import Path

from container.core import proc
from container.core.cluster import SECRET_VARIABLES, ClusterConfig, ClusterError
from container.core.devices import GroupPlan
from container.core.handler_choice import uses_builtin_engine
from container.core.settings import Settings
from container.supervisor.processes import StartupError


def cluster_config(settings: Settings) -> ClusterConfig | None:
    """This node's cluster from the environment, checked against the settings (one line each,
    before any download); ``None`` on a single machine."""
    try:
        config = ClusterConfig.from_env()
    except ClusterError as exc:
        raise StartupError(str(exc)) from None
    if config is None:
        return None
    builtin = uses_builtin_engine(settings, Path(settings.model_dir))
    if not settings.mpi_mode_on and not builtin:
        raise StartupError(
            f"a cluster of {config.size} nodes runs the built-in vLLM engine across them, or each worker group as "
            f"one mpirun across them: serve without a model.py's handle (the built-in engine), or set "
            f"option.mpi_mode=true (your model.py)"
        )
    backend = settings.passthrough_options().get("distributed_executor_backend", "mp").strip()
    if builtin and backend not in ("mp", "ray"):
        raise StartupError(
            f"option.distributed_executor_backend={backend}: a cluster of {config.size} nodes runs the built-in "
            f"engine on vLLM's multiprocessing executor across them (mp) or on Ray (ray)"
        )
    world = settings.pipeline_parallel_degree * (
        settings.tensor_parallel_degree if isinstance(settings.tensor_parallel_degree, int) else 0
    )
    if world == 0 or world % config.size:
        raise StartupError(
            f"option.tensor_parallel_degree x option.pipeline_parallel_degree ({world or 'max'}) must be a number "
            f"divisible by the cluster's {config.size} nodes: each node runs the same share of the ranks"
        )
    return config


def withhold_secret(config: ClusterConfig | None) -> None:
    """Keep the cluster's secret in this process alone: out of the environment that every process
    it starts inherits (the frontend, ranks and handlers, Open MPI, pip), and, when it holds one,
    out of ``/proc/PID/environ`` for this node's other processes (``proc.keep_private``)."""
    for name in SECRET_VARIABLES:
        os.environ.pop(name, None)
    if config is not None:
        proc.keep_private()


def cluster_plan(settings: Settings, devices: list[str], config: ClusterConfig) -> list[GroupPlan]:
    """One worker group across the nodes: ``tp x pp / nodes`` ranks on each, this node's devices
    (each node uses its own visible devices, one per local rank)."""
    tp = settings.tensor_parallel_degree
    assert isinstance(tp, int), "cluster_config refuses tp=max"
    per_node = tp * settings.pipeline_parallel_degree // config.size
    if devices and per_node > len(devices):
        raise StartupError(
            f"each of the cluster's {config.size} nodes runs {per_node} ranks, but this one sees "
            f"{len(devices)} accelerators ({','.join(devices)})"
        )
    return [GroupPlan(0, tuple(devices[:per_node]), tp, settings.pipeline_parallel_degree)]


def cluster_share(plans: list[GroupPlan], config: ClusterConfig) -> list[GroupPlan]:
    """The part of each group on one node, for splitting its cores between local ranks."""
    return [GroupPlan(p.index, p.devices, p.world_size // config.size) for p in plans]
