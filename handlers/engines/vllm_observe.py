"""The vLLM engine's part in observing a request (``handlers.api.usage``): the outputs of a
request being handled count its prompt's tokens and the tokens generated, and, when vLLM
traces on its own (``option.otlp_traces_endpoint``), the request reaches vLLM with the worker
span's ``traceparent`` as ``trace_headers``, so vLLM's ``llm_request`` span joins the request's
trace. Every route goes through it: vLLM's OpenAI serving classes call ``generate``; LMI's front
calls ``add_request`` (its stream's headers go out once the engine has taken the request) and
counts the outputs with ``counted``. The built-in engine is an ``ObservedAsyncLLM``.

An OpenAI stream's head waits for the engine too (``started``): vLLM's serving classes add
the request on the stream's first item, and the worker sends the head as soon as the handler
returns, which wakes the frontend for the headers and the socket's hand-over. Asked for
first, the engine has the request before they take the CPU: the head going first would put the
frontend's work and the worker's in series before the prefill."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Any

from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from handlers.api.io import Ahead
from handlers.api.usage import RequestUsage, current_usage

# Set (to None) once the engine has taken a request of the stream being started (``started``)
_taken: ContextVar[asyncio.Future | None] = ContextVar("sagelmi_engine_taken", default=None)


class Observed:
    """An engine class with ``AsyncLLM``'s two ways in (``generate``, which calls ``add_request``
    through the instance, and ``add_request``), observed: both carry the trace headers when
    ``trace_requests`` (vLLM traces on its own), both say when the engine has a stream's request
    (``started``), and ``generate``'s outputs are counted. Listed before the engine class among a
    subclass's bases (``ObservedAsyncLLM``)."""

    trace_requests = False

    def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        # not a generator of its own: a pass per output on top of vLLM's, on every token
        params = args[1] if len(args) > 1 else kwargs.get("sampling_params")
        return counted(super().generate(*args, **kwargs), params)  # type: ignore[misc]

    async def add_request(self, *args: Any, **kwargs: Any) -> Any:
        if self.trace_requests:
            usage = current_usage.get()
            if usage is not None and usage.trace_headers and not kwargs.get("trace_headers"):
                kwargs["trace_headers"] = usage.trace_headers
        result = await super().add_request(*args, **kwargs)  # type: ignore[misc]
        waiter = _taken.get()
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return result


class ObservedAsyncLLM(Observed, AsyncLLM):  # type: ignore[misc]  # generate: an async iterator, as vLLM's
    """vLLM's engine, observed (``AsyncLLM.from_engine_args`` builds one of its class)."""


async def started(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``stream`` (an answer that adds its request to the engine on its first item, as vLLM's
    serving classes' do) with that item asked for, returned once the engine has taken the
    request or the item came (or failed) first. Its chunks, errors and cancellation are the
    stream's own."""
    loop = asyncio.get_running_loop()
    taken = loop.create_future()
    token = _taken.set(taken)
    try:
        first = loop.create_task(_first(stream))  # in a copy of this context: it sees ``taken``
    finally:
        _taken.reset(token)
    try:
        await asyncio.wait((first, taken), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        first.cancel()  # the request is cancelled: so is its engine request (vLLM aborts it)
        raise
    return Ahead(first, stream)


async def _first(stream: AsyncIterator[Any]) -> Any:
    return await anext(stream)


def counted(outputs: AsyncIterator[Any], params: Any) -> AsyncIterator[Any]:
    """``outputs``, counted into the usage of the request being handled (as they are
    when there is none: a warm-up, another engine's own use)."""
    usage = current_usage.get()
    return outputs if usage is None else _counted(outputs, usage, params)


async def _counted(outputs: AsyncIterator[Any], usage: RequestUsage, params: Any) -> AsyncIterator[Any]:
    """``outputs``, counting into ``usage``: the prompt once, then each delta's tokens
    (``DELTA`` outputs), or the last output's (cumulative and final-only ones). Counted here, and
    added to ``usage`` once at the end (read after the answer: its ``End``, its span)."""
    delta = getattr(params, "output_kind", None) == RequestOutputKind.DELTA
    prompt: int | None = None
    deltas: int | None = None  # DELTA outputs' tokens, once one came
    generated: dict[int, int] = {}
    try:
        async for output in outputs:
            if prompt is None and output.prompt_token_ids is not None:
                prompt = len(output.prompt_token_ids)
            for completion in output.outputs:
                if delta:
                    deltas = (deltas or 0) + len(completion.token_ids)
                else:
                    generated[completion.index] = len(completion.token_ids)
            yield output
    finally:
        if prompt is not None:
            usage.prompt_tokens = (usage.prompt_tokens or 0) + prompt
        if deltas is not None or generated:
            usage.completion_tokens = (usage.completion_tokens or 0) + (deltas or 0) + sum(generated.values())
