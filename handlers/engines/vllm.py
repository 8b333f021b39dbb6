"""The built-in handler: a causal LM served by vLLM's async engine, with
continuous batching.

Routes, by path and body:

- ``/v1/chat/completions``, or ``/invocations`` with ``messages``: OpenAI chat;
- ``/v1/completions``, or ``/invocations`` with ``prompt``: OpenAI completion;
- ``/invocations`` with ``inputs``: LMI's schema (``handlers.engines.lmi_schema``);
- ``/v1/models``: the served model and its LoRA adapters.

LoRA adapters (``option.enable_lora=true``): ``add_adapter`` / ``remove_adapter``
are called by the worker for what the frontend registered. A request picks one
by LMI's ``adapters`` field (a name, or one per prompt for a list of inputs),
the ``X-Amzn-SageMaker-Adapter-Identifier`` header, or the OpenAI ``model``
field; an unknown name is a 404 naming it.

The OpenAI routes are answered by vLLM's own OpenAI serving classes, run in
this process around the same engine, so their semantics (chat templates,
logprobs, ``n``, usage, SSE ending with ``data: [DONE]``) are vLLM's.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from pydantic import ValidationError
from vllm import envs as vllm_envs
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.serve import create_error_response
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.exceptions import VLLMClientError
from vllm.lora.request import LoRARequest
from vllm.platforms import current_platform
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from container.core.errors import (
    AnswerError,
    HandlerError,
    InputError,
    NotFound,
    OpenAIError,
    OpenAIErrorInfo,
    ServiceUnavailable,
    is_openai_path,
)
from handlers.api import Input, Output, prepend
from handlers.api.context import WorkerContext
from handlers.engines.formatters import formatted
from handlers.engines.lmi_schema import Formatter, Generation, LmiRequest, TokenInfo, finish_reason, parse_request
from handlers.engines.vllm_args import build_engine_kwargs

log = logging.getLogger("sagelmi.vllm")

ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"

_service: VllmService | None = None


class UnfinishedRequests:
    """Prometheus collector ``sagelmi_engine_unfinished_requests``: requests an engine has not
    finished (exact, not sampled), from ``count``. vLLM's ``AsyncLLM`` here; in lmi-dist also the
    engine core of each rank that is not rank 0."""

    def __init__(self, count: Callable[[], int]) -> None:
        self.count = count

    def collect(self):
        gauge = GaugeMetricFamily("sagelmi_engine_unfinished_requests", "Requests the engine is running or has queued")
        gauge.add_metric([], self.count())
        yield gauge


# What vLLM raises on some bodies its schema lets through (fuzzing found `"tool_calls": true`
# and a message parsed as another type): the body's fault, so 400, logged as one line.
_MALFORMED = (TypeError, KeyError, AttributeError, IndexError)


def _malformed(exc: Exception) -> str:
    log.info("vLLM could not take the request: %s: %s", type(exc).__name__, exc)
    return f"the request could not be read ({type(exc).__name__}: {exc}); check the types of its fields"


def _openai_error(
    path: str, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None
) -> Output:
    """vLLM's refusal of an OpenAI body: in OpenAI's envelope on ``/v1/...`` (vLLM's type and
    param kept); on ``/invocations`` raised, so that it gets LMI's envelope like every error there."""
    if not is_openai_path(path):
        raise (
            InputError(message)
            if status == 400
            else NotFound(message)
            if status == 404
            else AnswerError(message, status)
        )
    body = OpenAIError(error=OpenAIErrorInfo(message=message, type=err_type, param=param, code=status))
    return Output(code=status).add_property("content-type", "application/json").add_as_json(body.model_dump())


