"""``lmi-dist``: vLLM split across the ranks of an MPI worker group.

Every rank builds the same vLLM engine core in its own process with vLLM's
``external_launcher`` executor: one model shard per rank (tensor parallel, and
pipeline parallel when asked), joined by ``torch.distributed`` collectives
(gloo on the CPU, NCCL on GPUs). Those collectives only line up if every rank's
engine takes identical steps, so one rank decides them:

- rank 0 runs vLLM's ``AsyncLLM`` front (tokenising, the LMI and OpenAI
  schemas, streaming, detokenising) exactly as the Python-mode handler does,
  but its engine core is not a separate process: a thread steps it here;
- before each step, that thread takes what arrived since the last one (new
  requests, aborts of requests whose client left, LoRA changes) and sends it to
  the other ranks as one ``Plan`` (a relay ``Broadcast``), then applies it and
  steps;
- every other rank waits for the next plan, applies it, and steps the same way;
  its outputs are dropped (rank 0's answer is the group's).

Waiting costs nothing: rank 0's thread sleeps until work arrives, the others
block on their relay socket. Requests reach rank 0 only
(``requests_on_rank0_only``): the plans carry everything the other ranks need.
On the CPU, vLLM's attention needs the stepping thread to run OpenMP at torch's
thread count; the supervisor gives every rank ``OMP_NUM_THREADS``, so that every
thread starts at it.

A plan is a typed ``msgspec`` struct, encoded with vLLM's own msgpack encoder and
decoder (``vllm.v1.serial_utils``, what vLLM uses between its front and its
engine-core process), never pickled: a follower decodes only a ``Plan`` and calls
only the engine's methods it names in ``ENGINE_CALLS``.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client import REGISTRY
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.lora.request import LoRARequest
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.core_client import EngineCoreClient
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.executor import Executor
from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from container.core.logs import redacted_json
from handlers.api import Input, Output
from handlers.api.context import WorkerContext
from handlers.api.engine import Engine, Formatters
from handlers.engines import vllm_media
from handlers.engines.vllm import UnfinishedRequests, VllmEngine, engine_kwargs

log = logging.getLogger("sagelmi.lmi_dist")


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class AddLora(msgspec.Struct, tag=True, array_like=True):
    lora_request: LoRARequest


class EngineCall(msgspec.Struct, tag=True, array_like=True):
    """One of ``ENGINE_CALLS`` on the engine core, with plain arguments (ids, flags)."""

    method: str
    args: list[int | bool | str | None] = msgspec.field(default_factory=list)


# The engine core's methods a plan may call besides add_lora (LeaderClient's calls).
ENGINE_CALLS = frozenset(
    {"remove_lora", "list_loras", "pin_lora", "reset_prefix_cache", "reset_mm_cache", "reset_encoder_cache"}
)


PlanOp = AddRequest | AbortRequests | AddLora | EngineCall


class Plan(msgspec.Struct, array_like=True):
    """What every rank does before its next engine step, in order. ``stop`` ends the stepping."""

    ops: list[PlanOp] = msgspec.field(default_factory=list)
    stop: bool = False


class PlanCodec:
    """Plans to bytes and back with vLLM's msgpack encoder and decoder (tensors of a request,
    prompt embeddings or multimodal features, as vLLM sends them to its engine core), and an
    outer msgpack list for the buffers vLLM keeps apart. One per thread: neither side is
    thread-safe."""

    def __init__(self) -> None:
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(Plan)
        self._buffers = msgspec.msgpack.Decoder(list[bytearray])  # writable: tensors may share them

    def encode(self, plan: Plan) -> bytes:
        return msgspec.msgpack.encode(list(self._encoder.encode(plan)))

    def decode(self, data: bytes) -> Plan:
        """Raises ``msgspec.DecodeError`` (or ``ValidationError``) for anything but a plan."""
        return self._decoder.decode(self._buffers.decode(data))


class LockstepCore:
    """An engine core stepped in this process, the same way on every rank."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.error: BaseException | None = None

    def has_work(self) -> bool:
        return self.core.scheduler.has_requests() or bool(self.core.batch_queue)

    def apply(self, plan: Plan) -> list[Any]:
        """Apply the plan's operations; returns the results of its calls (``AddLora``, ``EngineCall``)."""
        results = []
        for op in plan.ops:
            if isinstance(op, AddRequest):
                request, wave = self.core.preprocess_add_request(op.request)
                self.core.add_request(request, wave)
            elif isinstance(op, AbortRequests):
                self.core.abort_requests(op.request_ids)
            else:  # a failing call (a bad LoRA adapter ...) is that call's error, not the engine's
                try:
                    results.append(self._call(op))
                except Exception as exc:
                    results.append(exc)
        return results

    def _call(self, op: AddLora | EngineCall) -> Any:
        if isinstance(op, AddLora):
            return self.core.add_lora(op.lora_request)
        if op.method not in ENGINE_CALLS:
            raise ValueError(f"{op.method} is not an engine call a plan may make")
        return getattr(self.core, op.method)(*op.args)

    def step(self) -> EngineCoreOutputs | None:
        outputs, executed = self.core.step_fn()
        self.core.post_step(executed)
        return outputs.get(0) if outputs else None


