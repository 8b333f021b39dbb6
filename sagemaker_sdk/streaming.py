"""Reading a streamed answer: JSON lines (LMI's default) or server-sent events
(``option.output_formatter=sse``, TGI mode, the OpenAI schemas), arriving in
pieces cut anywhere — SageMaker's ``invoke_endpoint_with_response_stream``
hands the body over in ``PayloadPart`` events whose boundaries are not line
boundaries, and may fall inside a multi-byte UTF-8 character.

Lines are cut on the byte ``\\n`` before decoding: in UTF-8 that byte never
occurs inside a character, so a character split across parts is whole again by
the time its line is decoded. Pure code: no AWS, no HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

_SSE_FIELDS = ("data", "event", "id", "retry")


class StreamError(RuntimeError):
    """The server ended the stream with an error item (it had answered 200 already)."""

    def __init__(self, message: str, item: dict) -> None:
        super().__init__(message)
        self.item = item


class StreamParser:
    """Feed it the bytes of a stream in any pieces; it returns each JSON item as
    soon as it is complete: a JSON line, or the data of a server-sent event
    (``data: [DONE]`` ends an OpenAI stream and is not an item)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._data: list[str] = []  # data lines of the server-sent event being read

    def feed(self, piece: bytes) -> list[Any]:
        """The items completed by ``piece``."""
        self._buffer += piece
        items: list[Any] = []
        while (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            items.extend(self._line(line))
        return items

    def close(self) -> list[Any]:
        """The items left at the end of the stream (a last line without a newline, an
        event without its blank line)."""
        items = self._line(bytes(self._buffer)) if self._buffer else []
        self._buffer.clear()
        return items + self._dispatch()

    def _line(self, raw: bytes) -> list[Any]:
        line = raw.decode("utf-8").rstrip("\r")
        if not line:
            return self._dispatch()  # a blank line ends an event
        if line.startswith(":"):
            return []  # an SSE comment (keep-alive)
        field, sep, value = line.partition(":")
        if sep and field in _SSE_FIELDS:
            if field == "data":
                self._data.append(value[1:] if value.startswith(" ") else value)
            return []
        return [json.loads(line)]

    def _dispatch(self) -> list[Any]:
        if not self._data:
            return []
        data, self._data = "\n".join(self._data), []
        return [] if data == "[DONE]" else [json.loads(data)]


def parse_stream(pieces: Iterable[bytes]) -> Iterator[Any]:
    """The JSON items of a stream given as pieces of bytes."""
    parser = StreamParser()
    for piece in pieces:
        yield from parser.feed(piece)
    yield from parser.close()


def _error_message(item: dict) -> str:
    error = item.get("error")
    if isinstance(error, dict):  # OpenAI: {"error": {"message", "type", "code"}}
        return str(error.get("message", error))
    if "code" in item and "message" in item:  # sagelmi's envelope: {"code", "message", "error"}
        return f"{item['code']} {item['message']}: {error}" if error else f"{item['code']} {item['message']}"
    return str(error)


def item_text(item: Any) -> str | None:
    """The text an item adds to the answer, or None (an item without text: the
    first OpenAI chunk with the role, a usage chunk).

    LMI and TGI items carry ``token.text`` (LMI's last item also repeats the whole
    ``generated_text``, which is not added again); OpenAI chunks carry the first
    choice's ``delta.content`` (chat) or ``text`` (completion); a handler's
    ``{"outputs": ...}`` items their text. An error item raises ``StreamError``."""
    if not isinstance(item, dict):
        return item if isinstance(item, str) else None
    if isinstance(item.get("token"), dict):
        return item["token"].get("text")
    if isinstance(item.get("choices"), list):
        choice = next((c for c in item["choices"] if c.get("index", 0) == 0), None)
        if choice is None:
            return None
        delta = choice.get("delta")
        return delta.get("content") if isinstance(delta, dict) else choice.get("text")
    if "error" in item:
        raise StreamError(_error_message(item), item)
    outputs = item.get("outputs")
    if isinstance(outputs, str):
        return outputs
    if isinstance(outputs, list) and all(isinstance(o, str) for o in outputs):
        return "".join(outputs)
    return None


def stream_texts(items: Iterable[Any]) -> Iterator[str]:
    """The text pieces of a stream's items, in order (items without text are skipped)."""
    for item in items:
        text = item_text(item)
        if text:
            yield text
