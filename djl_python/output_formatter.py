"""LMI's output formatters: the ``@output_formatter`` decorator, and the
built-in formats of a ``TextGenerationOutput`` (json, jsonlines, sse).

A function marked ``@output_formatter`` in ``model.py`` reaches the handler as
the ``output_formatter`` property (and with no ``handle``, the built-in
handler uses it)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

from djl_python.request_io import RequestInput, RequestOutput, Sequence, TextGenerationOutput, TextInput

log = logging.getLogger(__name__)

__all__ = [
    "output_formatter",
    "get_generated_text",
    "get_sequence_details",
    "get_details_dict",
    "sse_response_formatter",
    "adapt_legacy_output_formatter",
    "get_output_formatter",
    "RequestOutput",
]


_F = TypeVar("_F", bound=Callable[..., Any])


def output_formatter(function: _F) -> _F:
    """Mark ``function`` as the model's output formatter."""
    function.is_output_formatter = True  # type: ignore[attr-defined]  # LMI's marker on the function itself
    return function


def _input_text(request: RequestInput) -> str | list[str] | None:
    """The prompt of a text request (LMI's formatters read ``input.input_text``: a TextInput)."""
    return cast(TextInput, request).input_text


def _parameters(request_output: TextGenerationOutput) -> dict:
    return request_output.input.parameters if request_output.input is not None else {}


def get_generated_text(sequence: Sequence, request_output: TextGenerationOutput) -> str:
    parameters = _parameters(request_output)
    text = "".join(token.text for token in sequence.tokens)
    if parameters.get("return_full_text") and request_output.input is not None:
        return f"{_input_text(request_output.input)}{text}"
    return text


def get_sequence_details(request_output: TextGenerationOutput, sequence_index: int = 0) -> dict:
    sequence = request_output.sequences[sequence_index]
    parameters = _parameters(request_output)
    details: dict[str, Any] = {
        "finish_reason": sequence.finish_reason,
        "generated_tokens": len(sequence.tokens),
        "tokens": request_output.get_tokens_as_dict(sequence_index),
    }
    if parameters.get("decoder_input_details"):
        details["prefill"] = request_output.get_prompt_tokens_as_dict()
    if parameters.get("top_n_tokens", 0) > 0:
        details["top_tokens"] = request_output.get_top_tokens_as_dict(sequence_index)
    return details


def get_details_dict(request_output: TextGenerationOutput, include_tokens: bool = True) -> dict:
    parameters = _parameters(request_output)
    tgi_compat = request_output.input is not None and request_output.input.tgi_compat
    if parameters.get("details", tgi_compat):
        details = get_sequence_details(request_output, request_output.best_sequence_index)
        if not include_tokens:
            details.pop("tokens", None)
        details["inputs"] = _input_text(request_output.input) if request_output.input is not None else None
        return details
    if request_output.error:
        return {"finish_reason": "error"}
    return {}


def _json_output_formatter(request_output: TextGenerationOutput) -> str:
    """The whole answer as one JSON object, once the request has finished."""
    if not request_output.finished:
        return ""
    best = request_output.sequences[request_output.best_sequence_index]
    result: dict[str, Any] = {"generated_text": get_generated_text(best, request_output)}
    if request_output.error:
        result = {"generated_text": None, "error": request_output.error, "code": request_output.code or 400}
    details = get_details_dict(request_output)
    if details:
        result["details"] = details
    tgi_compat = request_output.input is not None and request_output.input.tgi_compat
    return json.dumps([result] if tgi_compat else result, ensure_ascii=False)


def _jsonlines_output_formatter(request_output: TextGenerationOutput) -> str:
    """One JSON line per new token; the last one also carries the text and details."""
    best = request_output.sequences[request_output.best_sequence_index]
    lines = []
    while best.has_next_token():
        token, _, _, last = best.get_next_token()
        assert token is not None  # has_next_token()
        line: dict[str, Any] = {"token": request_output._token_dict(token)}
        if last:
            line["generated_text"] = get_generated_text(best, request_output)
            details = get_details_dict(request_output, include_tokens=False)
            if details:
                line["details"] = details
        lines.append(json.dumps(line, ensure_ascii=False) + "\n")
    return "".join(lines)


def sse_response_formatter(request_output: TextGenerationOutput) -> str:
    """Server-sent events: each JSON line as ``data: ...``."""
    return "".join(f"data: {line}\n" for line in _jsonlines_output_formatter(request_output).splitlines(True))


def adapt_legacy_output_formatter(request_output: TextGenerationOutput) -> str:
    """Call an old-style formatter ``f(token, first, last, details, text, id)`` per new token."""
    # Called for a request whose input carries an old-style formatter function
    request = cast(RequestInput, request_output.input)
    formatter = cast(Callable[..., str], request.output_formatter)
    best = request_output.sequences[request_output.best_sequence_index]
    out = []
    while best.has_next_token():
        token, _, first, last = best.get_next_token()
        details = get_details_dict(request_output) if last else {}
        text = get_generated_text(best, request_output) if last else None
        out.append(formatter(token, first, last, details, text, request.request_id))
    return "".join(out)


_FORMATS: dict[str, tuple[Callable | None, str]] = {
    "json": (_json_output_formatter, "application/json"),
    "jsonlines": (_jsonlines_output_formatter, "application/jsonlines"),
    "sse": (sse_response_formatter, "text/event-stream"),
    "none": (None, "text/plain"),
}


def get_output_formatter(
    output_formatter: str | Callable | None, stream: bool, tgi_compat: bool
) -> tuple[Callable | None, str | None]:
    """``(formatter, content type)`` for a name (json, jsonlines, sse, none) or a function."""
    if callable(output_formatter):
        return output_formatter, None
    if output_formatter in _FORMATS:
        return _FORMATS[output_formatter]
    if output_formatter:
        log.warning("Unsupported output formatter: %s", output_formatter)
    if stream:
        return _FORMATS["sse"] if tgi_compat else _FORMATS["jsonlines"]
    return _FORMATS["json"]
