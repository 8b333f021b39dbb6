"""The CPU priority of what the handler started (vLLM's ``EngineCore`` and model runner): level
with the request path while the worker serves few requests, below it while it serves more.

vLLM's processes busy-wait on each other between engine steps (docs/benchmarks/ has the
measurements):

- at many streams, an engine at the request path's nice 0 keeps the frontend and the worker from
  handing requests on, and it runs few tokens a step; at nice 10 (``proc.ENGINE_NICE``) it
  batches as vLLM's own server does;
- at one or two streams, nice 10 costs the engine a sixth of its tokens per second: each token
  wakes the worker, the frontend and the client, and every such wake-up preempts a model runner
  at nice 10 for as long as it runs.

So a single-rank group's engine runs at nice 0 while at most ``SHARED_UP_TO`` requests are in
flight, drops to ``ENGINE_NICE`` at once when more arrive, and gets nice 0 back once the
worker has served at most ``SHARED_UP_TO`` for ``RESTORE_AFTER`` seconds. That wait is long:
under 16 streams the worker once held at most 2 requests for over a second (the others were
in the client and the frontend), and an engine given nice 0 then keeps them there. Giving a priority
back needs ``CAP_SYS_NICE`` (root outside a container, ``docker run --cap-add SYS_NICE``) or
an ``RLIMIT_NICE`` of 20: without it the engine stays at ``ENGINE_NICE`` after the first
time it went there, as it was before, and the log says so once. The ranks of an MPI group
step together, and only rank 0 sees the requests: their engines stay at ``ENGINE_NICE``.
"""

from __future__ import annotations

import asyncio
import logging

from container.core import proc

log = logging.getLogger("sagelmi.worker")

SHARED_UP_TO = 2  # requests in flight up to which the engine runs at the request path's priority
RESTORE_AFTER = 5.0  # seconds at or under SHARED_UP_TO before the engine gets nice 0 back


class EnginePriority:
    """The nice value of the processes ``pids`` (every thread of them), following the number of
    requests the worker serves (``started``/``ended``); ``adaptive=False`` sets ``ENGINE_NICE`` for good."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pids: list[int], adaptive: bool) -> None:
        self.loop = loop
        self.pids = pids
        self.adaptive = adaptive
        self.in_flight = 0
        self.lowered = not adaptive
        self._restore: asyncio.TimerHandle | None = None
        if not adaptive:
            proc.set_nice(pids, proc.ENGINE_NICE)

    def describe(self) -> str:
        if not self.adaptive:
            return f"run at nice {proc.ENGINE_NICE}"
        return f"run at nice 0 while at most {SHARED_UP_TO} requests are in flight, at nice {proc.ENGINE_NICE} above"

    def started(self, count: int = 1) -> None:
        self.in_flight += count
        if self.in_flight <= SHARED_UP_TO:
            return
        if self._restore is not None:
            self._restore.cancel()
            self._restore = None
        if not self.lowered:
            self.lowered = True
            proc.set_nice(self.pids, proc.ENGINE_NICE)

    def ended(self, count: int = 1) -> None:
        self.in_flight -= count
        if self.adaptive and self.lowered and self.in_flight <= SHARED_UP_TO and self._restore is None:
            self._restore = self.loop.call_later(RESTORE_AFTER, self._give_back)

    def follow(self, task: asyncio.Task, requests: int = 1) -> None:
        """Count ``requests`` in flight until ``task`` (which serves them) is done."""
        self.started(requests)
        task.add_done_callback(lambda _: self.ended(requests))

    def _give_back(self) -> None:
        self._restore = None
        if self.in_flight > SHARED_UP_TO:
            return
        try:
            proc.set_nice(self.pids, 0)
        except PermissionError:
            self.adaptive = False
            log.info(
                "the engine's processes stay at nice %d: this process may not raise their priority back "
                "(it lacks CAP_SYS_NICE; docker run --cap-add SYS_NICE grants it)",
                proc.ENGINE_NICE,
            )
            return
        self.lowered = False
