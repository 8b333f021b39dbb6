"""The handler API: ``Input`` and ``Output``, with the methods and meaning of LMI's
``djl_python``, so an LMI ``model.py`` runs unchanged.

A handler is a module with ``handle(inputs: Input) -> Output | None``. It is
first called once with an empty ``Input`` whose properties are the model
properties (``model_dir``, ``model_id``, every ``option.*`` without its prefix):
that is the initialisation call. Every request then arrives as an ``Input``
whose properties are the request headers (lower-case names), the pairs of
``X-Amzn-SageMaker-Custom-Attributes`` and the request id, and whose content is
the body under the key ``data``.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any, AsyncIterator, Callable, Iterable

from container.errors import InvalidJSON


class PairList:
    """An ordered list of ``(key, value)`` pairs; keys may repeat."""

    def __init__(self, keys: list | None = None, values: list | None = None) -> None:
        self.keys: list = list(keys or [])
        self.values: list = list(values or [])
        if len(self.keys) != len(self.values):
            raise ValueError("keys and values must have the same length")

    def add(self, key: str | None = None, value: Any = None) -> None:
        self.keys.append(key)
        self.values.append(value)

    def size(self) -> int:
        return len(self.keys)

    def is_empty(self) -> bool:
        return not self.keys

    def key_at(self, index: int):
        return self.keys[index]

    def value_at(self, index: int):
        return self.values[index]

    def get_keys(self) -> list:
        return self.keys

    def get_values(self) -> list:
        return self.values

    def get(self, key):
        """The value of the first pair with ``key`` (``key`` may be an index)."""
        if isinstance(key, int):
            return self.values[key]
        for k, v in zip(self.keys, self.values):
            if k == key:
                return v
        return None


class Input:
    """One request (or the initialisation call) as a handler sees it."""

    def __init__(self, properties: dict[str, str] | None = None, body: bytes | None = None,
                 request_path: str = "/invocations") -> None:
        self.function_name: str | None = None
        #: The HTTP route the request came in on (``/invocations``, ``/v1/chat/completions``...).
        self.request_path = request_path
        self.properties: dict[str, str] = dict(properties or {})
        self.content = PairList()
        if body is not None:  # a request, even with an empty body, is never is_empty()
            self.content.add("data", bytes(body))

    def __str__(self) -> str:
        keys = ", ".join(str(k) for k in self.content.get_keys())
        return f"Input(properties={self.properties}, content keys=[{keys}])"

    # -- batches (the frontend sends one request per Input; kept for LMI handlers)
    def is_batch(self) -> bool:
        return "batch_size" in self.properties

    def get_batch_size(self) -> int:
        return int(self.properties.get("batch_size", "1"))

    def get_batches(self) -> list["Input"]:
        """Split a batched Input (``batch_NNN_<key>`` names) into single Inputs."""
        if not self.is_batch():
            return [self]
        batch = [Input() for _ in range(self.get_batch_size())]
        for key, value in self.properties.items():
            if key.startswith("batch_") and key != "batch_size":
                batch[int(key[6:9])].properties[key[10:]] = value
        for key, value in zip(self.content.get_keys(), self.content.get_values()):
            batch[int(key[6:9])].content.add(key[10:], value)
        return batch

    # -- properties
    def get_function_name(self) -> str | None:
        return self.function_name

    def get_properties(self) -> dict[str, str]:
        return self.properties

    def get_property(self, key: str) -> str | None:
        """The value of property ``key``, matched without regard to case."""
        wanted = key.lower()
        return next((v for k, v in self.properties.items() if k.lower() == wanted), None)

    # -- content
    def get_content(self) -> PairList:
        return self.content

    def contains_key(self, key: str) -> bool:
        return self.content.get(key) is not None

    def is_empty(self) -> bool:
        return self.content.is_empty()

    def get_as_bytes(self, key: str | None = None) -> bytes | None:
        """The body (or the content under ``key``) as bytes; ``None`` when empty."""
        if self.content.is_empty():
            return None
        if key:
            value = self.content.get(key)
            if value is None:
                raise KeyError(f"requested data for key:{key} is not found!")
            return value
        value = self.content.get("data")
        return value if value is not None else self.content.value_at(0)

    def get_as_string(self, key: str | None = None) -> str:
        data = self.get_as_bytes(key=key)
        return "" if data is None else bytes(data).decode("utf-8")

    def get_as_json(self, key: str | None = None) -> Any:
        """The body parsed as JSON. Malformed JSON raises ``InvalidJSON`` (a
        ``json.JSONDecodeError`` that the server answers with 400)."""
        text = self.get_as_string(key=key)
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise InvalidJSON(err) from None

    def get_as_csv(self, key: str | None = None) -> list[dict]:
        return list(csv.DictReader(io.StringIO(self.get_as_string(key=key))))

    def get_data(self, key: str | None = None) -> Any:
        """The body decoded after its content type (JSON, text, else bytes)."""
        content_type = self.get_property("content-type") or ""
        if content_type.startswith("application/json"):
            return self.get_as_json(key)
        if content_type.startswith("text/"):
            return self.get_as_string(key)
        return self.get_as_bytes(key)


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def default_stream_item(item: Any) -> bytes:
    """How a streamed item becomes bytes when no formatter is given: bytes pass
    through, text is UTF-8 encoded, anything else becomes one JSON line."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if isinstance(item, str):
        return item.encode("utf-8")
    return _json_bytes(item) + b"\n"


