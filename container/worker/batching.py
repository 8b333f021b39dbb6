"""Dynamic batching for a ``model.py`` handler (``batch_size`` > 1), as DJL
Serving's batch aggregator does it.

When the handler can take a batch (fewer than ``sync_handler_threads`` batches
are running), the batcher waits for a request, takes the ones already waiting
(up to ``batch_size``), then waits up to ``max_batch_delay`` ms from the first
for more. The batch then goes to the handler as one call; a batch of one is an
ordinary request. A request cancelled while it waits leaves the queue; one
cancelled once its batch runs has its answer dropped (the batch runs to its
end for the others).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from container.core.protocol import Invoke
from container.core.settings import Settings

log = logging.getLogger("sagelmi.worker")

Conn = TypeVar("Conn")  # what a request is answered on
Entry = tuple[Conn, Invoke]  # (the connection to answer on, the request)


class Batcher(Generic[Conn]):
    def __init__(
        self, size: int, delay_ms: float, slots: int, run: Callable[[list[Entry[Conn]]], Awaitable[None]]
    ) -> None:
        self.size = size
        self.delay = delay_ms / 1000
        self.slots = asyncio.Semaphore(slots)
        self.run = run
        self.queue: asyncio.Queue[Entry[Conn]] = asyncio.Queue()
        self.dropped: set[str] = set()  # ids cancelled while queued or running
        self.running: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None

    @classmethod
    def for_settings(cls, settings: Settings, run: Callable[[list[Entry[Conn]]], Awaitable[None]]) -> Batcher[Conn]:
        """The batcher ``batch_size``, ``max_batch_delay`` and ``sync_handler_threads`` ask for."""
        log.info(
            "dynamic batching: up to %d requests, waiting up to %g ms", settings.batch_size, settings.max_batch_delay
        )
        return cls(settings.batch_size, settings.max_batch_delay, settings.sync_handler_threads, run)

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._form_batches())

    def submit(self, conn: Conn, message: Invoke) -> None:
        self.queue.put_nowait((conn, message))

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
                entry = await self.queue.get()
            elif not self.queue.empty():
                entry = self.queue.get_nowait()
            else:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                try:
                    entry = await asyncio.wait_for(self.queue.get(), remaining)
                except TimeoutError:
                    return None
            if entry[1].id in self.dropped:
                self.dropped.discard(entry[1].id)
                continue
            return entry

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
