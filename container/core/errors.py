"""Every error a client can see: its exception type, its HTTP status, its envelope.

Nothing else in the code base knows a status number for an error. Both
processes use this module: the frontend for what it rejects itself (queue full,
payload too large, ...), the worker for what a handler raised.

The envelope is LMI's: ``{"code": <status>, "message": <summary>, "error":
<detail>}``; on the OpenAI routes (``/v1/...``) it is OpenAI's (as vLLM's
server answers): ``{"error": {"message": <detail>, "type", "param", "code":
<status>}}``; on Anthropic's Messages routes (``/v1/messages...``) Anthropic's
(the shape vLLM's server answers there): ``{"type": "error", "error": {"type",
"message": <detail>}}``. ``envelope_for`` picks by the path the client called. Details
never carry a traceback; absolute file-system paths are replaced with
``<path>`` before they leave the process.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel


class ServingError(Exception):
    """An error with a status and a message meant for the client."""

    status = 500
    message = "internal server error"

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail or self.message)
        self.detail = detail or self.message


class InputError(ServingError, ValueError):
    """The request body or a parameter is not acceptable (bad JSON, bad type)."""

    status = 400
    message = "invalid input"


class InvalidJSON(InputError, json.JSONDecodeError):
    """The body is not JSON although the handler asked for JSON."""

    def __init__(self, err: json.JSONDecodeError) -> None:
        json.JSONDecodeError.__init__(self, err.msg, err.doc, err.pos)
        self.detail = f"request body is not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})"
        self.args = (self.detail,)

    def __str__(self) -> str:
        return self.detail


class NotFound(ServingError):
    status = 404
    message = "not found"


class MethodNotAllowed(ServingError):
    status = 405
    message = "method not allowed"


class RequestTimeout(ServingError):
    """The client did not send its request (its head, or its body) within the time the server
    waits for it; the connection is closed after the answer."""

    status = 408
    message = "request timeout"


class Conflict(ServingError):
    """The request clashes with the server's state (an adapter name already registered)."""

    status = 409
    message = "conflict"


class PayloadTooLarge(ServingError):
    status = 413
    message = "payload too large"


class HeadTooLarge(ServingError):
    """A request head on a handler's route larger than rank 0 is handed (``protocol.MAX_PREFIX_BYTES``)."""

    status = 431
    message = "request header fields too large"


class TooManySessions(ServingError):
    """``option.max_sessions`` stateful sessions are open in the worker group already:
    a new one waits for one to be closed or to expire (counted on ``/metrics``)."""

    status = 429
    message = "too many sessions"


class UnsupportedMediaType(ServingError):
    """The handler does not read bodies of the request's content type (a form sent to a built-in engine)."""

    status = 415
    message = "unsupported media type"


class ClientClosedRequest(ServingError):
    """The client went away before its answer was ready (nginx's 499: nobody reads it)."""

    status = 499
    message = "client closed request"


class HandlerError(ServingError):
    """The model's handler raised or returned an error (LMI's 424 contract)."""

    status = 424
    message = "invoke handler failure"


class AnswerError(HandlerError):
    """An answer the handler marked as failed with its own status (an LMI
    async-mode chunk with ``code`` and ``error``)."""

    def __init__(self, detail: str, status: int = 424) -> None:
        super().__init__(detail)
        self.status = status if 400 <= status <= 599 else 424


class OutOfMemory(ServingError):
    """The handler ran out of (device) memory: LMI's 507."""

    status = 507
    message = "out of memory"


class RequestStoppedEngine(ServingError):
    """A copy of a request that stopped a worker group twice (``container.frontend.poison``): refused
    by the frontend, or by rank 0 where the frontend did not see the request whole."""

    status = 422
    message = "request stopped the engine"


def stopped_engine(seconds: float) -> RequestStoppedEngine:
    """The refusal of a poison request's copy, refused for ``seconds`` more."""
    return RequestStoppedEngine(
        f"this request stopped the model's engine twice (the worker group serving it died with it "
        f"in flight); copies of it are refused for {seconds:.0f} more seconds. Change the request, "
        f"or see the server's log for why the engine died"
    )


class ServiceUnavailable(ServingError):
    """Not ready, shutting down, queue full, or the worker went away."""

    status = 503
    message = "service unavailable"


class QueueFull(ServiceUnavailable):
    """``job_queue_size`` requests are in flight already (counted on ``/metrics``)."""


