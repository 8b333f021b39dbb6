"""The model worker process: loads the handler, then serves requests from the
frontend over a Unix socket until told to stop.

Run as ``python -m handlers.worker --spec <worker-spec.json>``.

Concurrency: one asyncio loop reads every connection. Each request runs as its
own task, so the worker takes new requests while others are still running.
``async def handle`` (and async generators) run on the loop; a plain ``def
handle`` runs on a small thread pool (``option.sync_handler_threads``, 1 by
default: LMI calls a synchronous handler one request at a time).

Cancelling: a ``Cancel`` message, or the connection closing, cancels the
request's task. An async handler sees ``CancelledError``; a synchronous call
that is already running finishes in its thread and its result is dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from handlers import logs, proc
from handlers.api import Input, Output
from handlers.errors import ServiceUnavailable, describe
from handlers.loader import Handler, HandlerLoadError, load_handler
from handlers.protocol import (EXIT_LOAD_FAILED, FRAME_HEADER, METRICS_PATH, Cancel, Chunk, End, Fail, Head, Invoke,
                               Message, ProtocolError, Status, WorkerSpec, decode, decode_spec, encode,
                               frame_length)

log = logging.getLogger("sagelmi.worker")

SHUTDOWN_TIMEOUT = 15.0
WRITE_HIGH_WATER = 1 << 16  # bytes buffered towards the frontend before senders wait (then vLLM merges deltas)
_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive"}
_DONE = object()


class _Link:
    """One connection from the frontend (or the supervisor) to this worker.

    Frames are coalesced: everything sent during one pass of the event loop
    (typically one token for each running stream) leaves in a single write,
    instead of one system call per frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.tasks: dict[str, asyncio.Task] = {}
        self._frames: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    async def send(self, message: Message) -> None:
        if not self._frames:
            # Flush on the loop's next pass, after the other streams woken by the
            # same engine step have queued their frames too.
            self._loop.call_soon(self._loop.call_soon, self._flush)
        self._frames.append(encode(message))
        if self.writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER:
            await self.writer.drain()  # the frontend reads too slowly: wait for it
        elif self.writer.is_closing():
            raise ConnectionResetError("the connection to the frontend is closed")

    def _flush(self) -> None:
        frames, self._frames = self._frames, []
        if frames and not self.writer.is_closing():
            self.writer.write(b"".join(frames))

    async def receive(self) -> Message | None:
        try:
            header = await self.reader.readexactly(FRAME_HEADER.size)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise ProtocolError("connection closed in the middle of a frame header") from None
            return None
        return decode(await self.reader.readexactly(frame_length(header)))


