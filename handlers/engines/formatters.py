"""A ``model.py``'s formatters on a built-in engine. ``@output_formatter``, in the form it was
written for: LMI's rolling-batch form (its first parameter annotated ``TextGenerationOutput`` or
``RequestOutput``: called once per generated token, ``handlers.engines.rolling_formatter``), or
sagelmi's answer as a dict (any other signature): applied to what the engine answers, once to a
whole answer, once per item of a stream (JSON lines or server-sent events). ``@input_formatter``:
called in the form it was written for (LMI documents two, ``input_form`` tells them apart): the
decoded payload and ``tokenizer=`` (LMI's vLLM and TensorRT-LLM async services), or the request's
``Input`` and ``tokenizer=`` (LMI's other services); it may answer with a payload (a dict) or a
``RequestInput``/``TextInput``. One written as a method (a first parameter ``self``) gets ``None``
there (``unbound``)."""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

from container.core.errors import HandlerError, InputError
from handlers.api import Input, Output

log = logging.getLogger("sagelmi.formatters")

# Names of a first parameter that mean "the request's Input" when it has no annotation.
_INPUT_NAMES = {"input_item", "inputs", "input", "item", "request"}


def input_form(formatter) -> str:
    """``"input"`` when ``formatter`` takes the request's ``Input`` (its first parameter is annotated
    ``Input``, or unannotated and named ``input_item``/``inputs``/``input``/``item``/``request``),
    else ``"payload"`` (the decoded body). Annotating the first parameter decides either way."""
    params = [
        p
        for p in inspect.signature(formatter).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if not params:
        return "payload"
    annotation = params[0].annotation
    if annotation is not inspect.Parameter.empty:
        name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
        return "input" if name.rsplit(".", 1)[-1] == "Input" else "payload"
    return "input" if params[0].name in _INPUT_NAMES else "payload"


def unbound(formatter: Callable[..., Any]) -> Callable[..., Any]:
    """``formatter`` ready to be called as a function: one whose first parameter is ``self`` (as
    djl-demo's customized-processing notebook writes its ``@input_formatter``, from when LMI bound
    it to its service as a method) is called with ``self=None``; LMI's own call would fail there."""
    try:
        params = list(inspect.signature(formatter).parameters.values())
    except (TypeError, ValueError):  # a callable without a signature to read: called as it is
        return formatter
    if inspect.ismethod(formatter) or not params or params[0].name != "self":
        return formatter
    log.warning(
        "model.py's formatter %s takes 'self' first, as a method: it is called with self=None",
        getattr(formatter, "__name__", formatter),
    )
    return functools.partial(formatter, None)


def _as_payload(result: Any) -> Any:
    """A formatter's answer as the engine's payload: a ``RequestInput``/``TextInput`` (its
    ``input_text`` and ``parameters``; ``stream`` among them) becomes LMI's or chat's schema."""
    if not hasattr(result, "input_text") or not hasattr(result, "parameters"):
        return result
    parameters = dict(result.parameters or {})
    stream = bool(parameters.pop("stream", False))
    text = result.input_text
    if isinstance(text, list) and text and all(isinstance(m, dict) and "role" in m for m in text):
        return {"messages": text, **parameters, "stream": stream}
    return {"inputs": text, "parameters": parameters, "stream": stream}


def format_request(formatter, inputs: Input, tokenizer: Any) -> Any:
    """The payload ``formatter`` makes of the request, called in its form (``input_form``)."""
    try:
        if input_form(formatter) == "input":
            return _as_payload(formatter(inputs, tokenizer=tokenizer))
        return _as_payload(formatter(inputs.get_as_json(), tokenizer=tokenizer))
    except InputError:
        raise
    except Exception as exc:
        raise HandlerError(f"Custom formatter failed: {type(exc).__name__}: {exc}") from None


def _apply(formatter, data: Any) -> bytes:
    try:
        result = formatter(data)
    except Exception as exc:
        raise HandlerError(f"Custom formatter failed: {type(exc).__name__}: {exc}") from None
    if hasattr(result, "model_dump_json"):
        return result.model_dump_json().encode()
    if isinstance(result, (bytes, bytearray)):
        return bytes(result)
    if isinstance(result, str):
        return result.encode()
    return json.dumps(result, ensure_ascii=False).encode()


def formatted(output: Output, formatter) -> Output:
    """``output`` with each answer (or stream chunk) passed through ``formatter``."""
    if output.stream_content is None:
        data = output.body()
        output.content = type(output.content)()
        output.content.add("data", _apply(formatter, json.loads(data)))
        return output
    sse = "text/event-stream" in str(output.get_property("content-type") or "")
    # an engine's stream (what this formats) is asynchronous
    output.stream_content = _formatted_stream(cast(AsyncIterator[Any], output.stream_content), formatter, sse)
    return output


async def _formatted_stream(chunks: AsyncIterator[Any], formatter, sse: bool) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        text = chunk.decode() if isinstance(chunk, (bytes, bytearray)) else str(chunk)
        out = []
        for line in text.splitlines():
            if not line.strip():
                continue
            if sse:
                payload = line.removeprefix("data:").strip()
                out.append(line if payload == "[DONE]" else "data: " + _apply(formatter, json.loads(payload)).decode())
                out.append("")
            else:
                out.append(_apply(formatter, json.loads(line)).decode())
        if out:
            yield ("\n".join(out) + "\n").encode()