class GatewayTimeout(ServingError):
    status = 504
    message = "prediction timed out"


# Exceptions raised inside a handler that are not ServingErrors: the ones that
# mean "the client's input was unreadable" become 400, the rest 424.
_HANDLER_INPUT_ERRORS: tuple[type[BaseException], ...] = (json.JSONDecodeError, UnicodeDecodeError)

# How LMI recognises an out-of-memory error raised by a handler (then 507, not 424).
_OOM_TYPES = {"OutOfMemoryError", "MemoryError"}
_OOM_TEXTS = ("No available memory for the cache blocks", "CUDA error: out of memory")

_PATH = re.compile(r"(?<![\w:/.~-])(?:/[\w.+@~-]+){2,}/?")


@functools.lru_cache(maxsize=256)
def _is_local_root(name: str) -> bool:
    return os.path.isdir("/" + name)


def _scrub_one(match: re.Match) -> str:
    path = match.group()
    # Only file-system paths: their top directory exists here (/opt, /tmp, /home ...);
    # a URL path such as /v1/chat/completions does not.
    return "<path>" if _is_local_root(path.split("/")[1]) else path


def scrub(text: str) -> str:
    """Replace absolute file-system paths in ``text`` with ``<path>``."""
    return _PATH.sub(_scrub_one, text)


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line, for a log line or a status detail. A pydantic
    ``ValidationError`` (vLLM's config classes raise them) gives its errors' messages, not
    its multi-line rendering with input values and documentation links."""
    name = type(exc).__name__
    errors = getattr(exc, "errors", None)
    if callable(errors) and hasattr(exc, "title"):
        try:
            messages = [str(e.get("msg", "")).removeprefix("Value error, ") for e in errors()]
            return _joined(f"{name} in {exc.title}: " + "; ".join(messages))
        except Exception:  # noqa: BLE001 - not pydantic's after all: the generic form below
            pass
    text = _joined(str(exc))
    return f"{name}: {text}" if text else name


def _joined(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def describe(exc: BaseException) -> tuple[int, str, str]:
    """Map an exception to ``(status, message, error)`` for the client."""
    if isinstance(exc, ServingError):
        return exc.status, exc.message, scrub(exc.detail)
    if isinstance(exc, _HANDLER_INPUT_ERRORS):
        return InputError.status, InputError.message, scrub(f"could not read the request: {exc}")
    text = str(exc) or type(exc).__name__
    if type(exc).__name__ in _OOM_TYPES or any(t in text for t in _OOM_TEXTS):
        return OutOfMemory.status, OutOfMemory.message, scrub(text)
    worded = next((word(exc) for kind, word in _HANDLER_DETAILS.items() if isinstance(exc, kind)), text)
    return HandlerError.status, HandlerError.message, scrub(worded)


def _missing_key(exc: BaseException) -> str:
    """A ``KeyError``'s message is the key alone (``'inputs'``): named, with what it means."""
    if len(exc.args) != 1:
        return one_line(exc)
    key = exc.args[0]
    if isinstance(key, str) and " " in key:  # raised with a sentence rather than a key
        return f"KeyError: {_joined(key)}"
    return (
        f"KeyError: {key!r} is missing (the handler looked up a key that is not there: "
        "a field the request does not have?)"
    )


# Exceptions a handler raises whose message alone does not say what went wrong, and how each is worded.
_HANDLER_DETAILS: dict[type[BaseException], Callable[[BaseException], str]] = {KeyError: _missing_key}


class LmiError(BaseModel):
    """LMI's error envelope (every route but ``/v1/...``)."""

    code: int
    message: str
    error: str


class OpenAIErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class OpenAIError(BaseModel):
    """OpenAI's error envelope (``/v1/...``), as vLLM's server answers."""

    error: OpenAIErrorInfo


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error envelope (``/v1/messages``, ``/v1/messages/count_tokens``), as vLLM's server answers."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


def envelope(status: int, message: str, error: str) -> dict:
    return LmiError(code=status, message=message, error=error).model_dump()


# OpenAI's error type names (the ``openai`` client's exception names); other statuses
# get BadRequestError (4xx) or InternalServerError (5xx).
_OPENAI_TYPES = {
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
}


def openai_envelope(status: int, message: str, error: str) -> dict:
    """OpenAI's error body, as vLLM's server answers; ``error`` (the detail) is its message."""
    kind = _OPENAI_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return OpenAIError(error=OpenAIErrorInfo(message=error or message, type=kind, code=status)).model_dump()


# Anthropic's error type names by status (what its API and its client's exceptions go by); other
# statuses get invalid_request_error (4xx) or api_error (5xx). vLLM's server passes OpenAI's
# type names here; a client of Anthropic's API knows these.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    424: "api_error",  # the model's handler failed: not the request's fault
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_envelope(status: int, message: str, error: str) -> dict:
    """Anthropic's error body; ``error`` (the detail) is its message."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return AnthropicError(error=AnthropicErrorInfo(type=kind, message=error or message)).model_dump()


# vLLM's server routes outside /v1 that answer (and fail) in OpenAI's forms
OPENAI_FORM_PATHS = ("/tokenize", "/detokenize")
ANTHROPIC_PATH = "/v1/messages"  # and the routes under it (count_tokens)


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def is_openai_path(path: str) -> bool:
    """Whether the route at ``path`` answers in OpenAI's forms (not Anthropic's routes under ``/v1``)."""
    return (path.startswith("/v1/") or path in OPENAI_FORM_PATHS) and not is_anthropic_path(path)


def envelope_for(path: str, status: int, message: str, error: str) -> dict:
    """The error body in the envelope of the route at ``path``: Anthropic's on ``/v1/messages...``,
    OpenAI's on the other ``/v1/...`` routes, else LMI's."""
    if is_anthropic_path(path):
        return anthropic_envelope(status, message, error)
    return (openai_envelope if is_openai_path(path) else envelope)(status, message, error)


# The routes whose server-sent events are named (``event:`` lines), as vLLM's Responses and Messages
# streams are: an error after the stream began goes out as an ``error`` event, without ``data: [DONE]``
NAMED_EVENT_ROUTES = ("/v1/responses", "/v1/messages")


def error_body(path: str, exc: BaseException) -> bytes:
    """``exc`` as a whole answer's JSON body, in the envelope of the route at ``path``."""
    return json.dumps(envelope_for(path, *describe(exc))).encode()


