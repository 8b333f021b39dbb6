"""The handler API: ``Input``, ``Output`` and ``PairList``, with the methods and
meaning of LMI's ``djl_python``, so an LMI ``model.py`` runs unchanged.

A handler is a module with ``handle(inputs: Input) -> Output | None``. It is
first called once with an empty ``Input`` whose properties are the model
properties (every ``option.*`` without its prefix, the other
``serving.properties`` keys, ``model_dir``, ``device_id``...): that is the
initialisation call. Every request then arrives as an ``Input`` whose
properties are the request headers, the pairs of
``X-Amzn-SageMaker-Custom-Attributes`` and ``requestId``, and whose content is
the query parameters, then the body under the key ``data`` (or, for a form, one
entry per field). ``container.worker.requests`` builds it.

Where LMI's classes have a bug that no handler can rely on (a ``PairList``
constructor form that raises, ``add_all`` of a ``PairList``), these work.
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable
from typing import Any

from container.core.errors import InputError, InvalidJSON
from handlers.api import djl_framing
from handlers.api.pair_list import PairList

log = logging.getLogger(__name__)

# Deeper JSON is refused: nothing a model takes nests this deep, and code that walks a
# parsed body recursively (validation, re-encoding) would hit Python's recursion limit.
MAX_JSON_DEPTH = 128


class _EmptyContent(AttributeError):
    """Text asked of an Input with no content (the initialisation call). An
    ``AttributeError``, as LMI raises there, with a message that says what to do."""


def _depth_within(value: Any, limit: int) -> bool:
    """Whether ``value``'s lists and objects nest at most ``limit`` levels (no recursion)."""
    level = [value]
    for _ in range(limit):
        level = [
            item
            for node in level
            if isinstance(node, (list, dict))
            for item in (node.values() if isinstance(node, dict) else node)
        ]
        if not level:
            return True
    return not any(isinstance(node, (list, dict)) for node in level)


class Input:
    """One request (or the initialisation call) as a handler sees it."""

    def __init__(
        self, properties: dict | None = None, body: bytes | None = None, request_path: str = "/invocations"
    ) -> None:
        self.function_name: str | None = None
        #: The HTTP route the request came in on (``/invocations``, ``/v1/chat/completions``...).
        self.request_path = request_path
        self.properties: dict = dict(properties or {})
        self.content = PairList()
        if body is not None:  # a request, even with an empty body, is never is_empty()
            self.content.add("data", bytes(body))

    def __str__(self) -> str:
        keys = ", ".join(str(k) for k in self.content.get_keys())
        return f"properties: {self.properties}, content keys: [{keys}]"

    # -- batches: LMI's names (``batch_size``; ``batch_000.<key>`` for item 0 ...)
    def is_batch(self) -> bool:
        return "batch_size" in self.properties

    def get_batch_size(self) -> int:
        return int(self.properties.get("batch_size", "1"))

    def get_batches(self) -> list[Input]:
        """The items of a batch (``[self]`` when this is not one)."""
        if not self.is_batch():
            return [self]
        batch = [Input(request_path=self.request_path) for _ in range(self.get_batch_size())]
        for key, value in self.properties.items():
            if key.startswith("batch_") and key != "batch_size":
                batch[int(key[6:9])].properties[key[10:]] = value
        for key, value in zip(self.content.get_keys(), self.content.get_values()):
            batch[int(key[6:9])].content.add(key[10:], value)
        return batch

    # -- properties
    def get_function_name(self) -> str | None:
        return self.function_name

    def get_properties(self) -> dict:
        return self.properties

    def get_property(self, key: str) -> Any:
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

    def get_data(self, key: str | None = None) -> Any:
        """The content decoded after the request's content type, as LMI does."""
        content_type = self.get_property("content-type") or ""
        if content_type == "tensor/ndlist":
            return self.get_as_numpy(key)
        if content_type == "tensor/npz":
            return self.get_as_npz(key)
        if content_type.startswith("application/json"):
            return self.get_as_json(key)
        if content_type.startswith("text/"):
            return self.get_as_string(key)
        if content_type.startswith("image/"):
            return self.get_as_image(key)
        if self.is_empty():
            return None
        return self.get_as_bytes(key=key)

    def get_as_bytes(self, key: str | None = None) -> bytes | None:
        """The body (or the content under ``key``); ``None`` when there is no content."""
        if self.content.is_empty():
            return None
        if key:
            value = self.content.get(key)
            if value is None:
                raise KeyError(f"requested data for key:{key} is not found!")
            return value
        value = self.content.get("data")
        return value if value is not None else self.content.value_at(0)

    def _required_bytes(self, key: str | None) -> bytes:
        data = self.get_as_bytes(key=key)
        if data is None:
            raise _EmptyContent(
                "this Input has no content (the initialisation call has none): "
                "check inputs.is_empty() before reading it"
            )
        return data

    def get_as_string(self, key: str | None = None) -> str:
        return bytes(self._required_bytes(key)).decode("utf-8")

    def get_as_json(self, key: str | None = None) -> Any:
        """The content parsed as JSON. Malformed JSON raises ``InvalidJSON`` (a
        ``json.JSONDecodeError`` that the server answers with 400)."""
        text = self.get_as_string(key=key)
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise InvalidJSON(err) from None
        except RecursionError:
            value = None  # deeper than the parser goes: refused below as too deep
        else:
            if _depth_within(value, MAX_JSON_DEPTH):
                return value
        raise InputError(f"request body is nested too deeply: JSON may nest at most {MAX_JSON_DEPTH} levels")

    def get_as_csv(self, key: str | None = None) -> list[dict]:
        return list(csv.DictReader(io.StringIO(self.get_as_string(key=key))))

    def get_as_image(self, key: str | None = None):
        """The content as a ``PIL.Image``."""
        from PIL import Image

        return Image.open(io.BytesIO(self._required_bytes(key)))

    def get_as_numpy(self, key: str | None = None) -> list:
        """The content (DJL's ``tensor/ndlist``, or npz) as a list of numpy arrays."""
        from handlers.api.np_util import from_nd_list

        return from_nd_list(self._required_bytes(key))

    def get_as_npz(self, key: str | None = None) -> list:
        """The content (numpy's ``.npz``) as a list of arrays, in file order."""
        import numpy as np

        with np.load(io.BytesIO(self._required_bytes(key))) as npz:
            return [npz[name] for name in npz.files]

    def read(self, conn) -> None:
        """Read one request from ``conn`` in DJL's socket framing."""
        djl_framing.read_input(self, conn)


