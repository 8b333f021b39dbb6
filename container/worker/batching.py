"""The queue in front of a ``model.py`` handler's calls: dynamic batching (``batch_size`` > 1),
as DJL Serving's batch aggregator does it, and the order in which requests get a call.

When the handler can take a batch (fewer than ``sync_handler_threads`` batches
are running), the batcher waits for a request, takes the ones already waiting
(up to ``batch_size``), then waits up to ``max_batch_delay`` ms from the first
for more. The batch then goes to the handler as one call; a batch of one is an
ordinary request. A request cancelled while it waits leaves the queue; one
cancelled once its batch runs has its answer dropped (the batch runs to its
end for the others).

Waiting requests leave in the order of their priority (``container.core.request_priority``:
lower first), first-come among equals; every request has priority 0 unless
``option.scheduling_policy=priority`` lets it name another, so without it the queue is
first-come. The order is strict, as vLLM's priority scheduling is: a request waits as long as
requests of lower values keep arriving, at most until its ``predict_timeout``. The queue holds
at most what the frontend admits (``job_queue_size``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from container.core.protocol import Invoke
from container.core.request_priority import header_priority
from container.core.settings import Settings
from handlers.api.engine import Engine

log = logging.getLogger("sagelmi.worker")

Conn = TypeVar("Conn")  # what a request is answered on
Entry = tuple[Conn, Invoke]  # (the connection to answer on, the request)
Waiting = tuple[int, int, Conn, Invoke]  # (priority, arrival number, the entry): the queue's order


class Batcher(Generic[Conn]):
    def __init__(
        self, size: int, delay_ms: float, slots: int, run: Callable[[list[Entry[Conn]]], Awaitable[None]]
    ) -> None:
        self.size = size
        self.delay = delay_ms / 1000
        self.slots = asyncio.Semaphore(slots)
        self.run = run
        self.queue: asyncio.PriorityQueue[Waiting[Conn]] = asyncio.PriorityQueue()
        self._arrivals = itertools.count()  # first-come among equal priorities (and conns are never compared)
        self.dropped: set[str] = set()  # ids cancelled while queued or running
        self.running: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None

    @classmethod
    def for_settings(cls, settings: Settings, run: Callable[[list[Entry[Conn]]], Awaitable[None]]) -> Batcher[Conn]:
        """The batcher ``batch_size``, ``max_batch_delay`` and ``sync_handler_threads`` ask for
        (with ``batch_size`` 1: the queue in priority order, each request a call of its own)."""
        order = "by priority (option.scheduling_policy=priority)" if settings.priority_scheduling else "first-come"
        if settings.batch_size > 1:
            log.info(
                "dynamic batching: up to %d requests, waiting up to %g ms; waiting requests leave %s",
                settings.batch_size,
                settings.max_batch_delay,
                order,
            )
        else:
            log.info(
                "requests waiting for one of the handler's %d thread(s) leave %s", settings.sync_handler_threads, order
            )
        return cls(settings.batch_size, settings.max_batch_delay, settings.sync_handler_threads, run)

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._form_batches())

    @staticmethod
    def wanted(settings: Settings, kind: str, engine: Engine | None) -> bool:
        """Whether requests wait here for a handler called as ``kind`` (``handlers.api.loader``),
        a ``model.py``'s or a built-in ``engine`` the worker's batching feeds: to be batched, or,
        with priority scheduling, to reach a synchronous handler's threads in priority order. An
        async handler (and vLLM, which schedules its own queue) takes every request at once:
        nothing waits in the worker."""
        if engine is not None and not engine.dynamic_batching:
            return False
        return settings.batch_size > 1 or (settings.priority_scheduling and kind in ("sync", "generator"))

    def submit(self, conn: Conn, message: Invoke) -> None:
        """Queue ``message``; it leaves before those of higher ``X-Priority`` values (the worker
        refused a request whose header is no priority it orders by: ``Inputs.refusal``), after
        those of its own that came before it."""
        priority = header_priority(message.properties) or 0
        self.queue.put_nowait((priority, next(self._arrivals), conn, message))

    def cancel(self, message_id: str) -> None:
        self.dropped.add(message_id)

    def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        for task in list(self.running):
            task.cancel()

    async def _take(self, timeout: float | None) -> Entry[Conn] | None:
        """The next request still wanted; ``None`` when ``timeout`` passed first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if deadline is None:
                waiting = await self.queue.get()
            elif not self.queue.empty():
                waiting = self.queue.get_nowait()
            else:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                try:
                    waiting = await asyncio.wait_for(self.queue.get(), remaining)
                except TimeoutError:
                    return None
            _, _, conn, message = waiting
            if message.id in self.dropped:
                self.dropped.discard(message.id)
                continue
            return conn, message

    async def _form_batches(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.slots.acquire()
            first = await self._take(None)
            assert first is not None  # no timeout: it waits for one
            batch = [first]
            deadline = loop.time() + self.delay
            while len(batch) < self.size:
                entry = await self._take(max(deadline - loop.time(), 0))
                if entry is None:
                    break
                batch.append(entry)
            log.debug("batch of %d", len(batch))
            task = loop.create_task(self._run(batch))
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    async def _run(self, batch: list[Entry[Conn]]) -> None:
        try:
            await self.run(batch)
        finally:
            self.slots.release()
            for _, message in batch:
                self.dropped.discard(message.id)
