"""What the worker runtime tells a built-in handler about where it runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from container.core.launch import WorkerLaunch
from container.core.settings import Settings


@dataclass(frozen=True)
class Formatters:
    """A ``model.py``'s ``@input_formatter`` and ``@output_formatter`` (LMI's signatures for the
    engine serving it), or ``None`` for the engine's own."""

    input: Callable[..., Any] | None = None
    output: Callable[..., Any] | None = None

    def __bool__(self) -> bool:
        return self.input is not None or self.output is not None


class Leader(Protocol):
    """Rank 0's side of an MPI group's relay (``container.worker.ranks.Leader``), which the runtime uses."""


class Follower(Protocol):
    """Another rank's side of the relay (``container.worker.ranks.Follower``), which the runtime uses."""


@dataclass(frozen=True)
class WorkerContext:
    """A worker process's place in its group, and the group's typed settings.

    In Python mode a group is one process: rank 0 of 1. In MPI mode rank 0 leads
    (``leader``: relays every request to the other ranks) and the others follow (``follower``:
    receive what rank 0 relays, in order)."""

    launch: WorkerLaunch
    settings: Settings
    rank: int = 0
    world_size: int = 1
    leader: Leader | None = None
    follower: Follower | None = None


class Running(NamedTuple):
    """The worker running in this process: its context, its event loop, and a ``model.py``'s formatters."""

    context: WorkerContext
    loop: asyncio.AbstractEventLoop
    formatters: Formatters


_current: Running | None = None


def set_current(context: WorkerContext, loop: asyncio.AbstractEventLoop, formatters: Formatters) -> None:
    """Record the running worker (one worker per process)."""
    global _current
    _current = Running(context, loop, formatters)


def current() -> Running:
    """The running worker, for code a handler calls (``djl_python.huggingface``)."""
    if _current is None:
        raise RuntimeError("no sagelmi worker is running in this process")
    return _current
