"""Calling a worker's handler, and turning what it returns into the worker protocol's frames.

``async def handle`` (and async generators) run on the worker's loop; a plain ``def handle``
runs on the handler thread pool, and a synchronous generator runs start to end as one job on
that pool, its items handed to the loop as they come (at most ``STREAM_QUEUE`` ahead of the
sender). In MPI mode a queued synchronous call or generator runs to its end on every rank,
even once cancelled (``container.worker.runtime``'s docstring says why).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from container.core.ingress import HOP_BY_HOP
from container.core.protocol import Chunk, End, Head
from container.worker.connection import Connection
from container.worker.observe import Observation
from container.worker.ranks import DroppedAnswers
from container.worker.requests import chunk_of
from handlers.api import Input, Output, json_line, prepend

STREAM_QUEUE = 64  # items a synchronous generator may run ahead of its sender
_END = object()


def _tokens(seen: Observation | None) -> tuple[int | None, int | None]:
    """The prompt and completion tokens the engine counted for the request, when it did."""
    usage = seen.usage if seen is not None else None
    return (usage.prompt_tokens, usage.completion_tokens) if usage is not None else (None, None)


def _build_and_call(handle: Callable[[Input], Any], build: Callable[[], Input], seen: Observation | None) -> Any:
    inputs = build()
    if seen is not None:
        seen.call_started()
    return handle(inputs)


def generator_item(item: Any) -> Any:
    """How an item of a ``handle()`` that is itself a generator goes out: bytes
    and text as they are (``Output.format_stream_item`` sends them), anything else
    as one JSON line."""
    return item if isinstance(item, (str, bytes, bytearray, memoryview)) else json_line(item)


def item_data(output: Output, item: Any) -> tuple[bytes, bool]:
    """The bytes of a streamed item, and whether it is the stream's last: an LMI async-mode
    ``Output`` chunk (async_utils) says so (``last=True``), any other item is formatted by
    ``output``."""
    if isinstance(item, Output):
        return chunk_of(item)
    return output.format_stream_item(item), False


class Calls:
    def __init__(self, loop: asyncio.AbstractEventLoop, executor: ThreadPoolExecutor, mpi: bool) -> None:
        self.loop = loop
        self.executor = executor
        self.mpi = mpi
        self.handle: Callable[[Input], Any] | None = None  # the engine's handle, or model.py's
        self.kind = "sync"
        # Forms for the handlers on the loop are parsed here, one at a time: a parse holds the GIL
        # most of the time, and each thread doing one takes more of it from the loop.
        self.forms = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forms")

    def close(self) -> None:
        """Stop both pools: what is queued on them is dropped."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.forms.shutdown(wait=False, cancel_futures=True)

    def handler_loaded(self, handle: Callable[[Input], Any], kind: str) -> None:
        self.handle, self.kind = handle, kind

    async def call(self, build: Callable[[], Input], parse: bool = False, seen: Observation | None = None) -> Any:
        """Call the handler with the ``Input`` that ``build`` makes; ``seen`` learns when the call
        began (a synchronous one: when a pool thread took it). ``parse``: building it parses a form,
        whose size the client chose: the forms thread does it, never the loop, which serves every
        other request. A synchronous handler's ``Input`` is built in its pool job, so calls still
        reach the handler in the order they were queued (MPI ranks rely on it)."""
        kind, handle = self.kind, self.handle
        assert handle is not None, "a call before handler_loaded()"  # the worker calls once it has loaded
        if kind != "sync":
            if parse:
                inputs = await self.loop.run_in_executor(self.forms, contextvars.copy_context().run, build)
            else:
                inputs = build()
            if seen is not None:
                seen.call_started()
            if kind in ("async_generator", "generator"):  # sagelmi's own: handle() itself streams
                return Output().add_stream_content(handle(inputs), output_formatter=generator_item)
            return await handle(inputs)
        job = functools.partial(_build_and_call, handle, build, seen)
        call = self.loop.run_in_executor(self.executor, contextvars.copy_context().run, job)
        if not self.mpi:
            return await call
        # In MPI mode a queued call runs on every rank even if cancelled (see the module's docstring).
        call.add_done_callback(lambda f: f.cancelled() or f.exception())  # an abandoned call's error is dropped
        return await asyncio.shield(call)

    async def stream(self, output: Output, cancelled: threading.Event) -> AsyncIterator[bytes]:
        stream = output.stream_content
        if hasattr(stream, "__aiter__"):
            async for item in cast(AsyncIterator[Any], stream):
                data, last = item_data(output, item)
                yield data
                if last:
                    break
            return
        items: asyncio.Queue = asyncio.Queue()
        room = threading.Semaphore(STREAM_QUEUE)  # the generator runs at most this far ahead of its sender
        job = self.loop.run_in_executor(
            self.executor, contextvars.copy_context().run, self._drain_sync_stream, output, items, room, cancelled
        )
        while (item := await items.get()) is not _END:
            room.release()
            if isinstance(item, BaseException):
                raise item
            yield item
        await job

    def _drain_sync_stream(
        self, output: Output, items: asyncio.Queue, room: threading.Semaphore, cancelled: threading.Event
    ) -> None:
        """Run a synchronous stream to its end on a pool thread, handing each
        formatted item to the loop (waiting while the sender is behind)."""
        iterator = iter(cast(Iterable[Any], output.stream_content))  # a synchronous stream (see stream())

        def put(item) -> bool:
            while not room.acquire(timeout=0.5):
                if cancelled.is_set():
                    return False
            self.loop.call_soon_threadsafe(items.put_nowait, item)
            return True

        try:
            for item in iterator:
                if cancelled.is_set():
                    if not self.mpi:
                        return
                    continue  # MPI mode: every rank runs the stream to its end
                put(output.format_stream_item(item))
        except Exception as exc:
            if not cancelled.is_set():
                put(exc)
            return
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
        if not cancelled.is_set():
            put(_END)

    async def send_output(
        self,
        conn: Connection | DroppedAnswers,
        rid: str,
        output: Output,
        cancelled: threading.Event,
        seen: Observation | None = None,
    ) -> None:
        """Send ``output`` as the answer to request ``rid``: head, body or stream, end
        (with what ``seen`` recorded: when the call began, the tokens counted)."""
        if getattr(output, "chunked", False):  # LMI async mode: the first chunk's properties are the headers
            output = await self._peek_chunks(output)
        headers = {k: v for k, v in output.headers().items() if k.lower() not in HOP_BY_HOP}
        streaming = output.stream_content is not None
        started = seen.started if seen is not None else 0.0
        # A request read by rank 0 has its answer written here (container.worker.handoff); the
        # frontend's own (/metrics) and another rank's go as frames (to nowhere on another rank)
        client = conn.has_client(rid)
        if client:
            if (stopped := conn.stopped(rid)) is not None:
                raise stopped  # rank 0 stopped it (a timeout, its client gone): the handler's late answer is not sent
            headers = conn.answer_headers(rid, output.code, headers)
        body = b"" if streaming else output.body()
        held = client and conn.held(rid)  # an answer opening or closing a session waits for the routing
        head = Head(
            id=rid, code=output.code, headers=headers, stream=streaming, started=started, written=client, held=held
        )
        await conn.send(head)
        if client:
            await conn.delivered(rid)
            conn.open_client(rid, output.code, headers, None if streaming else len(body))
        if streaming:
            await self._send_stream(conn, rid, output, cancelled)
        elif body and client:
            conn.add_chunk(rid, body)
        elif body:
            await conn.send(Chunk(id=rid, data=body))
        prompt, completion = _tokens(seen)
        if client:
            await conn.end_client(rid, None, (prompt, completion))
            return
        await conn.send(End(id=rid, prompt_tokens=prompt, completion_tokens=completion))

    async def _send_stream(
        self, conn: Connection | DroppedAnswers, rid: str, output: Output, cancelled: threading.Event
    ) -> None:
        if hasattr(output.stream_content, "__aiter__"):
            # stream() inlined: an async generator's pass per token costs as much as the rest of its relay
            fmt = output.format_stream_item
            async for item in cast(AsyncIterator[Any], output.stream_content):
                if isinstance(item, Output):
                    data, last = chunk_of(item)
                else:
                    data, last = fmt(item), False
                if data and conn.add_chunk(rid, data):
                    await conn.wait_writable(rid)
                if last:
                    break
        else:
            async for data in self.stream(output, cancelled):
                if data and conn.add_chunk(rid, data):
                    await conn.wait_writable(rid)

    async def _peek_chunks(self, output: Output) -> Output:
        stream = aiter(cast(AsyncIterator[Any], output.stream_content))  # chunked: an async stream
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            return Output(code=204, message="No content")
        if isinstance(first, Output):
            output.properties = {**first.properties, **output.properties}
            chunk_of(first)  # a failed first chunk is the request's error, not a stream's last line
        output.stream_content = prepend(first, stream)
        return output
