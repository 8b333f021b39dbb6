"""A ``model.py``'s ``@output_formatter`` applied to what a built-in engine answers: once to a
whole answer, once per item of a stream (JSON lines or server-sent events), as LMI does."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, cast

from container.core.errors import HandlerError
from handlers.api import Output


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
