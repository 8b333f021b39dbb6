"""The built-in handler: a causal LM served by vLLM's async engine, with
continuous batching.

Routes, by path and, on ``/invocations``, by the body's fields (the first that fits, in this
order: ``handlers.engines.invocation_forms``):

- ``/v1/chat/completions``, or ``/invocations`` with ``messages``: OpenAI chat;
- ``/invocations`` with ``inputs``: LMI's schema (``handlers.engines.lmi_schema``);
- ``/v1/completions``, or ``/invocations`` with ``prompt``: OpenAI completion;
- ``/invocations`` with ``requestType`` (``NEW_SESSION``, ``CLOSE``): SageMaker's stateful
  sessions (``handlers.engines.sessions``); a request naming a session must name a live one;
- ``/v1/responses``: OpenAI's Responses API; ``/v1/messages``, ``/v1/messages/count_tokens``:
  Anthropic's Messages API (vLLM's serving classes for both; errors in Anthropic's envelope there);
- ``/v1/models``: the served model and its LoRA adapters;
- on a pooling model (vLLM's pooling runner: ``option.task=text-embedding`` ...):
  ``/v1/embeddings``, ``/v1/score``, ``/v1/rerank`` and, on ``/invocations``, their forms, vLLM's
  classification and pooling forms and LMI's embedding form (``handlers.engines.vllm_pooling``);
  generation routes are refused there, and pooling routes on a generation model, with a 400
  naming the task.

LoRA adapters (``option.enable_lora=true``): ``add_adapter`` / ``remove_adapter``
are called by the worker for what the frontend registered. A request picks one
by LMI's ``adapters`` field (a name, or one per prompt for a list of inputs),
the ``X-Amzn-SageMaker-Adapter-Identifier`` header, or the OpenAI ``model``
field (``handlers.engines.vllm_adapters``); an unknown name is a 404 naming it.

The engine (``VllmEngine``) starts vLLM and routes each request; the OpenAI
schema is ``handlers.engines.vllm_openai`` (vLLM's own serving classes), LMI's
``handlers.engines.vllm_lmi``, the adapters ``handlers.engines.vllm_adapters``,
a ``model.py``'s formatters ``handlers.engines.formatters`` (and its rolling-batch
``@output_formatter``, ``handlers.engines.rolling_formatter``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.platforms import current_platform
from vllm.v1.engine.exceptions import EngineDeadError

from container.core import proc
from container.core.chat_options import chat_options
from container.core.errors import InputError, one_line
from container.core.logs import redacted_json
from container.core.request_priority import HEADER as PRIORITY_HEADER
from container.core.request_priority import parse_priority
from container.core.served_names import served_names
from container.core.sessions import SESSION_ID
from handlers.api import Input, Output
from handlers.api.context import WorkerContext
from handlers.api.engine import Engine, Formatters
from handlers.engines import vllm_media, vllm_platform
from handlers.engines.formatters import format_request, formatted, unbound
from handlers.engines.invocation_forms import GENERATION_KINDS, check_prompt_count, invocation_kind
from handlers.engines.lmi_schema import Formatter
from handlers.engines.rolling_formatter import RollingBatchFormatter, takes_request_output
from handlers.engines.sessions import EngineSessions
from handlers.engines.vllm_adapters import ADAPTER_HEADER, Adapters
from handlers.engines.vllm_args import build_engine_kwargs, node_kwargs, usage_context
from handlers.engines.vllm_lmi import LmiFront
from handlers.engines.vllm_observe import ObservedAsyncLLM
from handlers.engines.vllm_openai import OpenAIFront, _openai_error
from handlers.engines.vllm_pooling import POOLING_PATHS, PoolingFront

log = logging.getLogger("sagelmi.vllm")

# How long vLLM's processes get to stop on their own before vLLM kills them (its defaults, 5 s each,
# are shorter than their teardown, even on an idle machine: every stop logged vLLM's force kill). Within
# the worker's own stop (container.worker.runtime.SHUTDOWN_TIMEOUT): the EngineCore's wait for its
# rank workers (vLLM's VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, unless set), then the EngineCore's own exit.
WORKERS_STOP_SECONDS = 12
ENGINE_STOP_SECONDS = 20.0

# The generation routes besides /invocations and the kind of body each takes: vLLM's OpenAI chat and
# completion, and its Responses and Anthropic Messages serving classes
OPENAI_PATHS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
}
CONVERSATION_KINDS = frozenset({"responses", "messages", "count_tokens"})  # the Responses and Messages kinds


class UnfinishedRequests:
    """Prometheus collector ``sagelmi_engine_unfinished_requests``: requests an engine has not
    finished (exact, not sampled), from ``count`` (vLLM's ``AsyncLLM``)."""

    def __init__(self, count: Callable[[], int]) -> None:
        self.count = count

    def collect(self):
        gauge = GaugeMetricFamily("sagelmi_engine_unfinished_requests", "Requests the engine is running or has queued")
        gauge.add_metric([], self.count())
        yield gauge


def engine_kwargs(context: WorkerContext, **overrides: Any) -> dict[str, Any]:
    """``AsyncEngineArgs`` keyword arguments for this worker group."""
    launch = context.launch
    kwargs = build_engine_kwargs(
        context.settings, launch.model_location, launch.tensor_parallel_degree, cpu=current_platform.is_cpu()
    )
    if launch.nodes is not None:  # node 0 of vLLM's executor across a cluster (handlers.engines.vllm_node)
        kwargs.update(node_kwargs(launch.nodes))
    return {**kwargs, **overrides}


async def _abandon(building: asyncio.Future) -> None:
    """A stop while vLLM is still starting (``start`` cancelled): the processes this one started (vLLM's
    EngineCore, which stops its own workers) are told to stop (SIGTERM, once each; one started
    meanwhile is told too), until the build gives up; an engine that got ready meanwhile is shut down. Without this
    the build would run to the end, minutes for a large model, before the stop could begin."""
    deadline = time.monotonic() + ENGINE_STOP_SECONDS
    told: set[int] = set()
    while not building.done() and time.monotonic() < deadline:
        for pid in [child for child, parent in proc.parents().items() if parent == os.getpid()]:
            if pid not in told:
                told.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        await asyncio.wait({building}, timeout=0.5)
    if not building.done() or building.cancelled():
        return
    failed = building.exception()
    if failed is None:
        await asyncio.to_thread(building.result().shutdown, timeout=ENGINE_STOP_SECONDS)
    else:
        log.info("vLLM's start ended with the stop: %s", one_line(failed))


async def _cancelled(task: asyncio.Task) -> None:
    """Cancel ``task`` and wait until it has stopped."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class EngineProcessGone(RuntimeError):
    """One of vLLM's processes on this machine ended: the engine cannot go on."""


class VllmEngine(Engine):
    serves_adapters = True

    def __init__(self, engine: Any, context: WorkerContext, kwargs: dict, formatters: Formatters) -> None:
        """The engine contract on a vLLM engine that is already running (``AsyncLLM`` or one like it)."""
        settings = context.settings
        served = kwargs["served_model_name"]
        self.engine = engine
        engine.trace_requests = bool(kwargs.get("otlp_traces_endpoint"))
        self.served_name = served[0] if isinstance(served, list) else served
        self.input_formatter = unbound(formatters.input) if formatters.input is not None else None
        # model.py's @output_formatter: LMI's rolling-batch form (per token, on LMI-schema requests)
        # or sagelmi's answer-as-a-dict form (on every answer)
        self.rolling_formatter: RollingBatchFormatter | None = None
        self.answer_formatter = formatters.output
        if formatters.output is not None and takes_request_output(formatters.output):
            self.rolling_formatter = RollingBatchFormatter(formatters.output, settings.tgi_compat, engine.tokenizer)
            self.answer_formatter = None
            log.info("%s", self.rolling_formatter.describe())
        scheduled = settings.priority_scheduling  # requests may name a priority (container.core.request_priority)
        self.openai = OpenAIFront(engine, self.served_name, chat_options(settings), settings.model_dir, scheduled)
        names = (self.served_name, served_names(settings, context.launch.model_location).management)
        self.adapters = Adapters(engine, self.openai.models, names, bool(kwargs.get("enable_lora")))
        self.lmi = LmiFront(engine, Formatter(settings.output_formatter, settings.tgi_compat), self.adapters, scheduled)
        self.sessions = EngineSessions(settings)
        self.max_prompts = settings.max_prompts_per_request
        self.task = f"option.task={settings.task}" if settings.task else "option.task unset"
        self.pooling: PoolingFront | None = None
        if engine.model_config.runner_type == "pooling":
            task = self.task if settings.task else "option.runner=pooling"
            self.pooling = PoolingFront(
                engine, self.openai.models, task, settings.normalize, settings.trust_request_mm_kwargs, scheduled
            )
        REGISTRY.register(UnfinishedRequests(engine.get_num_unfinished_requests))
        # vLLM's processes on this machine (EngineCore, a worker per rank): when a worker dies, vLLM's
        # executor gives the others seconds to stop before its EngineCore reports the engine dead
        self.processes = proc.titled(proc.descendants([os.getpid()]), "VLLM::")

    @classmethod
    async def start(cls, context: WorkerContext, formatters: Formatters) -> VllmEngine:
        # read in vLLM's EngineCore process, which inherits this environment
        os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(WORKERS_STOP_SECONDS))
        vllm_platform.check()
        kwargs = engine_kwargs(context)
        log.info("starting vLLM with %s", redacted_json(kwargs))
        vllm_media.install(context.settings, kwargs)
        started = time.monotonic()
        # Building the engine blocks for tens of seconds: keep the worker's loop free meanwhile.
        building = asyncio.get_running_loop().run_in_executor(
            None, lambda: ObservedAsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), usage_context=usage_context())
        )
        try:
            engine = await asyncio.shield(building)
        except asyncio.CancelledError:
            await _abandon(building)
            raise
        log.info("vLLM engine ready in %.1fs", time.monotonic() - started)
        served = cls(engine, context, kwargs, formatters)
        try:
            await served.warm_up()
        except asyncio.CancelledError:
            await asyncio.to_thread(served.shutdown)
            raise
        return served

    async def warm_up(self) -> None:
        """Answer one LMI request of one token before the worker says it is ready. vLLM compiles
        (``torch.compile``) the function that ranks a sampled token the first time a request asks
        for log probabilities, as every LMI request does: seconds with a warm compile cache, tens of
        seconds in a new container, which the first request would otherwise wait for. A pooling
        model samples nothing."""
        if self.pooling is not None:
            return
        started = time.monotonic()
        try:
            await self.lmi.answer({"inputs": "Hello", "parameters": {"max_new_tokens": 1}}, "sagelmi-warm-up")
        except Exception as exc:  # noqa: BLE001 - the engine serves without it; its health check sees a dead one
            log.warning(
                "vLLM's warm-up request failed (the first request asking for log probabilities compiles instead): %s",
                one_line(exc),
            )
            return
        log.info("vLLM answered a warm-up request (token log probabilities) in %.1fs", time.monotonic() - started)

    def shutdown(self) -> None:
        """Stop vLLM (the worker calls this in a thread while its loop runs). ``AsyncLLM.shutdown`` stops
        the EngineCore first and its output handler only after it: that task, running on the loop
        meanwhile, would see the EngineCore exit and log it as a failure with a traceback. So the
        handler is stopped first."""
        handler = getattr(self.engine, "output_handler", None)
        if handler is not None and not handler.done():
            try:
                asyncio.run_coroutine_threadsafe(_cancelled(handler), handler.get_loop()).result(5)
            except Exception:  # noqa: BLE001 - the engine's stop goes on
                log.debug("vLLM's output handler did not stop", exc_info=True)
        self.engine.shutdown(timeout=ENGINE_STOP_SECONDS)

    def check_health(self) -> None:
        """Raises once the engine is dead (vLLM says so, or one of its processes here is gone): the
        group restarts."""
        if self.engine.errored:
            raise EngineDeadError("the vLLM engine stopped") from self.engine.dead_error
        for pid, title in self.processes.items():
            if not proc.running(pid):
                raise EngineProcessGone(f"vLLM's process {title} (pid {pid}) is gone")

    async def add_adapter(self, name: str, path: str) -> None:
        await self.adapters.add(name, path)

    async def remove_adapter(self, name: str) -> None:
        await self.adapters.remove(name)

    async def handle(self, inputs: Input) -> Output | None:
        """Answer one request, with model.py's ``@input_formatter`` /
        ``@output_formatter`` when it has them (``handlers.engines.formatters``: the
        decoded payload or the ``Input`` in, a payload out; a rolling-batch
        ``TextGenerationOutput`` per token, or an answer as a dict, in; text out)."""
        if inputs.is_empty():
            return None
        session_id = inputs.get_property(SESSION_ID)
        if session_id is not None:  # a request naming a stateful session: it must be one this group holds
            self.sessions.check(session_id)
        output = await self._route(inputs)
        if self.answer_formatter is not None and output.code < 300:
            output = formatted(output, self.answer_formatter)
        return output

    async def _route(self, inputs: Input) -> Output:
        path = inputs.request_path
        if path == "/v1/models":
            return await self.openai.models_listing()
        if self.input_formatter is not None:  # the body as parsed, formatted once: not re-encoded and parsed again
            body = format_request(self.input_formatter, inputs, self.engine.tokenizer)
        else:
            body = inputs.get_as_json()
        if not isinstance(body, dict):
            raise InputError("the request body must be a JSON object")
        header = inputs.get_property(ADAPTER_HEADER)
        raw = inputs.get_property(PRIORITY_HEADER)  # X-Priority: the worker refused a bad one already
        priority = parse_priority(raw) if raw is not None else None
        if path in ("/tokenize", "/detokenize"):
            return await self._openai(path[1:], body, header, path)
        if path == "/invocations":
            served = await self.pooling.served() if self.pooling is not None else GENERATION_KINDS
            kind = invocation_kind(body, served, pooling=self.pooling is not None)
        else:
            kind = POOLING_PATHS.get(path) or OPENAI_PATHS.get(path)
        if self.pooling is not None:
            if kind is None or kind in OPENAI_PATHS.values():
                return self._wrong_task(path, f"{self.pooling.task}, a pooling model (vLLM's pooling runner)")
            check_prompt_count(body, kind, self.max_prompts)
            model = self.adapters.for_openai(body.get("model"), header)
            return await self.pooling.answer(kind, {**body, "model": model}, path, priority)
        if kind in POOLING_PATHS.values():
            return self._wrong_task(path, f"text generation ({self.task})")
        if kind == "chat" or kind in CONVERSATION_KINDS:  # one conversation a request: no prompt count to check
            return await self._openai(kind, body, header, path, priority)
        if kind == "completion":
            check_prompt_count(body, "completion", self.max_prompts)
            return await self._openai("completion", body, header, path, priority)
        if kind == "lmi":
            check_prompt_count(body, "lmi", self.max_prompts)
            return await self.lmi.answer(
                body, inputs.get_property("requestId"), header, self.rolling_formatter, priority
            )
        if kind == "session":
            return self.sessions.answer(inputs, body)
        raise InputError(
            "the body needs 'inputs' (LMI schema), 'messages' (OpenAI chat) or 'prompt' (OpenAI completion)"
        )

    def _wrong_task(self, path: str, served: str) -> Output:
        """A 400 for a route the model's task does not serve (generation on a pooling model, or
        pooling on a generation model)."""
        routes = (
            "/v1/embeddings, /v1/score, /v1/rerank, /invocations with 'inputs' (LMI's embedding form), "
            "'input', 'messages', 'query' or 'queries'"
            if self.pooling is not None
            else "/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /invocations"
        )
        message = f"{path} does not serve this model: it is served for {served}; its routes are {routes}"
        return _openai_error(path, 400, message)

    async def _openai(
        self, kind: str, body: dict, header: str | None, path: str, priority: int | None = None
    ) -> Output:
        body = {**body, "model": self.adapters.for_openai(body.get("model"), header)}
        return await self.openai.answer(kind, body, path, priority)
