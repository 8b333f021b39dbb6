"""The vLLM engine's part in observing a request (``handlers.api.usage``): the outputs of a
request being handled count its prompt's tokens and the tokens generated, and, when vLLM
traces on its own (``option.otlp_traces_endpoint``), the request reaches vLLM with the worker
span's ``traceparent`` as ``trace_headers``, so vLLM's ``llm_request`` span joins the request's
trace. Every route goes through it: vLLM's OpenAI serving classes call ``generate``; LMI's front
calls ``add_request`` (its stream's headers go out once the engine has taken the request) and
counts the outputs with ``counted``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from vllm.sampling_params import RequestOutputKind

from handlers.api.usage import RequestUsage, current_usage


def observe_generate(engine: Any, tracing: bool) -> None:
    """Wrap ``engine.generate`` and ``engine.add_request`` (an ``AsyncLLM``'s, or one like it)
    in place. vLLM's ``generate`` calls ``add_request`` through the instance, so both ways in
    carry the trace headers."""
    generate, add_request = engine.generate, engine.add_request

    async def observed(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        params = args[1] if len(args) > 1 else kwargs.get("sampling_params")
        async for output in counted(generate(*args, **kwargs), params):
            yield output

    async def traced(*args: Any, **kwargs: Any) -> Any:
        usage = current_usage.get()
        if usage is not None and usage.trace_headers and not kwargs.get("trace_headers"):
            kwargs["trace_headers"] = usage.trace_headers
        return await add_request(*args, **kwargs)

    engine.generate = observed
    if tracing:
        engine.add_request = traced


def counted(outputs: AsyncIterator[Any], params: Any) -> AsyncIterator[Any]:
    """``outputs``, counted into the usage of the request being handled (as they are
    when there is none: a warm-up, another engine's own use)."""
    usage = current_usage.get()
    return outputs if usage is None else _counted(outputs, usage, params)


async def _counted(outputs: AsyncIterator[Any], usage: RequestUsage, params: Any) -> AsyncIterator[Any]:
    """``outputs``, counting into ``usage``: the prompt once, then each delta's tokens
    (``DELTA`` outputs), or the last output's (cumulative and final-only ones)."""
    delta = getattr(params, "output_kind", None) == RequestOutputKind.DELTA
    prompt_counted = False
    generated: dict[int, int] = {}
    try:
        async for output in outputs:
            if not prompt_counted and output.prompt_token_ids is not None:
                usage.add(prompt=len(output.prompt_token_ids))
                prompt_counted = True
            for completion in output.outputs:
                if delta:
                    usage.add(completion=len(completion.token_ids))
                else:
                    generated[completion.index] = len(completion.token_ids)
            yield output
    finally:
        if generated:
            usage.add(completion=sum(generated.values()))