class LeaderClient:
    """Rank 0: stands in for ``AsyncLLM``'s engine-core client. Requests and
    aborts queue up; a thread turns them into plans, sends each plan to the
    other ranks, applies it and steps; outputs go to ``AsyncLLM``'s output
    handler on the event loop."""

    def __init__(self, lockstep: LockstepCore, context: WorkerContext, loop: asyncio.AbstractEventLoop) -> None:
        self.lockstep = lockstep
        self.context = context
        self.loop = loop
        self.engine_ranks_managed = [0]
        self.resources = _Resources()
        self._codec = PlanCodec()
        self._ops: list[PlanOp] = []
        self._calls: list[asyncio.Future] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._thread = threading.Thread(target=self._run, name="lmi-dist-steps", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- what AsyncLLM calls
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._queue(AddRequest(request))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            self._queue(AbortRequests(list(request_ids)))

    async def get_output_async(self) -> EngineCoreOutputs:
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            raise EngineDeadError("the lmi-dist engine stopped") from item
        return item

    async def get_supported_tasks_async(self):
        return self.lockstep.core.get_supported_tasks()

    async def _call(self, method: str, *args) -> Any:
        return await self._call_op(EngineCall(method, list(args)))

    async def _call_op(self, op: AddLora | EngineCall) -> Any:
        future = self.loop.create_future()
        self._queue(op, future)
        return await future

    async def add_lora_async(self, lora_request: LoRARequest) -> bool:
        return await self._call_op(AddLora(lora_request))

    async def remove_lora_async(self, lora_id: int) -> bool:
        return await self._call("remove_lora", lora_id)

    async def list_loras_async(self) -> set[int]:
        return await self._call("list_loras")

    async def pin_lora_async(self, lora_id: int) -> bool:
        return await self._call("pin_lora", lora_id)

    async def reset_prefix_cache_async(self, *args, **kwargs) -> bool:
        return await self._call("reset_prefix_cache", *args)

    async def reset_mm_cache_async(self) -> None:
        return await self._call("reset_mm_cache")

    async def reset_encoder_cache_async(self) -> None:
        return await self._call("reset_encoder_cache")

    async def is_sleeping_async(self) -> bool:
        return False

    def dp_engines_running(self) -> bool:
        return False

    def get_kv_event_sources(self) -> dict:
        return {}

    def shutdown(self, timeout: float | None = None) -> None:
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout or 30)
        self.lockstep.core.shutdown()

    # -- the stepping thread
    def _queue(self, op: PlanOp, future: asyncio.Future | None = None) -> None:
        if self.resources.engine_dead:
            raise EngineDeadError("the lmi-dist engine stopped")
        with self._cond:
            self._ops.append(op)
            if future is not None:
                self._calls.append(future)
            self._cond.notify()

    def _next_plan(self) -> tuple[Plan, list[asyncio.Future]]:
        with self._cond:
            while not (self._ops or self._stopping or self.lockstep.has_work()):
                self._cond.wait()
            plan = Plan(self._ops, stop=self._stopping)
            calls, self._ops, self._calls = self._calls, [], []
        return plan, calls

    def _run(self) -> None:
        try:
            while True:
                plan, calls = self._next_plan()
                self.context.broadcast(self._codec.encode(plan))
                if plan.stop:
                    return
                for future, result in zip(calls, self.lockstep.apply(plan)):
                    self.loop.call_soon_threadsafe(_settle, future, result)
                outputs = self.lockstep.step()
                if outputs is not None:
                    self.loop.call_soon_threadsafe(self._outputs.put_nowait, outputs)
        except BaseException as exc:  # the engine is unusable: fail everything, the group restarts
            log.exception("the lmi-dist engine failed")
            self.lockstep.error = exc
            self.resources.engine_dead = True
            self.loop.call_soon_threadsafe(self._outputs.put_nowait, exc)


def _settle(future: asyncio.Future, result: Any) -> None:
    if future.done():
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)


@dataclass
class _Resources:
    """What ``AsyncLLM.errored`` reads from its client."""

    engine_dead: bool = False


class LockstepAsyncLLM(AsyncLLM):
    """vLLM's ``AsyncLLM`` with its engine core in this process, stepped by
    ``LeaderClient`` instead of a separate engine process."""

    def __init__(self, vllm_config, client: LeaderClient) -> None:
        # AsyncLLM builds its engine-core client in its constructor; hand it ours.
        make_client = EngineCoreClient.make_async_mp_client
        # a deliberate patch of vLLM's factory, for this constructor only
        EngineCoreClient.make_async_mp_client = staticmethod(lambda *args, **kwargs: client)  # type: ignore[method-assign]
        try:
            super().__init__(
                vllm_config,
                executor_class=Executor.get_class(vllm_config),
                log_stats=True,
                usage_context=UsageContext.OPENAI_API_SERVER,
            )
        finally:
            EngineCoreClient.make_async_mp_client = make_client  # type: ignore[method-assign]


