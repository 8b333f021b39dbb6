"""LMI's schema on the vLLM engine: ``{"inputs": ..., "parameters": ...}`` in, LMI's answer out
(``handlers.engines.lmi_schema``), whole or streamed token by token; or, with a ``model.py``'s
rolling-batch ``@output_formatter`` (``handlers.engines.rolling_formatter``), the texts it makes
of each token."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, cast

from vllm import envs as vllm_envs
from vllm.exceptions import VLLMClientError
from vllm.lora.request import LoRARequest
from vllm.renderers.inputs.preprocess import parse_model_prompt
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from vllm.v1.engine.exceptions import EngineDeadError

from container.core.errors import InputError, ServiceUnavailable
from container.core.request_priority import HEADER as PRIORITY_HEADER
from container.core.request_priority import check_allowed
from handlers.api import Output
from handlers.engines.lmi_schema import Formatter, Generation, LmiRequest, TokenInfo, finish_reason, parse_request
from handlers.engines.rolling_formatter import RequestFormatting, RollingBatchFormatter
from handlers.engines.vllm_adapters import Adapters
from handlers.engines.vllm_observe import counted

log = logging.getLogger("sagelmi.vllm")
ENGINE_STOPPED = "the engine stopped; the worker group is being restarted, retry"
# What a rolling-batch @output_formatter answers is its own text (LMI labels it with no type).
FORMATTED_TEXT = "text/plain; charset=utf-8"


class LmiFront:
    def __init__(self, engine: Any, formatter: Formatter, adapters: Adapters, priority_scheduling: bool) -> None:
        self.engine = engine
        self.formatter = formatter
        self.adapters = adapters
        self.priority_scheduling = priority_scheduling  # option.scheduling_policy=priority
        self.sampling_fields = set(SamplingParams.__struct_fields__)  # a msgspec.Struct in vLLM 0.32

    async def answer(
        self,
        body: dict,
        inference_id: str | None,
        header: str | None = None,
        rolling: RollingBatchFormatter | None = None,
        priority: int | None = None,
    ) -> Output:
        """Answer an LMI body: whole, or a stream of token lines; with ``rolling``, the texts that
        formatter makes of the tokens (one prompt per request, as in LMI's rolling batch).
        ``priority``: the request's ``X-Priority``, which wins over ``parameters.priority``."""
        request = parse_request(body, self.sampling_fields, vllm_envs.VLLM_MAX_STOP_STRINGS)
        where = PRIORITY_HEADER
        if priority is None:
            priority, where = request.parameters.priority or 0, "parameters.priority"
        if priority:  # 0 (none named) is always allowed
            check_allowed(priority, where, self.priority_scheduling)
        if rolling is not None and request.batched:
            raise InputError(
                "'inputs' must be one prompt (a string): model.py's @output_formatter takes one "
                "TextGenerationOutput per request, as in LMI's rolling batch"
            )
        if header or "adapters" in body:
            loras = self.adapters.for_lmi(body, header, len(request.prompts))
        else:  # no adapter named: the base model for every prompt
            loras = [None] * len(request.prompts)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        arguments = dict(request.sampling)
        structured = "structured_outputs" in arguments
        if structured:
            arguments["structured_outputs"] = _structured_params(arguments["structured_outputs"])
        try:
            sampling = SamplingParams(**arguments, output_kind=kind)
        except (VLLMClientError, ValueError, TypeError) as exc:  # a passed-through name got a wrong value
            raise InputError(f"invalid generation parameters: {exc}") from None
        tag = inference_id or uuid.uuid4().hex
        try:
            if not request.stream:
                top_n = request.parameters.top_n_tokens
                generations = await asyncio.gather(
                    *(
                        self._complete(p, sampling, f"{tag}-{i}", top_n, lora, priority)
                        for i, (p, lora) in enumerate(zip(request.prompts, loras))
                    )
                )
                if rolling is not None:
                    (gen,) = generations
                    formatting = self._formatting(rolling, body, gen.prompt, inference_id)
                    text = b"".join(formatting.tokens(gen.tokens, gen.finish_reason, True, gen.prefill))
                    return Output().add_property("content-type", FORMATTED_TEXT).add(text)
                return Output().add_as_json(self.formatter.body(list(generations), request))
            # what the engine refuses (a prompt too long, a grammar it cannot make) is a 400, not a
            # broken stream; the headers then go out while the engine works on the first token
            outputs = await self._submit(request.prompts[0], sampling, tag, loras[0], priority)
        except InputError as exc:
            if structured:  # the engine could not make a grammar of it (an invalid schema, regex ...)
                raise InputError(f"parameters.structured_outputs: {_engine_message(str(exc))}") from None
            raise
        if rolling is not None:
            formatting = self._formatting(rolling, body, request.prompts[0], inference_id)
            return (
                Output()
                .add_property("content-type", FORMATTED_TEXT)
                .add_stream_content(self._formatted_stream(request, outputs, formatting), None)
            )
        return (
            Output()
            .add_property("content-type", self.formatter.stream_content_type)
            .add_stream_content(self._stream(request, outputs), None)
        )

    @staticmethod
    def _formatting(
        rolling: RollingBatchFormatter, body: dict, prompt: str, inference_id: str | None
    ) -> RequestFormatting:
        parameters = body.get("parameters")
        return rolling.start(prompt, parameters if isinstance(parameters, dict) else {}, inference_id)

    async def _submit(
        self, prompt: str, sampling, request_id: str, lora: LoRARequest | None = None, priority: int = 0
    ) -> AsyncIterator[Any]:
        """Hand one prompt to the engine (scheduled by ``priority``, with priority scheduling);
        its outputs as they come. What the engine refuses is raised here, before any of them."""
        engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        try:
            # rendered (tokenized, checked against max_model_len) as vLLM's serving classes do: a
            # raw prompt is rendered the same way inside add_request, with a deprecation warning
            renderer = self.engine.renderer
            (engine_input,) = renderer.render_cmpl([parse_model_prompt(renderer.model_config, prompt)])
            collector = await self.engine.add_request(
                engine_id, engine_input, sampling, lora_request=lora, priority=priority
            )
        except EngineDeadError:
            raise ServiceUnavailable(ENGINE_STOPPED) from None
        except Exception as exc:
            # a request refused on its way to the engine core (a value msgpack cannot carry)
            # may stay in vLLM's output processor: abort frees it
            await self._abort(engine_id)
            if isinstance(exc, VLLMClientError):
                raise InputError(str(exc)) from None
            raise
        return counted(self._outputs(collector, engine_id), sampling)

    async def _outputs(self, collector, engine_id: str) -> AsyncIterator[Any]:
        """The engine's outputs for one request, to the last; the engine stops working on it
        if this ends any other way (the client left, the stream was closed, an error)."""
        finished = False
        try:
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                yield output
        except EngineDeadError:
            raise ServiceUnavailable(ENGINE_STOPPED) from None
        except BaseException as exc:  # cancelled, closed early (GeneratorExit) or failed
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
        self, prompt: str, sampling, request_id: str, top_n: int, lora: LoRARequest | None = None, priority: int = 0
    ) -> Generation:
        gen = Generation(prompt=prompt)
        async for output in await self._submit(prompt, sampling, request_id, lora, priority):
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

    async def _stream(self, request: LmiRequest, outputs: AsyncIterator[Any]) -> AsyncIterator[bytes]:
        gen = Generation(prompt=request.prompts[0])
        params = request.parameters
        async for output in outputs:
            tokens = self._absorb(gen, output, params.top_n_tokens)
            for i, token in enumerate(tokens):
                yield self.formatter.stream_item(token, gen, params, last=output.finished and i == len(tokens) - 1)
            if output.finished and not tokens:
                yield self.formatter.stream_item(None, gen, params, last=True)

    async def _formatted_stream(
        self, request: LmiRequest, outputs: AsyncIterator[Any], formatting: RequestFormatting
    ) -> AsyncIterator[bytes]:
        """The formatter's text for each token as the engine makes it; closing ``outputs`` when
        this ends (the formatter failed, the client left) stops the engine's work on the request."""
        gen = Generation(prompt=request.prompts[0])
        async with aclosing(cast(AsyncGenerator[Any, None], outputs)):  # _submit's: an async generator
            async for output in outputs:
                tokens = self._absorb(gen, output, request.parameters.top_n_tokens)
                for text in formatting.tokens(tokens, gen.finish_reason, output.finished, gen.prefill):
                    if text:
                        yield text


_STRUCTURED_FIELDS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams) if f.init)
# "[20:14:51] /project/cpp/json_schema_converter.cc:4944: " before xgrammar's own message
_NATIVE_PREFIX = re.compile(r"\[[0-9:]+\] \S+:\d+: ")


def _structured_params(fields: dict[str, Any]) -> StructuredOutputsParams:
    """vLLM's structured-output parameters from their fields; ``InputError`` naming a bad one."""
    unknown = sorted(set(fields) - set(_STRUCTURED_FIELDS))
    if unknown:
        raise InputError(f"parameters.structured_outputs.{unknown[0]} is not one of {', '.join(_STRUCTURED_FIELDS)}")
    try:
        return StructuredOutputsParams(**fields)
    except (VLLMClientError, TypeError, ValueError) as exc:
        raise InputError(f"parameters.structured_outputs: {exc}") from None


def _engine_message(text: str) -> str:
    return _NATIVE_PREFIX.sub("", text).strip()
