"""The model worker: loads the handler, then serves requests until told to stop.

One process per rank: in Python mode a worker group is one process (rank 0 of
1); in MPI mode ``mpirun`` starts ``tp x pp`` of them. Rank 0 listens on the
group's Unix socket, where the frontend sends requests and the supervisor
watches the group's state. In MPI mode rank 0 relays every request and cancel
to the other ranks before handling it itself (``container.worker.ranks``), the
other ranks handle them too and their answers are dropped: only rank 0's answer
goes back.

Concurrency: one asyncio loop. Each request runs as its own task, so the worker
takes new requests while others are still running. ``async def handle`` (and
async generators) run on the loop; a plain ``def handle`` runs on a small thread
pool (``option.sync_handler_threads``, 1 by default: LMI calls a synchronous
handler one request at a time), and a synchronous generator runs start to end
as one job on that pool, its items handed to the loop as they come. Batched or
priority-ordered requests wait for it in ``container.worker.batching``'s queue.

Cancelling: a ``Cancel`` message, or the connection closing, cancels the
request's task. An async handler sees ``CancelledError``; a synchronous
generator stops before its next item. In MPI mode a synchronous call or
generator, once queued, runs to its end on every rank (its answer is dropped):
work that runs collectives across ranks must not stop on one rank and go on on
another.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, cast

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from container.core import logs, proc
from container.core.errors import ServiceUnavailable, describe, one_line
from container.core.protocol import (
    EXIT_ENGINE_DEAD,
    EXIT_LOAD_FAILED,
    EXIT_RANK_LOST,
    METRICS_PATH,
    Attach,
    Cancel,
    Fail,
    Invoke,
    InvokeBatch,
    Message,
    ProtocolError,
    SetAdapter,
    Status,
    WorkerState,
)
from container.worker.adapters import AdapterTable
from container.worker.batching import Batcher
from container.worker.calls import Calls
from container.worker.connection import Connection, DescriptorChannel, PeerGone
from container.worker.handoff import Handoffs
from container.worker.observe import Observer, metrics_text
from container.worker.priority import EnginePriority
from container.worker.ranks import DroppedAnswers
from container.worker.requests import Inputs, split_batch, to_output
from handlers.api import Input, Output
from handlers.api.context import Formatters, WorkerContext, set_current
from handlers.api.engine import Engine
from handlers.api.loader import Handler, HandlerLoadError, load_handler

if TYPE_CHECKING:
    from container.worker.ranks import Follower, Leader

log = logging.getLogger("sagelmi.worker")

SHUTDOWN_TIMEOUT = 22.0  # a handler's shutdown(): the built-in engine's stop fits in it (vllm.ENGINE_STOP_SECONDS)
HEALTH_INTERVAL = 1.0  # how often a built-in handler's check_health() runs


class Worker:
    def __init__(self, context: WorkerContext, incarnation: int) -> None:
        self.context = context
        self.settings = context.settings
        self.incarnation = incarnation
        self.mpi = context.world_size > 1
        self.own_state = Status(state=WorkerState.LOADING)  # this rank's
        self.status = Status(state=WorkerState.LOADING, incarnation=incarnation)  # the group's (rank 0)
        self.handler: Handler | None = None
        self.engine: Engine | None = None  # the built-in engine this process runs, once started
        self.executor = ThreadPoolExecutor(max_workers=self.settings.sync_handler_threads, thread_name_prefix="handler")
        self.connections: set[Connection] = set()
        self.channel: DescriptorChannel | None = None  # rank 0's descriptor channel (container.worker.connection)
        self.dropped = DroppedAnswers()
        self.batcher: Batcher[Connection | DroppedAnswers] | None = None
        self.inputs = Inputs(max_parts=self.settings.max_multipart_parts)  # the handler's, once it is loaded
        self.stopping = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.adapters = AdapterTable(self.loop)  # LoRA adapters the frontend registered (rank 0)
        self.calls = Calls(self.loop, self.executor, self.mpi)
        self.observer = Observer(self.settings.traces_exporter, f"worker-{context.launch.group}")
        self.priority: EnginePriority | None = None  # of what the handler started, once it has loaded
        set_current(context, self.loop, Formatters())

    # The context's relay, as the handler API types it, is the worker's own (container.worker.ranks)
    @property
    def leader(self) -> Leader | None:
        return cast("Leader | None", self.context.leader)

    @property
    def follower(self) -> Follower | None:
        return cast("Follower | None", self.context.follower)

    # -- lifecycle
    async def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.stopping.set)
        if self.context.rank == 0:  # before the socket: a connection's Invoke may claim a client's socket at once
            handoffs = Handoffs(self.connections, self._dispatch, self.loop, self.settings.body_read_timeout)
            self.channel = DescriptorChannel(self.loop, self.context.launch.socket_path, handoffs.receive)
        server = await self._listen() if self.context.rank == 0 else None
        code = 0
        loading = asyncio.create_task(self._load())
        stop = asyncio.create_task(self.stopping.wait())
        health = None
        try:
            await asyncio.wait({loading, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not loading.done():
                log.info("stopping while the model was still loading")
                loading.cancel()  # a built-in engine gives up its start (its processes told to stop)
                await asyncio.wait({loading}, timeout=SHUTDOWN_TIMEOUT)
            elif not loading.result():
                code = EXIT_LOAD_FAILED
                await asyncio.sleep(0.2)  # let the failed Status reach connected peers
            else:
                health = asyncio.create_task(self._watch_health())
                await stop
                log.info("stopping")
        finally:
            if health is not None:
                health.cancel()
            if self.batcher is not None:
                self.batcher.stop()
            if server is not None:
                server.close()
            if self.channel is not None:
                self.channel.close()
            conns: list[Connection | DroppedAnswers] = [*self.connections, self.dropped]
            for conn in conns:
                for task in conn.tasks.values():
                    task.cancel()
                conn.close()
            await asyncio.sleep(0)  # let the cancelled requests unwind before the engine stops
            await self._shutdown_handler()
            self.observer.close()
            self.calls.close()
            if server is not None:
                Path(self.context.launch.socket_path).unlink(missing_ok=True)
        return code

    async def _listen(self):
        path = Path(self.context.launch.socket_path)
        path.unlink(missing_ok=True)
        return await asyncio.start_unix_server(self._serve_connection, path=str(path))

    async def _shutdown_handler(self) -> None:
        stop = self.engine.shutdown if self.engine is not None else self.handler.shutdown if self.handler else None
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
            if self.leader is not None:
                await self._meet_followers(self.leader)
            if self.follower is not None:
                self._follow(self.follower)
                await asyncio.to_thread(self.follower.connect)
            # Import on the loop's thread: some libraries insist on the main thread.
            self.handler = load_handler(self.settings)
            set_current(self.context, self.loop, self.handler.formatters)
            self.inputs = Inputs.for_handler(
                self.settings, self.context.launch.tensor_parallel_degree, self.handler.engine
            )
            if self.handler.engine is not None:
                self.engine = await self.handler.engine.start(self.context, self.handler.formatters)
                self.calls.handler_loaded(self.engine.handle, self.handler.kind)
            else:
                assert self.handler.fn is not None  # a handler is an engine or a model.py's handle
                self.calls.handler_loaded(self.handler.fn, self.handler.kind)
                # LMI's initialisation call: an empty Input with the model properties
                properties = {**self.context.launch.model_properties, **self.inputs.common}
                init = to_output(await self.calls.call(lambda: Input(properties=properties)))
                if init.stream_content is not None:  # a generator handle(): run its body
                    async for _ in self.calls.stream(init, cancelled=threading.Event()):
                        pass
                elif init.code >= 300:
                    raise RuntimeError(
                        f"it answered {init.code} {init.message}: {init.body().decode('utf-8', 'replace')[:500]}"
                    )
            await self.adapters.loaded(self.engine, self.handler.origin)
            if Batcher.wanted(self.settings, self.handler.kind, self.engine):
                self.batcher = Batcher.for_settings(self.settings, self._serve_batch)
                if self.context.follower is None:  # the other ranks run the batches rank 0 formed
                    self.batcher.start()
        except HandlerLoadError as exc:
            return await self._set_own_state(WorkerState.FAILED, str(exc))
        except Exception as exc:
            log.exception("the handler's initialisation failed")
            origin = self.handler.origin if self.handler else "handler"
            what = "start()" if self.handler and self.handler.engine else "handle() on the initialisation call"
            return await self._set_own_state(WorkerState.FAILED, f"{origin}: {what} failed: {one_line(exc)}")
        logs.adopt("vllm")  # its lines in this process get the request id (vLLM configured them when it started)
        log.info("model ready in %.1fs", time.monotonic() - started)
        engine = proc.descendants([os.getpid()])
        if engine:  # what the handler started (vLLM's EngineCore and workers ...)
            self.priority = EnginePriority(self.loop, engine, adaptive=not self.mpi)
            log.info("%d process(es) the handler started %s", len(engine), self.priority.describe())
        return await self._set_own_state(WorkerState.READY)

    # -- state: this rank's, and (on rank 0) the group's
    async def _set_own_state(self, state: WorkerState, detail: str = "") -> bool:
        if state is WorkerState.FAILED:
            log.error("could not load the model: %s", detail)
        self.own_state = Status(state=state, detail=detail, rank=self.context.rank)
        if self.follower is not None:
            self.follower.send_status(self.own_state)
        await self._publish()
        return state is WorkerState.READY

    def _group_status(self) -> Status:
        """Ready once every rank is; failed as soon as one failed (saying which)."""
        states = [self.own_state]
        leader = self.leader
        if leader is not None:
            states += [leader.states[r] for r in sorted(leader.states)]
        failed = [s for s in states if s.state is WorkerState.FAILED]
        if failed:
            detail = failed[0].detail if not self.mpi else f"rank {failed[0].rank}: {failed[0].detail}"
            return Status(state=WorkerState.FAILED, detail=detail, incarnation=self.incarnation)
        ready = all(s.state is WorkerState.READY for s in states) and (
            self.context.leader is None or len(states) == self.context.world_size
        )
        return Status(state=WorkerState.READY if ready else WorkerState.LOADING, incarnation=self.incarnation)

    async def _publish(self) -> None:
        status = self._group_status()
        if status == self.status:
            return
        self.status = status
        if status.state is WorkerState.READY and self.context.rank == 0:
            Path(self.context.launch.ready_path).write_text(str(self.incarnation))
        if status.state is WorkerState.FAILED and self.own_state.state is not WorkerState.FAILED:
            log.error("the worker group cannot serve: %s", status.detail)
            self.stopping.set()  # another rank failed to load: this one stops too
        for conn in list(self.connections):
            try:
                await conn.send(status)
            except PeerGone:
                pass

    # -- the other ranks (MPI mode)
    async def _meet_followers(self, leader: Leader) -> None:
        leader.on_change = lambda: self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._publish()))
        leader.on_lost = lambda rank: self.loop.call_soon_threadsafe(self._rank_lost, rank)
        await asyncio.to_thread(leader.accept_followers)

    def _rank_lost(self, rank: int) -> None:
        if self.stopping.is_set():
            return
        assert self.leader is not None  # the leader reports a lost rank
        state = self.leader.states.get(rank)
        if state is not None and state.state is WorkerState.FAILED:
            return  # its failure is already the group's state; start-up stops
        self._fatal(f"rank {rank} of the group went away", EXIT_RANK_LOST)

    def _follow(self, follower: Follower) -> None:

        def on_message(message: Message) -> None:
            self.loop.call_soon_threadsafe(self._dispatch, self.dropped, message)

        def on_lost() -> None:
            if not self.stopping.is_set():
                self._fatal("rank 0 of the group went away", EXIT_RANK_LOST)

        follower.on_message = on_message
        follower.on_lost = on_lost

    def _fatal(self, reason: str, code: int) -> None:
        """The group cannot go on: leave at once, so that requests in flight fail
        now (the frontend sees the connection drop) and the supervisor restarts it."""
        log.error("%s: stopping this worker group so that it is restarted", reason)
        last_words = Status(state=WorkerState.DOWN, detail=reason, incarnation=self.incarnation)
        for conn in list(self.connections):  # the supervisor and /ping report this, not the exit code
            conn.send_now(last_words)
        logging.shutdown()
        os._exit(code)

    async def _watch_health(self) -> None:
        if self.engine is None:
            return
        while True:
            await asyncio.sleep(HEALTH_INTERVAL)
            self._check_health()

    def _check_health(self) -> None:
        if self.engine is None:
            return
        try:
            self.engine.check_health()
        except Exception as exc:
            self._fatal(f"its engine died ({type(exc).__name__}: {exc})", EXIT_ENGINE_DEAD)

    # -- requests
    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(reader, writer)
        conn.predict_timeout = self.settings.predict_timeout
        conn.cancel = lambda request_id: self._dispatch(conn, Cancel(id=request_id))
        if self.settings.enable_stateful_sessions:
            conn.sessions_expiration = self.settings.sessions_expiration
        self.connections.add(conn)
        try:
            await conn.send(self.status)
            while (message := await conn.receive()) is not None:
                self._dispatch(conn, message)
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        except ProtocolError as exc:
            log.error("closing a connection that sent a bad frame: %s", exc)
        finally:
            self.connections.discard(conn)
            for task in list(conn.tasks.values()):
                task.cancel()
            writer.close()

    def _dispatch(self, conn: Connection | DroppedAnswers, message: Message) -> None:
        """Handle one message from the frontend (or, on another rank, from rank 0)."""
        if isinstance(message, Invoke):
            if message.path == METRICS_PATH:
                if self.follower is not None:  # rank 0 collects every rank's metrics
                    self.follower.send_metrics(message.id, generate_latest().decode())
                    return
            elif (refused := self.inputs.refusal(message)) is not None:  # before it is relayed, batched or parsed
                self.loop.create_task(self._fail(conn, message.id, refused))
                return
            elif self.batcher is not None and self.own_state.state is WorkerState.READY:
                self.batcher.submit(conn, message)  # relayed with its batch (InvokeBatch)
                return
            elif (leader := self._relay()) is not None:
                leader.send(message)
            self._start_request(conn, message)
        elif isinstance(message, Attach) and isinstance(conn, Connection):  # a session's answer may go out
            conn.attach(message)
        elif isinstance(message, SetAdapter):
            self.adapters.receive(conn, message)
        elif isinstance(message, InvokeBatch):  # another rank: the batch rank 0 formed
            self._start_batch([(conn, item) for item in message.items])
        elif isinstance(message, Cancel):
            task = conn.tasks.get(message.id)
            if task is None:
                if self.batcher is not None:
                    self.batcher.cancel(message.id)
                if conn.has_client(message.id):  # stopped by rank 0 while it waited for its batch
                    self.loop.create_task(conn.end_client(message.id, conn.stop_reason(message.id)))
                return
            if (leader := self._relay()) is not None:
                leader.send(message)
            task.cancel()
        else:
            log.warning("ignoring unexpected %s message", type(message).__name__)

    def _relay(self) -> Leader | None:
        """The leader, once its handler is loaded: rank 0 of an MPI group relays requests and cancels."""
        return self.leader if self.handler is not None else None

    def _start_request(self, conn: Connection | DroppedAnswers, message: Invoke) -> asyncio.Task:
        request_id = message.properties.get("requestId", message.id)

        def start() -> asyncio.Task:  # in a copy of the context: the task runs in (a copy of) that one
            logs.request_id_var.set(request_id)
            return self.loop.create_task(self._serve_request(conn, message))

        # Not create_task(context=...): that argument is Python 3.11's, and 3.10 is supported
        task = contextvars.copy_context().run(start)
        conn.tasks[message.id] = task
        if self.priority is not None and message.path != METRICS_PATH:  # what the engine's priority follows
            self.priority.follow(task)
        return task

    def _start_batch(self, batch: list[tuple[Connection | DroppedAnswers, Invoke]]) -> asyncio.Task:
        return self.loop.create_task(self._serve_batch(batch))

    async def _serve_request(self, conn: Connection | DroppedAnswers, message: Invoke) -> None:
        rid = message.id
        cancelled = threading.Event()  # tells a synchronous generator to stop
        output = None
        seen = self.observer.begin(message)
        try:
            if message.path == METRICS_PATH:
                output = Output().add_property("content-type", CONTENT_TYPE_LATEST).add(await metrics_text(self.leader))
            elif self.own_state.state is not WorkerState.READY:
                raise ServiceUnavailable("the model worker is not ready")
            else:
                output = to_output(await self.calls.call(*self.inputs.of(message), seen))
                if output.item_codes and output.code < 300 and output.stream_content is None:
                    # a batching handler's answer to a request that came alone (a batch of one): its
                    # item's error (Output.error(..., batch_index=0)) is the request's, as in a batch
                    output = split_batch(output, 1)[0]
            await self.calls.send_output(conn, rid, output, cancelled, seen)
        except asyncio.CancelledError:
            cancelled.set()
            reason = conn.stop_reason(rid)  # a request read here: timed out, its client gone, the worker stopping
            log.info("request stopped: %s", reason or "cancelled by the frontend")
            if reason is not None:
                await self._fail(conn, rid, reason, quiet=True)
        except PeerGone as exc:
            cancelled.set()
            log.warning("connection lost while answering: %s", exc)
        except Exception as exc:
            cancelled.set()
            seen.outcome = "error"
            await self._fail(conn, rid, exc)
        finally:
            conn.drop_client(rid)
            conn.tasks.pop(rid, None)
            self.observer.end(seen, cancelled.is_set())
            await self._finalize(output)

    async def _serve_batch(self, batch: list[tuple[Connection | DroppedAnswers, Invoke]]) -> None:
        """Run one batch (``container.worker.batching``) and answer each of its requests."""
        if (leader := self._relay()) is not None:
            leader.send(InvokeBatch(items=[message for _, message in batch]))
        if len(batch) == 1:  # as in DJL Serving: a batch of one is an ordinary request
            task = self._start_request(*batch[0])
            await asyncio.wait({task})  # the batch's slot is free once it is answered
            return
        output = None
        serving = asyncio.current_task()
        if self.priority is not None and serving is not None:
            self.priority.follow(serving, len(batch))
        try:
            output = to_output(await self.calls.call(*self.inputs.of_batch([message for _, message in batch])))
            answers = split_batch(output, len(batch))
        except asyncio.CancelledError:
            for conn, message in batch:
                conn.release_client(message.id)
            return
        except Exception as exc:
            for conn, message in batch:
                if not self._dropped(message):
                    await self._fail(conn, message.id, exc, quiet=conn is not batch[0][0])
            return
        finally:
            await self._finalize(output)
        for (conn, message), answer in zip(batch, answers):
            if self._dropped(message):
                continue
            try:
                await self.calls.send_output(conn, message.id, answer, threading.Event())
            except PeerGone:
                pass
            finally:
                conn.drop_client(message.id)

    def _dropped(self, message: Invoke) -> bool:
        return self.batcher is not None and message.id in self.batcher.dropped

    async def _fail(self, conn: Connection | DroppedAnswers, rid: str, exc: Exception, quiet: bool = False) -> None:
        self._check_health()  # an engine that died fails its requests first: restart at once
        status, summary, detail = describe(exc)
        if not quiet:
            if status >= 500 or status == 424:
                log.error("handler failed (%s): %s", status, detail, exc_info=exc)
            else:
                log.info("rejected with %s: %s", status, detail)
        if conn.has_client(rid):  # read here: the error goes to the client from here
            await conn.end_client(rid, exc)
            return
        try:
            await conn.send(Fail(id=rid, code=status, message=summary, error=detail))
        except PeerGone:
            pass

    async def _finalize(self, output: Output | None) -> None:
        """LMI's ``Output.finalize``: run once the answer has been sent."""
        if output is None or output.finalize_function is None:
            return
        try:
            await self.loop.run_in_executor(self.executor, output.execute_finalize)
        except Exception:
            log.exception("the Output's finalize function failed")
