"""What the worker runtime tells a built-in handler about where it runs."""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass
from typing import Protocol

from container.core.launch import WorkerLaunch
from container.core.settings import Settings


class Leader(Protocol):
    """Rank 0's side of an MPI group's relay (``container.worker.ranks.Leader``)."""

    def broadcast(self, data: bytes) -> None: ...


class Follower(Protocol):
    """Another rank's side of the relay (``container.worker.ranks.Follower``): what rank 0 broadcast, in order."""

    broadcasts: queue.SimpleQueue[bytes | None]


@dataclass(frozen=True)
class WorkerContext:
    """A worker process's place in its group, and the group's typed settings.

    In Python mode a group is one process: rank 0 of 1. In MPI mode rank 0 leads
    (``leader``: sends to the other ranks) and the others follow (``follower``:
    receive what rank 0 sends, in order)."""

    launch: WorkerLaunch
    settings: Settings
    rank: int = 0
    world_size: int = 1
    leader: Leader | None = None
    follower: Follower | None = None

    def broadcast(self, data: bytes) -> None:
        """Rank 0: send ``data`` to the handler on every other rank (in call order)."""
        if self.leader is not None:
            self.leader.broadcast(data)

    def next_broadcast(self) -> bytes | None:
        """Another rank: block until rank 0's next broadcast; ``None`` once rank 0 is gone."""
        if self.follower is None:
            raise RuntimeError("only the other ranks of an MPI group receive broadcasts")
        return self.follower.broadcasts.get()


_current: tuple[WorkerContext, asyncio.AbstractEventLoop] | None = None


def set_current(context: WorkerContext, loop: asyncio.AbstractEventLoop) -> None:
    """Record the running worker's context and loop (one worker per process)."""
    global _current
    _current = (context, loop)


def current() -> tuple[WorkerContext, asyncio.AbstractEventLoop]:
    """The running worker's context and loop, for code a handler calls (``djl_python.huggingface``)."""
    if _current is None:
        raise RuntimeError("no sagelmi worker is running in this process")
    return _current
