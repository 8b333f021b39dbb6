"""From a request on the wire to the ``Input`` a handler sees, and from the
handler's ``Output`` to what the client gets, as DJL Serving does it.

Request: the properties are the request's (headers, custom attributes,
``requestId``) plus what LMI's Python engine adds to every call (``device_id``,
``model_dir``, ``cluster_size``; in MPI mode ``tensor_parallel_degree`` and
``pipeline_parallel_degree``; the ``input_formatter`` / ``output_formatter``
functions of ``model.py``). The content is the query parameters, in order, then
the body: one entry per field for ``multipart/form-data`` and
``application/x-www-form-urlencoded``, else the whole body under ``data``.

Forms are parsed only for handlers that read them (``Inputs``): a built-in engine
reads JSON, so a multipart body to it is refused (415) and a url-encoded one stays whole
(``curl -d`` labels JSON so). A multipart body with more than ``max_multipart_parts`` parts
is refused (400) before it is parsed: the parts are counted with one scan for the
boundary, cheap beside the parse (Python's email parser). Parsing a form is the caller's
to keep off the worker's loop (``Inputs.of`` says when it does).

Batch (``batch_size`` > 1): the items' properties and content keys get the
prefix ``batch_000.``, ``batch_001.`` ..., and ``batch_size`` is set; the
handler answers each item under ``batch_<i>.<key>``.
"""

from __future__ import annotations

import functools
import os
import re
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from email.message import Message
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any, cast
from urllib.parse import parse_qsl

from container.core.errors import AnswerError, HandlerError, InputError, ServingError, UnsupportedMediaType
from container.core.handler_choice import mpirun_groups
from container.core.protocol import Invoke
from container.core.request_priority import HEADER as PRIORITY_HEADER
from container.core.request_priority import PROPERTY as PRIORITY_PROPERTY
from container.core.request_priority import check_allowed, parse_priority
from container.core.settings import Settings
from handlers.api import Input, Output
from handlers.api.engine import Engine

_BATCH_KEY = re.compile(r"^batch_(\d+)\.(.*)$", re.S)


def common_properties(settings: Settings, tensor_parallel_degree: int) -> dict[str, Any]:
    """What LMI's Python engine adds to the properties of every call."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    ranks = mpirun_groups(settings)
    on_gpu = visible not in ("", "-1") and not ranks
    common: dict[str, Any] = {"device_id": "0" if on_gpu else "-1", "model_dir": settings.model_dir, "cluster_size": 1}
    if ranks:
        common["tensor_parallel_degree"] = tensor_parallel_degree
        common["pipeline_parallel_degree"] = settings.pipeline_parallel_degree
    return common


MULTIPART = "multipart/form-data"
URL_FORM = "application/x-www-form-urlencoded"


@dataclass(frozen=True)
class Inputs:
    """How a worker makes its handler's ``Input`` of a request: the properties LMI adds to every
    call (``common_properties``), and the forms the handler reads."""

    common: dict[str, Any] = field(default_factory=dict)
    forms: bool = True  # the handler reads form fields (a model.py); False: a built-in engine, which reads JSON
    max_parts: int = 1000  # most parts of a multipart body (max_multipart_parts)
    priority_scheduling: bool = False  # requests may name a priority (option.scheduling_policy=priority)

    @classmethod
    def for_handler(cls, settings: Settings, tensor_parallel_degree: int, engine: type[Engine] | None) -> Inputs:
        forms = engine is None or engine.reads_forms
        return cls(
            common_properties(settings, tensor_parallel_degree),
            forms,
            settings.max_multipart_parts,
            settings.priority_scheduling,
        )

    def refusal(self, message: Invoke) -> ServingError | None:
        """What refuses ``message`` without parsing its body, or None: an ``X-Priority`` that is no
        whole number within int64, or one other than 0 without priority scheduling
        (``InputError``, ``container.core.request_priority``); a multipart body to a handler that
        reads no forms (``UnsupportedMediaType``), one with more than ``max_parts`` parts
        (``InputError``). Costs a look at two headers, and for multipart one scan of the body."""
        try:
            raw = _property(message.properties, PRIORITY_PROPERTY)
            if raw is not None:  # a request that names no priority runs no priority code
                check_allowed(parse_priority(raw), PRIORITY_HEADER, self.priority_scheduling)
        except InputError as exc:
            return exc
        if _media_type(message) != MULTIPART:
            return None
        if not self.forms:
            return UnsupportedMediaType(
                f"the built-in engine reads JSON bodies, not {MULTIPART}; send the request as application/json"
            )
        parts = _count_parts(message.body, _content_type(message.properties))
        if parts > self.max_parts:
            return InputError(
                f"the {MULTIPART} body has {parts} parts; at most {self.max_parts} are read "
                f"(max_multipart_parts / SERVING_MAX_MULTIPART_PARTS)"
            )
        return None

    def parses_form(self, message: Invoke) -> bool:
        """Whether building the request's ``Input`` parses a form (work to keep off the loop)."""
        return self.forms and _media_type(message) in (MULTIPART, URL_FORM)

    def of(self, message: Invoke) -> tuple[Callable[[], Input], bool]:
        """What builds the ``Input`` of a request that ``refusal`` let through, and whether that
        parses a form."""
        return functools.partial(request_input, message, self), self.parses_form(message)

    def of_batch(self, messages: list[Invoke]) -> tuple[Callable[[], Input], bool]:
        """The same for a batch (two or more requests)."""
        return functools.partial(batch_input, messages, self), any(self.parses_form(m) for m in messages)


