"""``python -m handlers.engines.vllm_node <launch.json>``: a worker node's part of the built-in
engine across a cluster, vLLM's headless node (what ``vllm serve --headless --node-rank k``
runs): this node's engine workers, joined to the leader's engine over torch.distributed at
``master_addr:master_port``. No frontend, no scheduler: the leader's engine drives it.

Its worker node's supervisor starts it when the leader starts its group
(``container/supervisor/engine_nodes.py``), kills it when the leader's group ends, and tells the
leader when it ends on its own (then the leader restarts the group, every node's part anew). It
exits when one of its engine workers dies.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from container.core import logs, proc
from container.core.launch import HeadlessLaunch, decode_headless_launch

log = logging.getLogger("sagelmi.vllm_node")


def engine_config(launch: HeadlessLaunch):
    """vLLM's configuration of this node's part, from the same settings as the leader's engine."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    from handlers.engines import vllm_platform
    from handlers.engines.vllm_args import build_engine_kwargs, node_kwargs, usage_context

    vllm_platform.check()  # this node's ranks run on sagelmi's CPU platform too
    kwargs = build_engine_kwargs(
        launch.settings, launch.model_location, launch.tensor_parallel_degree, cpu=current_platform.is_cpu()
    )
    kwargs.update(node_kwargs(launch.nodes))
    return AsyncEngineArgs(**kwargs).create_engine_config(usage_context=usage_context(), headless=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a worker node's part of vLLM across a cluster (sagelmi serve)")
    parser.add_argument("launch", help="the headless node's launch file (JSON)")
    args = parser.parse_args(argv)
    proc.die_with_parent()
    proc.adopt_orphans()  # vLLM's engine workers stay below this process when it is killed
    launch = decode_headless_launch(Path(args.launch).read_bytes())
    logs.configure(f"vllm-node-{launch.nodes.node_rank}", launch.settings.log_level, launch.settings.log_format)
    nodes = launch.nodes
    log.info(
        "vLLM's node %d of %d: joining the leader's engine at %s:%d",
        nodes.node_rank,
        nodes.nnodes,
        nodes.master_addr,
        nodes.master_port,
    )

    def stop(signum, _frame) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from handlers.api.loader import HandlerLoadError

    try:
        config = engine_config(launch)
    except HandlerLoadError as exc:
        log.error("vLLM's node %d cannot start: %s", nodes.node_rank, exc)
        return 1
    executor = MultiprocExecutor(config, monitor_workers=False)
    try:
        log.info("vLLM's node %d is ready", nodes.node_rank)
        executor.start_worker_monitor(inline=True)  # returns when one of this node's engine workers died
        log.error("vLLM's node %d: an engine worker died (see above)", nodes.node_rank)
        return 1
    finally:
        executor.shutdown()


if __name__ == "__main__":
    sys.exit(main())