class Output:
    """A handler's answer: status, headers (``properties``), body or stream."""

    def __init__(self, code: int = 200, message: str = "OK") -> None:
        self.code = code
        self.message = message
        self.properties: dict[str, str] = {}
        self.content = PairList()
        self.stream_content: Iterable | AsyncIterator | None = None
        self.stream_formatter: Callable[[Any], bytes] | None = None
        self._content_type_hint: str | None = None

    def __str__(self) -> str:
        return (f"Output(code={self.code}, message={self.message!r}, properties={self.properties}, "
                f"content keys={self.content.get_keys()}, stream={self.stream_content is not None})")

    def set_code(self, code: int) -> "Output":
        self.code = int(code)
        return self

    def set_message(self, message: str) -> "Output":
        self.message = message
        return self

    def error(self, error: str, code: int = 424, message: str = "prediction failure") -> "Output":
        """Make this an error answer with LMI's JSON envelope."""
        self.code = code
        self.message = message
        self.add_property("content-type", "application/json")
        self.add_as_json({"code": code, "message": message, "error": error})
        return self

    def add_property(self, key: str, val: str) -> "Output":
        """Set a response header (``content-type``, custom attributes, ...)."""
        self.properties[key] = str(val)
        return self

    def add(self, value: Any, key: str | None = None, batch_index: int | None = None) -> "Output":
        """Add content: bytes and text as they are, anything else as JSON."""
        if key is not None and not isinstance(key, str):
            key = str(key)
        if batch_index is not None:
            key = f"batch_{batch_index:03d}_{key or 'data'}"
        if isinstance(value, (bytes, bytearray, memoryview)):
            self.content.add(key, bytes(value))
            self._hint("application/octet-stream")
        elif isinstance(value, str):
            self.content.add(key, value.encode("utf-8"))
            self._hint("text/plain; charset=utf-8")
        else:
            self.content.add(key, _json_bytes(value))
            self._hint("application/json")
        return self

    def add_as_json(self, val: Any, key: str | None = None, batch_index: int | None = None) -> "Output":
        if batch_index is not None:
            key = f"batch_{batch_index:03d}_{key or 'data'}"
        self.content.add(key, _json_bytes(val))
        self._hint("application/json")
        return self

    def add_as_string(self, val: str, key: str | None = None, batch_index: int | None = None) -> "Output":
        return self.add(str(val), key=key, batch_index=batch_index)

    def add_stream_content(self, stream: Iterable | AsyncIterator,
                           output_formatter: Callable[[Any], bytes] | None = None) -> "Output":
        """Stream the items of ``stream`` (a sync or async iterable) to the client,
        each as one chunk. ``output_formatter`` turns an item into bytes; without
        one, see ``default_stream_item``."""
        self.stream_content = stream
        self.stream_formatter = output_formatter
        return self

    def _hint(self, content_type: str) -> None:
        if self._content_type_hint is None:
            self._content_type_hint = content_type

    # -- used by the worker
    def body(self) -> bytes:
        """The response body: the content under ``data``, else the first item."""
        if self.content.is_empty():
            return b""
        value = self.content.get("data")
        return bytes(value if value is not None else self.content.value_at(0))

    def headers(self) -> dict[str, str]:
        headers = dict(self.properties)
        if not any(k.lower() == "content-type" for k in headers):
            if self.stream_content is not None:
                headers["content-type"] = "application/jsonlines" if self.stream_formatter is None else \
                    "application/octet-stream"
            elif self._content_type_hint:
                headers["content-type"] = self._content_type_hint
        return headers

    def format_stream_item(self, item: Any) -> bytes:
        if self.stream_formatter is None:
            return default_stream_item(item)
        return bytes(self.stream_formatter(item))