def _property(properties: dict[str, str], name: str) -> str | None:
    """The request property ``name`` (lower case), matched without regard to case."""
    return next((v for k, v in properties.items() if k.lower() == name), None)


def _content_type(properties: dict[str, str]) -> str:
    return _property(properties, "content-type") or ""


def _media_type(message: Invoke) -> str:
    return _content_type(message.properties).split(";")[0].strip().lower()


def _count_parts(body: bytes, content_type: str) -> int:
    """The parts of a multipart body, counted by its delimiters (each part opens with one, and
    one more closes the body) without parsing it; 0 without a boundary (the parse says why)."""
    header = Message()
    header["content-type"] = content_type
    boundary = header.get_boundary()
    if not boundary:
        return 0
    return max(body.count(b"--" + boundary.encode("latin-1", "replace")) - 1, 0)


def _form_fields(body: bytes, content_type: str) -> list[tuple[str, bytes]]:
    """The fields of a ``multipart/form-data`` body, in order (files as their bytes)."""
    message = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    if not message.is_multipart():
        raise InputError("the multipart/form-data body could not be read (is its boundary right?)")
    fields = []
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name is None:
            raise InputError("a part of the multipart/form-data body has no name")
        payload = cast("bytes | None", part.get_payload(decode=True))  # decode=True: a leaf part's bytes
        fields.append((str(name), payload or b""))
    return fields


def request_content(message: Invoke, inputs: Inputs) -> list[tuple[str, bytes]]:
    """The content entries of a request, in DJL Serving's order (``Inputs.refusal`` let it through)."""
    content = [(k, v.encode("utf-8")) for k, v in parse_qsl(message.query, keep_blank_values=True)]
    kind = _media_type(message) if inputs.forms else ""
    fields = None
    if kind == MULTIPART:
        fields = _form_fields(message.body, _content_type(message.properties))
    elif kind == URL_FORM:
        fields = _url_form_fields(message.body)
    return content + (fields if fields is not None else [("data", message.body)])


def _url_form_fields(body: bytes) -> list[tuple[str, bytes]] | None:
    """The fields of a body labelled as a form, or ``None`` when it is not
    ``k=v&...`` (``curl -d '{...}'`` labels JSON as a form: it stays whole under ``data``)."""
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=True)
    except (UnicodeDecodeError, ValueError):
        return None
    return [(k, v.encode("utf-8")) for k, v in pairs] or None


def request_input(message: Invoke, inputs: Inputs) -> Input:
    """The ``Input`` of one request."""
    made = Input(properties={**message.properties, **inputs.common}, request_path=message.path)
    for key, value in request_content(message, inputs):
        made.content.add(key, value)
    return made


def batch_prefix(index: int) -> str:
    return f"batch_{index:03d}."


def batch_input(messages: list[Invoke], inputs: Inputs) -> Input:
    """One ``Input`` holding the requests of a batch (two or more)."""
    batch = Input(properties={**inputs.common, "batch_size": str(len(messages))}, request_path=messages[0].path)
    for i, message in enumerate(messages):
        prefix = batch_prefix(i)
        for key, value in message.properties.items():
            batch.properties[prefix + key] = value
        for key, data in request_content(message, inputs):
            batch.content.add(prefix + key, data)
    return batch


