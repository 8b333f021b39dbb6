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
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.core_client import EngineCoreClient
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.executor import Executor
from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

from handlers.api import Input, Output
from handlers.api.context import WorkerContext
from handlers.api.engine import Engine, Formatters
from handlers.engines import vllm_media
from handlers.engines.vllm import UnfinishedRequests, VllmEngine, engine_kwargs

log = logging.getLogger("sagelmi.lmi_dist")


@dataclass
class Plan:
    """What every rank does before its next engine step, in order: ``("add",
    EngineCoreRequest)``, ``("abort", [request ids])`` or ``("call", method, args)``
    (LoRA and cache operations). ``stop`` ends the stepping."""

    ops: list[tuple] = field(default_factory=list)
    stop: bool = False


class LockstepCore:
    """An engine core stepped in this process, the same way on every rank."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.error: BaseException | None = None

    def has_work(self) -> bool:
        return self.core.scheduler.has_requests() or bool(self.core.batch_queue)

    def apply(self, plan: Plan) -> list[Any]:
        """Apply the plan's operations; returns the results of its calls."""
        results = []
        for op in plan.ops:
            if op[0] == "add":
                request, wave = self.core.preprocess_add_request(op[1])
                self.core.add_request(request, wave)
            elif op[0] == "abort":
                self.core.abort_requests(op[1])
            else:  # a failing call (a bad LoRA adapter ...) is that call's error, not the engine's
                try:
                    results.append(getattr(self.core, op[1])(*op[2]))
                except Exception as exc:
                    results.append(exc)
        return results

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
        self._ops: list[tuple] = []
        self._calls: list[asyncio.Future] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._thread = threading.Thread(target=self._run, name="lmi-dist-steps", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- what AsyncLLM calls
    async def add_request_async(self, request) -> None:
        self._queue(("add", request))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            self._queue(("abort", list(request_ids)))

    async def get_output_async(self) -> EngineCoreOutputs:
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            raise EngineDeadError("the lmi-dist engine stopped") from item
        return item

    async def get_supported_tasks_async(self):
        return self.lockstep.core.get_supported_tasks()

    async def _call(self, method: str, *args) -> Any:
        future = self.loop.create_future()
        self._queue(("call", method, args), future)
        return await future

    async def add_lora_async(self, lora_request) -> bool:
        return await self._call("add_lora", lora_request)

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
    def _queue(self, op: tuple, future: asyncio.Future | None = None) -> None:
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
                self.context.broadcast(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
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
    try:
        while (data := context.next_broadcast()) is not None:
            plan: Plan = pickle.loads(data)
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
            json.dumps(kwargs, default=str, sort_keys=True),
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
