"""``python -m container.worker --launch <group-N.json> --incarnation K``: one
rank of a worker group (started by the supervisor, under ``mpirun`` in MPI mode)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import uvloop

from container.core import logs, proc
from container.core.launch import decode_worker_launch
from container.worker.runtime import Worker
from handlers.api.context import WorkerContext


def _context(args: argparse.Namespace) -> WorkerContext:
    if not args.mpi:
        launch = decode_worker_launch(Path(args.launch).read_bytes())
        return WorkerContext(launch, launch.settings)
    from container.worker.ranks import Follower, Leader, bootstrap

    info, data, listener = bootstrap(Path(args.launch))
    info.export()
    launch = decode_worker_launch(data)
    if info.rank == 0:
        assert listener is not None  # rank 0 opens the relay's listener
        return WorkerContext(launch, launch.settings, 0, info.world_size, leader=Leader(info, listener))
    return WorkerContext(launch, launch.settings, info.rank, info.world_size, follower=Follower(info))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="sagelmi model worker (started by `sagelmi serve`)")
    parser.add_argument("--launch", required=True, help="the worker group's launch file (JSON)")
    parser.add_argument("--incarnation", type=int, default=0, help="which start of the group this is")
    parser.add_argument("--mpi", action="store_true", help="one rank of an MPI worker group (under mpirun)")
    args = parser.parse_args(argv)
    proc.die_with_parent()
    if not args.mpi:
        proc.adopt_orphans()  # the group's first process (in MPI mode, mpirun is)
    context = _context(args)
    name = f"worker-{context.launch.group}" + (f".rank-{context.rank}" if args.mpi else "")
    logs.configure(name, context.settings.log_level, context.settings.log_format)
    # uvloop, as vLLM's own server: a pass of its loop costs a fraction of asyncio's, and a
    # streamed token takes one
    return uvloop.run(_run(context, args.incarnation))


async def _run(context: WorkerContext, incarnation: int) -> int:
    return await Worker(context, incarnation).run()


if __name__ == "__main__":
    code = main()
    # Abandoned synchronous handler calls may still be running in pool threads;
    # a stopping worker does not wait for them.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
