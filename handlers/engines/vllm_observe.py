"""The vLLM engine's part in observing a request (``handlers.api.usage``): its
``generate`` counts the prompt's tokens and the tokens generated for the request
being handled, and, when vLLM traces on its own (``option.otlp_traces_endpoint``),
hands vLLM the worker span's ``traceparent`` as ``trace_headers``, so vLLM's
``llm_request`` span joins the request's trace. Every route goes through it: LMI's
front calls ``generate``, and so do vLLM's OpenAI serving classes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from vllm.sampling_params import RequestOutputKind

from handlers.api.usage import RequestUsage, current_usage


def observe_generate(engine: Any, tracing: bool) -> None:
    """Wrap ``engine.generate`` (an ``AsyncLLM``'s, or one like it) in place."""
    generate = engine.generate

    async def observed(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        usage = current_usage.get()
        if usage is None:  # not a request's call (a warm-up, another engine's own use)
            async for output in generate(*args, **kwargs):
                yield output
            return
        if tracing and usage.trace_headers and not kwargs.get("trace_headers"):
            kwargs["trace_headers"] = usage.trace_headers
        params = args[1] if len(args) > 1 else kwargs.get("sampling_params")
        async for output in _counted(generate(*args, **kwargs), usage, params):
            yield output

    engine.generate = observed


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
