"""Answers in LMI's async mode: each ``Output`` carries one chunk as a binary
dict (``data``, ``last``, and on failure ``error`` and ``code``)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from handlers.api import Output

log = logging.getLogger(__name__)


def _create_output(
    data: str | dict,
    last_chunk: bool,
    content_type: str,
    properties: dict | None = None,
    error: str | None = None,
    code: int | None = None,
) -> Output:
    text = json.dumps(data, ensure_ascii=False) if isinstance(data, dict) else data
    fields: dict[str, Any] = {"data": f"{text}\n", "last": last_chunk}
    if error:
        fields["error"] = error
    if code:
        fields["code"] = code
    output = Output().add_property("Content-Type", content_type)
    for key, value in (properties or {}).items():
        output.add_property(key, value)
    return output.add(Output.binary_encode(fields))


def create_non_stream_output(
    data: str | dict, properties: dict | None = None, error: str | None = None, code: int | None = None
) -> Output:
    """A whole answer (JSON)."""
    return _create_output(data, True, "application/json", properties, error, code)


def create_stream_chunk_output(
    data: str | dict, last_chunk: bool, error: str | None = None, code: int | None = None
) -> Output:
    """One chunk of a streamed answer (JSON lines)."""
    return _create_output(data, last_chunk, "application/jsonlines", None, error, code)


async def handle_streaming_response(
    response: AsyncGenerator, stream_output_formatter: Callable, accumulate_chunks: bool = False, **kwargs
) -> AsyncGenerator[Output, None]:
    """Turn an engine's stream into ``Output`` chunks with ``stream_output_formatter``,
    which returns ``(data, last)`` (and the history when ``accumulate_chunks``)."""
    history: list = []
    async for chunk in response:
        try:
            if accumulate_chunks:
                data, last, history = stream_output_formatter(chunk, history=history, **kwargs)
            else:
                data, last = stream_output_formatter(chunk, **kwargs)
        except Exception as exc:
            log.exception("the stream formatter failed")
            yield create_stream_chunk_output("", True, error=str(exc), code=424)
            return
        yield create_stream_chunk_output(data, last)
        if last:
            return