def split_batch(output: Output, size: int) -> list[Output]:
    """Each request's answer from the handler's answer to a batch of ``size``.

    An answer with a status of 300 or more is every request's (LMI does the
    same); otherwise it must hold one entry per request, keyed ``batch_<i>.``.
    ``Output.error(..., batch_index=i)`` fails item ``i`` alone."""
    if output.stream_content is not None:
        raise HandlerError(
            "the handler answered a batch with a stream; a batched answer holds one entry "
            "per request (Output.add(..., batch_index=i))"
        )
    if output.code >= 300:
        return [output] * size
    if output.content.size() != size:
        raise HandlerError(
            f"Batch output size mismatch, expected: {size}, actual: {output.content.size()} "
            f"(add one entry per request with Output.add(..., batch_index=i))"
        )
    answers: list[Output | None] = [None] * size
    for key, value in zip(output.content.get_keys(), output.content.get_values()):
        match = _BATCH_KEY.match(key or "")
        if match is None or int(match.group(1)) >= size:
            raise HandlerError(f"Unexpected batch output key: {key} (expected batch_0. to batch_{size - 1}.)")
        index = int(match.group(1))
        answer = Output(code=output.item_codes.get(index, output.code), message=output.message)
        answer.properties = dict(output.properties)
        if index in output.item_codes:
            answer.properties = {k: v for k, v in answer.properties.items() if k.lower() != "content-type"}
            answer.properties["content-type"] = "application/json"
        answer._content_type_hint = output._content_type_hint
        answer.content.add(match.group(2) or "data", value)
        answers[index] = answer
    # As many entries as requests, each index below size: every answer is set, unless the
    # handler repeated an index (then another one is None, which is not checked here).
    return cast("list[Output]", answers)


def binary_decode(data: bytes) -> dict[str, str] | None:
    """The dict in ``data`` if it is exactly ``Output.binary_encode``'s form with
    ``data`` and ``last`` (what LMI's async-mode answers carry), else ``None``."""
    try:
        (count,) = struct.unpack_from(">h", data, 0)
        at, items = 2, []
        for _ in range(count * 2):
            (length,) = struct.unpack_from(">i", data, at)
            at += 4
            if length < 0 or at + length > len(data):
                return None
            items.append(bytes(data[at : at + length]).decode("utf-8"))
            at += length
    except (struct.error, UnicodeDecodeError):
        return None
    if at != len(data) or count <= 0:
        return None
    decoded = dict(zip(items[0::2], items[1::2]))
    return decoded if {"data", "last"} <= decoded.keys() else None


def to_output(result: object) -> Output:
    """What ``handle`` returned, as the ``Output`` to send, as LMI takes it:
    ``None`` is 204 "No content"; an async generator is a stream of ``Output``
    chunks (LMI's async mode); any other non-``Output`` is a handler failure.
    An ``Output`` carrying an async-mode answer (``async_utils``) is unpacked."""
    if isinstance(result, Output):
        return _unpack(result)
    if result is None:
        return Output(code=204, message="No content")
    if hasattr(result, "__aiter__"):
        output = Output().add_stream_content(cast(AsyncIterator[Any], result), None)
        output.chunked = True
        return output
    raise HandlerError(f"Invalid output type: {type(result)}")


def _unpack(output: Output) -> Output:
    if output.stream_content is not None or output.content.size() != 1 or output.code >= 300:
        return output
    fields = binary_decode(output.content.value_at(0))
    if fields is None:
        return output
    _raise_if_failed(fields)
    output.content = type(output.content)()
    output.content.add("data", fields["data"].encode("utf-8"))
    return output


def _raise_if_failed(fields: dict[str, str]) -> None:
    code = int(fields["code"]) if fields.get("code", "").lstrip("-").isdigit() else None
    error = fields.get("error")
    if (error and error != "None") or (code is not None and code >= 300):
        raise AnswerError(error if error and error != "None" else "the handler reported an error", code or 424)


def chunk_of(item: Output) -> tuple[bytes, bool]:
    """One item of an async-mode stream: ``(bytes to send, whether it was the last)``."""
    if item.code >= 300:
        raise AnswerError(bytes(item.body()).decode("utf-8", "replace") or item.message, item.code)
    body = item.body()
    fields = binary_decode(body) if item.content.size() == 1 else None
    if fields is None:
        return body, False
    _raise_if_failed(fields)
    return fields["data"].encode("utf-8"), fields["last"].lower() == "true"