class _JSONEncoder(json.JSONEncoder):
    """LMI's encoder: numpy numbers and arrays, and datetimes, become JSON."""

    def default(self, obj):
        if isinstance(obj, datetime.datetime):
            return str(obj)
        try:
            import numpy as np
        except ImportError:  # pragma: no cover - numpy is always installed with vLLM
            return super().default(obj)
        if isinstance(obj, np.bool_):
            return bool(obj)
        if isinstance(obj, np.integer):
            return int(obj)
        if isinstance(obj, np.floating):
            return float(obj)
        if isinstance(obj, np.ndarray):
            return obj.tolist()
        return super().default(obj)


def json_line(item: Any) -> bytes:
    """``item`` as one compact line of JSON (numpy values included)."""
    return (
        json.dumps(item, ensure_ascii=False, allow_nan=False, cls=_JSONEncoder, separators=(",", ":")).encode("utf-8")
        + b"\n"
    )


def _default_stream_item(item: Any) -> bytearray:
    """LMI's default stream formatter: each item as ``{"outputs": item}`` and a newline."""
    return bytearray((json.dumps({"outputs": item}) + "\n").encode("utf-8"))


_DEFAULT = _default_stream_item


class Output:
    """A handler's answer: status, headers (``properties``), body or stream."""

    def __init__(self, code: int = 200, message: str = "OK") -> None:
        self.code = code
        self.message = message
        self.properties: dict = {}
        self.content = PairList()
        self.stream_content: Iterable | AsyncIterator | None = None
        self.stream_output_formatter: Callable[[Any], Any] | None = None
        self.finalize_function: Callable | None = None
        self.finalize_args: tuple = ()
        #: Per-item status of a batched answer (``error(..., batch_index=i)``): index -> code.
        self.item_codes: dict[int, int] = {}
        self._content_type_hint: str | None = None
        #: An LMI async-mode answer: ``stream_content`` yields ``Output`` chunks (set by the worker).
        self.chunked = False

    def __str__(self) -> str:
        return json.dumps(
            {
                "code": self.code,
                "message": self.message,
                "properties": self.properties,
                "content": {
                    str(k): f"type: {type(v)}" for k, v in zip(self.content.get_keys(), self.content.get_values())
                },
            },
            indent=2,
        )

    def set_code(self, code: int) -> Output:
        self.code = int(code)
        return self

    def set_message(self, message: str) -> Output:
        self.message = message
        return self

    def error(
        self, error: str, code: int = 424, message: str = "invoke handler failure", batch_index: int | None = None
    ) -> Output:
        """Make this an error answer with LMI's JSON envelope. With ``batch_index``
        (sagelmi's addition), only that item of a batch fails."""
        body = {"code": code, "message": message, "error": error}
        if batch_index is not None:
            self.item_codes[batch_index] = code
            return self.add_as_json(body, batch_index=batch_index)
        self.code = code
        self.message = message
        self.add_property("content-type", "application/json")
        return self.add_as_json(body)

    def add_property(self, key: str, val: Any) -> Output:
        """Set a response header (``Content-Type``, custom attributes, ...)."""
        self.properties[key] = val
        return self

    def get_properties(self) -> dict:
        return self.properties

    def get_property(self, key: str) -> Any:
        return self.properties.get(key)

    def add(self, value: Any, key: str | None = None, batch_index: int | None = None) -> Output:
        """Add content: text as UTF-8, bytes as they are, anything else as JSON
        (``None`` too: it becomes ``null``)."""
        if key is not None and not isinstance(key, str):
            log.warning("Output key should be str type, got %s", type(key).__name__)
            key = str(key)
        if batch_index is not None:
            key = f"batch_{batch_index}.{key or ''}"
        if isinstance(value, str):
            self.content.add(key, value.encode("utf-8"))
            self._hint("text/plain; charset=utf-8")
        elif isinstance(value, bytearray):
            self.content.add(key, value)
            self._hint("application/octet-stream")
        elif isinstance(value, (bytes, memoryview)):
            self.content.add(key, bytearray(value))
            self._hint("application/octet-stream")
        else:
            self.content.add(key, self._encode_json(value))
            self._hint("application/json")
        return self

    def add_as_json(self, val: Any, key: str | None = None, batch_index: int | None = None) -> Output:
        self._hint("application/json")
        return self.add(self._encode_json(val), key=key, batch_index=batch_index)

    def add_as_string(self, val: str, key: str | None = None, batch_index: int | None = None) -> Output:
        return self.add(str(val), key=key, batch_index=batch_index)

    def add_as_numpy(self, np_list: Any, key: str | None = None, batch_index: int | None = None) -> Output:
        """Add numpy arrays in DJL's ``tensor/ndlist`` encoding."""
        from handlers.api.np_util import to_nd_list

        return self.add(to_nd_list(np_list), key=key, batch_index=batch_index)

    def add_as_npz(self, np_list: Any, key: str | None = None, batch_index: int | None = None) -> Output:
        """Add numpy arrays as an ``.npz`` file (``arr_0``, ``arr_1`` ...)."""
        import numpy as np

        buffer = io.BytesIO()
        np.savez(buffer, *np_list)
        return self.add(buffer.getvalue(), key=key, batch_index=batch_index)

    def add_stream_content(
        self, stream_content: Iterable | AsyncIterator, output_formatter: Callable[[Any], Any] | None = _DEFAULT
    ) -> Output:
        """Stream the items of ``stream_content`` (a sync or async iterable), each
        as one chunk. By default each item goes out as ``{"outputs": item}`` and a
        newline, as in LMI; ``output_formatter`` turns an item into text or bytes
        instead, and ``None`` sends items as they are."""
        self.stream_content = stream_content
        self.stream_output_formatter = output_formatter
        return self

    @staticmethod
    def _encode_json(val: Any) -> bytearray:
        return bytearray(
            json.dumps(
                val, ensure_ascii=False, allow_nan=False, indent=2, cls=_JSONEncoder, separators=(",", ":")
            ).encode("utf-8")
        )

    write_utf8 = staticmethod(djl_framing.write_utf8)
    binary_encode = staticmethod(djl_framing.binary_encode)

    def finalize(self, finalize_function: Callable, *args: Any) -> Output:
        """Run ``finalize_function(*args)`` once the answer has been sent."""
        self.finalize_function = finalize_function
        self.finalize_args = args
        return self

    def execute_finalize(self) -> Any:
        if self.finalize_function is None:
            return None
        return self.finalize_function(*self.finalize_args)

    def send(self, sock) -> None:
        """Write this answer to socket ``sock`` in DJL's framing (streams item by item)."""
        djl_framing.send_output(self, sock)

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
        """The response headers: the properties, and a content type when the
        handler set none (LMI sends none; a client is better told what came)."""
        headers = {str(k): str(v) for k, v in self.properties.items()}
        if not any(k.lower() == "content-type" for k in headers):
            if self.stream_content is not None:
                headers["content-type"] = (
                    "application/jsonlines" if self.stream_output_formatter is _DEFAULT else "application/octet-stream"
                )
            elif self._content_type_hint and not self.content.is_empty():
                headers["content-type"] = self._content_type_hint
        return headers

    def format_stream_item(self, item: Any) -> bytes:
        """One streamed item as bytes, as LMI sends it."""
        if self.stream_output_formatter is not None:
            item = self.stream_output_formatter(item)
        if type(item) is bytes:  # the common case first: a token's line, once per token
            return item
        if isinstance(item, str):
            return item.encode("utf-8")
        if isinstance(item, (bytes, bytearray, memoryview)):
            return bytes(item)
        return bytes(self._encode_json(item))


def prepend(first: object, rest: AsyncIterator) -> AsyncIterator:
    """``first``, then the items of ``rest``: a stream whose first item was looked at."""
    return Ahead(_Ready(first), rest)


class Ahead:
    """An async stream whose first item is ``first`` (an awaitable: an item already taken, or a
    task taking it, whose end or error is then the stream's) and the rest ``rest``'s, without a
    generator's pass per item on top of ``rest``'s."""

    __slots__ = ("_first", "_rest")

    def __init__(self, first: Awaitable, rest: AsyncIterator) -> None:
        self._first: Awaitable | None = first
        self._rest = rest

    def __aiter__(self) -> Ahead:
        return self

    def __anext__(self) -> Awaitable:
        first = self._first
        if first is None:
            return self._rest.__anext__()
        self._first = None
        return first


class _Ready:
    """An awaitable that gives ``value`` at once."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __await__(self) -> Generator[None, None, object]:
        yield from ()  # a generator that never suspends
        return self.value