def _follow(lockstep: LockstepCore, context: WorkerContext, stopped: threading.Event) -> None:
    """Another rank: apply rank 0's plans and step, until told to stop."""
    codec = PlanCodec()
    try:
        while (data := context.next_broadcast()) is not None:
            plan = codec.decode(data)
            if plan.stop:
                break
            lockstep.apply(plan)
            lockstep.step()
    except BaseException as exc:
        log.exception("the lmi-dist engine failed")
        lockstep.error = exc
        return
    stopped.set()
    lockstep.core.shutdown()


class RankExecutor(ExecutorWithExternalLauncher):
    """vLLM's external-launcher executor, meeting the other ranks over
    ``tcp://MASTER_ADDR:MASTER_PORT`` instead of ``env://``: the same rendezvous,
    but vLLM's CPU build names its shared memory after the port, which is new at
    every start of the group, so a restarted group never meets the segments a
    killed one left behind (``env://`` gives every group the same names)."""

    def _distributed_args(self) -> tuple[str, int, int]:
        address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        return address, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])


def _unlink_cpu_shared_memory() -> None:
    """Remove the names of this group's CPU all-reduce segments once every rank
    has mapped them (they stay mapped), so that a rank killed later leaves none."""
    for path in glob.glob(f"/dev/shm/{os.environ['MASTER_PORT']}-*cpushm*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class LmiDistEngine(Engine):
    """This rank's engine core; on rank 0 also vLLM's front (``VllmEngine``) around it."""

    requests_on_rank0_only = True
    serves_adapters = True

    def __init__(self, lockstep: LockstepCore, front: VllmEngine | None, thread: threading.Thread | None) -> None:
        self.lockstep = lockstep
        self.front = front  # rank 0
        self.thread = thread  # another rank: following rank 0's plans
        self.stopped = threading.Event()

    @classmethod
    async def start(cls, context: WorkerContext, formatters: Formatters) -> LmiDistEngine:
        chosen = context.settings.passthrough_options().get("distributed_executor_backend", "external_launcher")
        if chosen != "external_launcher":
            raise ValueError(
                f"option.distributed_executor_backend={chosen} does not apply to lmi-dist, whose ranks are "
                f"MPI's (vLLM's external_launcher); drop it, or use option.rolling_batch=vllm in Python mode"
            )
        kwargs = engine_kwargs(context, distributed_executor_backend="external_launcher")
        log.info(
            "rank %d of %d: starting vLLM's engine core with %s",
            context.rank,
            context.world_size,
            redacted_json(kwargs),
        )
        vllm_media.install(context.settings, kwargs)
        started = time.monotonic()
        args = AsyncEngineArgs(**kwargs)
        vllm_config = args.create_engine_config(UsageContext.OPENAI_API_SERVER)
        # Every rank builds its shard at the same time (the collectives of loading meet up).
        core = await asyncio.to_thread(EngineCore, vllm_config, RankExecutor, True)
        _unlink_cpu_shared_memory()
        lockstep = LockstepCore(core)
        log.info("engine core ready in %.1fs", time.monotonic() - started)
        if context.rank == 0:
            client = LeaderClient(lockstep, context, asyncio.get_running_loop())
            engine = LockstepAsyncLLM(vllm_config, client)
            client.start()
            return cls(lockstep, VllmEngine(engine, context, kwargs, formatters), None)
        REGISTRY.register(UnfinishedRequests(lambda: core.scheduler.get_num_unfinished_requests()))
        follower = cls(lockstep, None, None)
        follower.thread = threading.Thread(
            target=_follow, args=(lockstep, context, follower.stopped), name="lmi-dist-follow", daemon=True
        )
        follower.thread.start()
        return follower

    def _rank0_front(self) -> VllmEngine:
        """The front: requests and adapters reach rank 0 alone (``requests_on_rank0_only``)."""
        assert self.front is not None, "only rank 0 has the engine's front"
        return self.front

    async def handle(self, inputs: Input) -> Output | None:
        return await self._rank0_front().handle(inputs)

    async def add_adapter(self, name: str, path: str) -> None:
        """Rank 0's engine front loads it; the LoRA call reaches every rank in the next plan."""
        await self._rank0_front().add_adapter(name, path)

    async def remove_adapter(self, name: str) -> None:
        await self._rank0_front().remove_adapter(name)

    def check_health(self) -> None:
        """Raises once this rank's engine failed: the group restarts."""
        if self.lockstep.error is not None:
            raise EngineDeadError(f"the lmi-dist engine failed: {self.lockstep.error!r}")
        if self.thread is not None and not self.thread.is_alive() and not self.stopped.is_set():
            raise EngineDeadError("this rank stopped following rank 0")

    def shutdown(self) -> None:
        if self.front is not None:
            self.front.shutdown()