def to_output(result: Any) -> Output:
    """Normalise what ``handle`` returned into an ``Output``."""
    if isinstance(result, Output):
        return result
    if result is None:
        return Output()
    if hasattr(result, "__aiter__") or (hasattr(result, "__next__") and hasattr(result, "__iter__")):
        return Output().add_stream_content(result)
    return Output().add(result)


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.status = Status(state="loading", pid=os.getpid())
        self.handler: Handler | None = None
        self.executor = ThreadPoolExecutor(max_workers=spec.sync_handler_threads,
                                           thread_name_prefix="handler")
        self.links: set[_Link] = set()
        self.stopping = asyncio.Event()

    # -- lifecycle
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        path = Path(self.spec.socket_path)
        path.unlink(missing_ok=True)
        server = await asyncio.start_unix_server(self._serve_link, path=str(path))
        code = 0
        loading = asyncio.create_task(self._load())
        stop = asyncio.create_task(self.stopping.wait())
        try:
            await asyncio.wait({loading, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not loading.done():
                log.info("stopping while the model was still loading")
                loading.cancel()
            elif not loading.result():
                code = EXIT_LOAD_FAILED
                await asyncio.sleep(0.2)  # let the failed Status reach connected peers
            else:
                await stop
                log.info("stopping")
        finally:
            server.close()
            for link in list(self.links):
                for task in link.tasks.values():
                    task.cancel()
                link.writer.close()
            await asyncio.sleep(0)  # let the cancelled requests unwind before the engine stops
            await self._shutdown_handler()
            self.executor.shutdown(wait=False, cancel_futures=True)
            path.unlink(missing_ok=True)
        return code

    async def _shutdown_handler(self) -> None:
        stop = self.handler.shutdown if self.handler is not None else None
        if stop is None:
            return
        try:
            result = await asyncio.wait_for(asyncio.to_thread(stop), SHUTDOWN_TIMEOUT)
            if asyncio.iscoroutine(result):
                await asyncio.wait_for(result, SHUTDOWN_TIMEOUT)
        except Exception:
            log.exception("the handler's shutdown() failed")

    async def _load(self) -> bool:
        started = time.monotonic()
        try:
            # Import on the loop's thread: some libraries insist on the main thread.
            self.handler = load_handler(self.spec.model_dir, self.spec.entry_point, self.spec.properties)
            init = to_output(await self._call(Input(properties=dict(self.spec.properties))))
            if init.stream_content is not None:  # a generator handle(): run its body
                async for _ in self._stream(init):
                    pass
        except HandlerLoadError as exc:
            return await self._fail_load(str(exc))
        except Exception as exc:
            log.exception("the handler's initialisation call failed")
            return await self._fail_load(
                f"{self.handler.origin if self.handler else 'handler'}: handle() failed on the "
                f"initialisation call: {type(exc).__name__}: {exc}")
        log.info("model ready in %.1fs", time.monotonic() - started)
        await self._set_status(Status(state="ready", pid=os.getpid()))
        return True

    async def _fail_load(self, reason: str) -> bool:
        log.error("could not load the model: %s", reason)
        await self._set_status(Status(state="failed", detail=reason, pid=os.getpid()))
        return False

    async def _set_status(self, status: Status) -> None:
        self.status = status
        for link in list(self.links):
            try:
                await link.send(status)
            except (ConnectionError, OSError):
                pass

    # -- connections
    async def _serve_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link(reader, writer)
        self.links.add(link)
        try:
            await link.send(self.status)
            while (message := await link.receive()) is not None:
                if isinstance(message, Invoke):
                    self._start_request(link, message)
                elif isinstance(message, Cancel):
                    task = link.tasks.get(message.id)
                    if task is not None:
                        task.cancel()
                else:
                    log.warning("ignoring unexpected %s message", type(message).__name__)
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        except ProtocolError as exc:
            log.error("closing a connection that sent a bad frame: %s", exc)
        finally:
            self.links.discard(link)
            for task in list(link.tasks.values()):
                task.cancel()
            writer.close()

    def _start_request(self, link: _Link, message: Invoke) -> None:
        request_id = message.properties.get("x-amzn-sagemaker-inference-id", message.id)
        context = contextvars.copy_context()
        context.run(logs.request_id_var.set, request_id)
        task = asyncio.get_running_loop().create_task(self._serve_request(link, message), context=context)
        link.tasks[message.id] = task

    async def _serve_request(self, link: _Link, message: Invoke) -> None:
        rid = message.id
        head_sent = False
        try:
            if message.path == METRICS_PATH:
                output = Output().add_property("content-type", CONTENT_TYPE_LATEST).add(generate_latest())
            elif self.status.state != "ready":
                raise ServiceUnavailable("the model worker is not ready")
            else:
                output = to_output(await self._call(Input(message.properties, message.body, message.path)))
            headers = {k: v for k, v in output.headers().items() if k.lower() not in _HOP_BY_HOP}
            streaming = output.stream_content is not None
            await link.send(Head(id=rid, code=output.code, headers=headers, stream=streaming))
            head_sent = True
            if streaming:
                async for data in self._stream(output):
                    if data:
                        await link.send(Chunk(id=rid, data=data))
            else:
                body = output.body()
                if body:
                    await link.send(Chunk(id=rid, data=body))
            await link.send(End(id=rid))
        except asyncio.CancelledError:
            log.info("request abandoned: cancelled by the frontend")
        except (ConnectionError, OSError) as exc:
            log.warning("connection lost while answering: %s", exc)
        except Exception as exc:
            status, summary, detail = describe(exc)
            if status >= 500 or status == 424:
                log.exception("handler failed (%s after %s)", status, "streaming began" if head_sent else "start")
            else:
                log.info("rejected with %s: %s", status, detail)
            try:
                await link.send(Fail(id=rid, code=status, message=summary, error=detail))
            except (ConnectionError, OSError):
                pass
        finally:
            link.tasks.pop(rid, None)

    # -- calling the handler
    async def _call(self, inputs: Input) -> Any:
        handler = self.handler
        if handler.kind in ("async_generator", "generator"):
            return Output().add_stream_content(handler.fn(inputs))
        if handler.kind == "async":
            return await handler.fn(inputs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, contextvars.copy_context().run, handler.fn, inputs)

    async def _stream(self, output: Output) -> AsyncIterator[bytes]:
        stream = output.stream_content
        if hasattr(stream, "__aiter__"):
            async for item in stream:
                yield output.format_stream_item(item)
            return
        iterator = iter(stream)
        loop = asyncio.get_running_loop()
        try:
            while True:
                item = await loop.run_in_executor(
                    self.executor, contextvars.copy_context().run, next, iterator, _DONE)
                if item is _DONE:
                    return
                yield output.format_stream_item(item)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                # Runs after any next() still in flight on a single-thread pool.
                self.executor.submit(_close_quietly, close)


def _close_quietly(close) -> None:
    try:
        close()
    except Exception:  # a generator already running in another thread: it ends on its own
        log.debug("could not close an abandoned stream", exc_info=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="sagelmi model worker (started by `sagelmi serve`)")
    parser.add_argument("--spec", required=True, help="path of the worker spec JSON")
    args = parser.parse_args(argv)
    spec = decode_spec(Path(args.spec).read_bytes())
    logs.configure(f"worker-{spec.group}", spec.log_level)
    proc.die_with_parent()
    return asyncio.run(Worker(spec).run())


if __name__ == "__main__":
    code = main()
    # Abandoned synchronous handler calls may still be running in pool threads;
    # a stopping worker does not wait for them.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