class VllmService:
    def __init__(self, engine, formatter: Formatter, served_name: str, lora: bool = False) -> None:
        self.engine = engine
        self.served_name = served_name
        self.lora = lora  # option.enable_lora
        self._lora_ids = itertools.count(1)
        self.formatter = formatter
        self.sampling_fields = set(SamplingParams.__struct_fields__)  # a msgspec.Struct in vLLM 0.32
        self._build_openai()
        REGISTRY.register(UnfinishedRequests(engine.get_num_unfinished_requests))

    # -- start and stop
    @classmethod
    async def start(cls, context: WorkerContext) -> VllmService:
        kwargs = engine_kwargs(context)
        log.info("starting vLLM with %s", json.dumps(kwargs, default=str, sort_keys=True))
        started = time.monotonic()
        # Building the engine blocks for tens of seconds: keep the worker's loop free meanwhile.
        engine = await asyncio.to_thread(AsyncLLM.from_engine_args, AsyncEngineArgs(**kwargs))
        log.info("vLLM engine ready in %.1fs", time.monotonic() - started)
        return cls.around(engine, context, kwargs)

    @classmethod
    def around(cls, engine, context: WorkerContext, kwargs: dict) -> VllmService:
        """The service on an engine that is already running (``AsyncLLM`` or one like it)."""
        settings = context.settings
        served = kwargs["served_model_name"]
        return cls(
            engine,
            Formatter(settings.output_formatter, settings.tgi_compat),
            served[0] if isinstance(served, list) else served,
            bool(kwargs.get("enable_lora")),
        )

    def _build_openai(self) -> None:
        self.models = OpenAIServingModels(
            self.engine, [BaseModelPath(name=self.served_name, model_path=self.served_name)]
        )
        renderer = OnlineRenderer(
            model_config=self.engine.model_config,
            renderer=self.engine.renderer,
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
        )
        self.chat = OpenAIServingChat(
            self.engine,
            self.models,
            "assistant",
            online_renderer=renderer,
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
        )
        self.completion = OpenAIServingCompletion(
            self.engine, self.models, online_renderer=renderer, request_logger=None
        )

    def shutdown(self) -> None:
        self.engine.shutdown()

    def check_health(self) -> None:
        if self.engine.errored:
            raise EngineDeadError("the vLLM engine stopped") from self.engine.dead_error

    # -- LoRA adapters (vLLM's OpenAIServingModels holds them, so /v1/models and `model` know them too)
    @property
    def adapters(self) -> dict[str, LoRARequest]:
        return self.models.lora_requests

    async def add_adapter(self, name: str, path: str) -> None:
        """Serve the adapter in ``path`` as ``name`` (loaded now, so a bad one is refused
        now). Raises ``InputError`` when LoRA is off or the engine refuses the adapter."""
        if not self.lora:
            raise InputError(
                "LoRA adapters need option.enable_lora=true (with option.max_lora_rank at least the adapters' rank)"
            )
        known = self.adapters.get(name)
        if known is not None and known.lora_path == path:
            return  # the same registration again (a replay): nothing to do
        request = LoRARequest(lora_name=name, lora_int_id=next(self._lora_ids), lora_path=path)
        self.adapters[name] = request  # before the first await: see container.worker.adapters
        try:
            await self.engine.add_lora(request)
        except Exception as exc:
            if self.adapters.get(name) is request:
                if known is None:
                    del self.adapters[name]
                else:
                    self.adapters[name] = known
            raise InputError(f"the engine cannot load adapter {name!r}: {exc}") from None
        if known is not None:
            await self.engine.remove_lora(known.lora_int_id)

    async def remove_adapter(self, name: str) -> None:
        request = self.adapters.pop(name, None)
        if request is not None:
            await self.engine.remove_lora(request.lora_int_id)

    def _adapter(self, name: Any) -> LoRARequest | None:
        """The adapter ``name`` names (None for no name or the base model's); ``NotFound`` if unknown."""
        if name is None or name == "" or name in (self.served_name, os.path.basename(self.served_name.rstrip("/"))):
            return None  # the base model, by its served name or (as GET /models shows it) its last part
        if not isinstance(name, str):
            raise InputError(f"an adapter is named by a string, not {name!r}")
        request = self.adapters.get(name)
        if request is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise NotFound(f"adapter {name!r} is not registered (registered adapters: {known})")
        return request

    # -- requests
    async def invoke(self, inputs: Input) -> Output:
        """Answer one request, with model.py's ``@input_formatter`` /
        ``@output_formatter`` when it has them (LMI's vLLM signatures: the
        decoded payload and the tokenizer in, a payload out; an answer as a dict
        in, a dict or text out, once per stream chunk when streaming)."""
        input_formatter = inputs.properties.get("input_formatter")  # set by the worker (model.py), exact key
        output_formatter = inputs.properties.get("output_formatter")
        if not callable(input_formatter) and not callable(output_formatter):
            return await self._invoke(inputs)
        if callable(input_formatter) and inputs.request_path != "/v1/models":
            try:
                payload = input_formatter(inputs.get_as_json(), tokenizer=self.engine.tokenizer)
            except InputError:
                raise
            except Exception as exc:
                raise HandlerError(f"Custom formatter failed: {type(exc).__name__}: {exc}") from None
            inputs = Input(
                properties=inputs.properties, body=json.dumps(payload).encode(), request_path=inputs.request_path
            )
        output = await self._invoke(inputs)
        if callable(output_formatter) and output.code < 300:
            output = formatted(output, output_formatter)
        return output

    async def _invoke(self, inputs: Input) -> Output:
        path = inputs.request_path
        if path == "/v1/models":
            listing = await self.models.show_available_models()
            for card in listing.data:  # vLLM's root is a local path (the model's, an adapter's): never shown
                card.root = card.id
            return Output().add_property("content-type", "application/json").add(listing.model_dump_json())
        body = inputs.get_as_json()
        if not isinstance(body, dict):
            raise InputError("the request body must be a JSON object")
        header = inputs.get_property(ADAPTER_HEADER)
        if path == "/v1/chat/completions" or (path == "/invocations" and "messages" in body):
            return await self._openai("chat", body, header, path)
        if path == "/v1/completions" or (path == "/invocations" and "prompt" in body and "inputs" not in body):
            return await self._openai("completion", body, header, path)
        if "inputs" in body:
            return await self._lmi(body, inputs.get_property("requestId"), header)
        raise InputError(
            "the body needs 'inputs' (LMI schema), 'messages' (OpenAI chat) or 'prompt' (OpenAI completion)"
        )

    # -- OpenAI
    def _openai_model(self, model: Any, header: str | None) -> str:
        """The ``model`` vLLM serves the request with: the header's adapter, else the
        body's adapter, else the base model. Without LoRA, whatever name the client
        sends is the one model; with LoRA, an unknown name is a 404."""
        if header:
            model = header
        if not self.lora:
            return self.served_name
        adapter = self._adapter(model)
        return adapter.lora_name if adapter is not None else self.served_name

    async def _openai(self, kind: str, body: dict, header: str | None, path: str) -> Output:
        request_cls, create = (
            (ChatCompletionRequest, self.chat.create_chat_completion)
            if kind == "chat"
            else (CompletionRequest, self.completion.create_completion)
        )
        body = {**body, "model": self._openai_model(body.get("model"), header)}
        try:
            request = request_cls.model_validate(body)
        except ValidationError as exc:
            detail = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            return _openai_error(path, 400, detail)
        except VLLMClientError as exc:  # vLLM's own validators raise it, not a ValueError pydantic collects
            return _openai_error(path, 400, str(exc), param=getattr(exc, "parameter", None))
        except _MALFORMED as exc:  # a vLLM validator tripping over a body of the wrong shape
            return _openai_error(path, 400, _malformed(exc))
        try:
            result = await create(request, None)
        except (VLLMClientError, ValueError) as exc:  # vLLM's request validation
            result = create_error_response(exc)
        except _MALFORMED as exc:  # vLLM's chat renderer tripping over a message of a shape it accepted
            return _openai_error(path, 400, _malformed(exc))
        if isinstance(result, ErrorResponse):
            return _openai_error(path, result.error.code, result.error.message, result.error.type, result.error.param)
        if hasattr(result, "model_dump_json"):
            return Output().add_property("content-type", "application/json").add(result.model_dump_json())
        return (
            Output().add_property("content-type", "text/event-stream; charset=utf-8").add_stream_content(result, None)
        )

    # -- LMI
    def _lmi_adapters(self, body: dict, header: str | None, prompts: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt: LMI's ``adapters`` field (a name, or a list
        as long as a list of inputs), else the SageMaker header."""
        names = body.get("adapters", header)
        if isinstance(names, list):
            if len(names) != prompts:
                raise InputError(f"'adapters' has {len(names)} names for {prompts} inputs; give one per input")
            return [self._adapter(n) for n in names]
        return [self._adapter(names)] * prompts

    async def _lmi(self, body: dict, inference_id: str | None, header: str | None = None) -> Output:
        request = parse_request(body, self.sampling_fields, vllm_envs.VLLM_MAX_STOP_STRINGS)
        loras = self._lmi_adapters(body, header, len(request.prompts))
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        try:
            sampling = SamplingParams(**request.sampling, output_kind=kind)
        except (VLLMClientError, ValueError, TypeError) as exc:  # a passed-through name got a wrong value
            raise InputError(f"invalid generation parameters: {exc}") from None
        tag = inference_id or uuid.uuid4().hex
        if not request.stream:
            top_n = request.parameters.top_n_tokens
            generations = await asyncio.gather(
                *(
                    self._complete(p, sampling, f"{tag}-{i}", top_n, lora)
                    for i, (p, lora) in enumerate(zip(request.prompts, loras))
                )
            )
            return Output().add_as_json(self.formatter.body(list(generations), request))
        outputs = self._generate(request.prompts[0], sampling, tag, loras[0])
        first = await anext(outputs)  # errors before the first token become a 400, not a broken stream
        return (
            Output()
            .add_property("content-type", self.formatter.stream_content_type)
            .add_stream_content(self._stream(request, first, outputs), None)
        )

    async def _generate(
        self, prompt: str, sampling, request_id: str, lora: LoRARequest | None = None
    ) -> AsyncIterator[Any]:
        engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        try:
            async for output in self.engine.generate(prompt, sampling, engine_id, lora_request=lora):
                yield output
        except EngineDeadError:
            raise ServiceUnavailable("the engine stopped; the worker group is being restarted, retry") from None
        except Exception as exc:
            # vLLM aborts only what its own generate() registered: a request refused on its way
            # to the engine core (a value msgpack cannot carry) stays in its output processor.
            await self._abort(engine_id)
            if isinstance(exc, VLLMClientError):
                raise InputError(str(exc)) from None
            raise

    async def _abort(self, engine_id: str) -> None:
        try:
            await self.engine.abort(engine_id)
        except Exception as exc:  # the engine is going away: nothing is left to free
            log.warning("could not abort engine request %s: %s", engine_id, exc)

    async def _complete(
        self, prompt: str, sampling, request_id: str, top_n: int, lora: LoRARequest | None = None
    ) -> Generation:
        gen = Generation(prompt=prompt)
        async for output in self._generate(prompt, sampling, request_id, lora):
            self._absorb(gen, output, top_n)
        return gen

    def _absorb(self, gen: Generation, output, top_n: int) -> list[TokenInfo]:
        """Add one (delta or final) engine output to ``gen``; return its new tokens."""
        completion = output.outputs[0]
        new = []
        for i, token_id in enumerate(completion.token_ids):
            # vLLM: the sampled token first, then the top-k candidates (ranks 1..k)
            logprobs = completion.logprobs[i] if completion.logprobs else {}
            chosen = logprobs.get(token_id)
            text = (
                chosen.decoded_token
                if chosen is not None and chosen.decoded_token is not None
                else self.engine.tokenizer.decode([token_id])
            )
            ranked = sorted((lp.rank, tid, lp) for tid, lp in logprobs.items() if lp.rank and lp.rank <= top_n)
            top = [TokenInfo(tid, lp.decoded_token or "", lp.logprob) for _, tid, lp in ranked]
            new.append(TokenInfo(token_id, text, chosen.logprob if chosen is not None else None, top))
        gen.tokens.extend(new)
        gen.text += completion.text
        if output.prompt_logprobs and not gen.prefill:
            for token_id, lps in zip(output.prompt_token_ids, output.prompt_logprobs):
                lp = (lps or {}).get(token_id)
                gen.prefill.append(
                    TokenInfo(
                        token_id, self.engine.tokenizer.decode([token_id]), lp.logprob if lp is not None else None
                    )
                )
        if output.finished:
            gen.finish_reason = finish_reason(completion.finish_reason, completion.stop_reason)
        return new

    async def _stream(self, request: LmiRequest, first, outputs: AsyncIterator[Any]) -> AsyncIterator[bytes]:
        gen = Generation(prompt=request.prompts[0])
        params = request.parameters
        async for output in prepend(first, outputs):
            tokens = self._absorb(gen, output, params.top_n_tokens)
            for i, token in enumerate(tokens):
                yield self.formatter.stream_item(token, gen, params, last=output.finished and i == len(tokens) - 1)
            if output.finished and not tokens:
                yield self.formatter.stream_item(None, gen, params, last=True)


def engine_kwargs(context: WorkerContext, **overrides: Any) -> dict[str, Any]:
    """``AsyncEngineArgs`` keyword arguments for this worker group."""
    launch = context.launch
    kwargs = build_engine_kwargs(
        context.settings, launch.model_location, launch.tensor_parallel_degree, cpu=current_platform.is_cpu()
    )
    return {**kwargs, **overrides}


async def initialize(context: WorkerContext) -> None:
    global _service
    _service = await VllmService.start(context)


async def handle(inputs: Input) -> Output | None:
    if inputs.is_empty():
        return None
    return await _service.invoke(inputs)


async def add_adapter(name: str, path: str) -> None:
    await _service.add_adapter(name, path)


async def remove_adapter(name: str) -> None:
    await _service.remove_adapter(name)


def check_health() -> None:
    """Raises once the engine is dead (its EngineCore process gone): the group restarts."""
    if _service is not None:
        _service.check_health()


def shutdown() -> None:
    """Stop the engine (and its processes) when the worker stops."""
    if _service is not None:
        _service.shutdown()