def in_band_error(path: str, content_type: str, exc: BaseException) -> bytes:
    """An error after a 200 stream began: the stream's last item, in the route's envelope. A
    server-sent-events stream on an OpenAI route then ends as vLLM's does: the error event, then
    ``data: [DONE]``; on a route of named events (Responses, Messages) it is an ``error`` event, as
    Anthropic's API sends one; any other stream gets a JSON line."""
    line = json.dumps(envelope_for(path, *describe(exc)))
    if not content_type.startswith("text/event-stream"):
        return f"{line}\n".encode()
    if path in NAMED_EVENT_ROUTES:
        return f"event: error\ndata: {line}\n\n".encode()
    event = f"data: {line}\n\n"
    if is_openai_path(path):
        event += "data: [DONE]\n\n"
    return event.encode()


class IncompleteBody(InputError):
    """The client did not send the body it announced."""


class MalformedBody(InputError):
    """The client's chunked body is not framed as HTTP/1.1's chunks (a chunk size that is not hex,
    a chunk longer than its size)."""


def too_large(announced: int | None, limit: int) -> PayloadTooLarge:
    """A request body past ``max_payload_bytes`` (``announced``: its ``Content-Length``, if it had one)."""
    size = f"is {announced} bytes" if announced is not None else "(chunked) went past the limit"
    return PayloadTooLarge(
        f"the request body {size}; the limit is {limit} bytes (max_payload_in_mb / SAGEMAKER_MAX_PAYLOAD_IN_MB)"
    )


def body_late(announced: int | None, timeout: float) -> RequestTimeout:
    whole = f"all {announced} bytes of the request body" if announced is not None else "the whole chunked body"
    return RequestTimeout(f"{whole} did not arrive within {timeout:g}s (body_read_timeout)")


def body_cut(size: int, announced: int | None) -> IncompleteBody:
    expected = f"of {announced} bytes" if announced is not None else "bytes of a chunked body"
    return IncompleteBody(f"the request body ended after {size} {expected} (the client stopped sending)")


def body_malformed(why: str) -> MalformedBody:
    """``why``: what httptools found wrong in the chunks' framing."""
    return MalformedBody(f"the request body's chunked framing is malformed: {why[:100]}")
