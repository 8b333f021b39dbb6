"""The wire contract between the frontend and model workers.

Every message that crosses a Unix socket between the HTTP frontend (or the
supervisor) and a model worker is one of the structs below, encoded with
msgpack and sent as a frame: a 4-byte big-endian payload length, then the
payload. The struct's tag travels inside the payload, so the receiver picks the
right type without guessing.

Conversation, per request id:

    frontend -> worker   Invoke            start a request
    worker -> frontend   Head              status code and headers (exactly once)
    worker -> frontend   Chunk*            body bytes, in order
    worker -> frontend   End               the body is complete
                    or   Fail              the request failed (before or after Head)
    frontend -> worker   Cancel            abandon it (client gone, timeout)

An ``Invoke`` for ``METRICS_PATH`` is answered by the worker itself (Head, Chunk,
End) with the Prometheus text of its process, including the engine's metrics.

    worker -> frontend   Status            health: sent on connect and on every change

``WorkerSpec`` is the launch contract: the supervisor writes it as JSON and the
worker process reads it at start.
"""

from __future__ import annotations

import struct
from typing import Union

import msgspec

FRAME_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 30  # a frame larger than this means a corrupt stream

# Worker process exit code meaning "the handler could not be loaded": the
# supervisor stops start-up instead of restarting the worker.
EXIT_LOAD_FAILED = 3

# An Invoke with this path asks the worker for its Prometheus metrics (text format)
# instead of calling the handler.
METRICS_PATH = "/metrics"


class Invoke(msgspec.Struct, tag="invoke", frozen=True):
    id: str
    properties: dict[str, str]
    body: bytes
    path: str = "/invocations"  # the HTTP route; METRICS_PATH is answered by the worker itself


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    id: str


class Head(msgspec.Struct, tag="head", frozen=True):
    id: str
    code: int
    headers: dict[str, str]
    stream: bool


class Chunk(msgspec.Struct, tag="chunk", frozen=True):
    id: str
    data: bytes


class End(msgspec.Struct, tag="end", frozen=True):
    id: str


class Fail(msgspec.Struct, tag="fail", frozen=True):
    id: str
    code: int
    message: str
    error: str


class Status(msgspec.Struct, tag="status", frozen=True):
    """Worker health. ``state`` is one of ``loading``, ``ready``, ``failed``."""

    state: str
    detail: str = ""
    pid: int = 0


Message = Union[Invoke, Cancel, Head, Chunk, End, Fail, Status]


class WorkerSpec(msgspec.Struct, frozen=True):
    """Everything a model worker process needs to start.

    ``properties`` are the model properties a handler receives on its
    initialisation call (LMI's ``option.*`` values without the prefix, plus
    ``model_dir``).
    """

    group: int
    socket_path: str
    model_dir: str
    entry_point: str | None
    properties: dict[str, str]
    sync_handler_threads: int
    log_level: str = "INFO"


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class ProtocolError(Exception):
    """The peer sent bytes that are not a valid frame."""


def encode(message: Message) -> bytes:
    """Return ``message`` as one frame (length prefix included)."""
    payload = _encoder.encode(message)
    return FRAME_HEADER.pack(len(payload)) + payload


def decode(payload: bytes | memoryview) -> Message:
    """Decode one frame payload (without its length prefix)."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from exc


def frame_length(header: bytes) -> int:
    (length,) = FRAME_HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES} limit")
    return length


class FrameBuffer:
    """Turns a byte stream into messages: feed it whatever ``recv`` returned,
    get back every message completed so far (a burst of frames costs one system
    call, and its reader can handle them as a batch)."""

    def __init__(self) -> None:
        self._data = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self._data += data
        messages = []
        offset, size = 0, len(self._data)
        view = memoryview(self._data)
        try:
            while size - offset >= FRAME_HEADER.size:
                length = frame_length(view[offset:offset + FRAME_HEADER.size])
                end = offset + FRAME_HEADER.size + length
                if end > size:
                    break
                messages.append(decode(view[offset + FRAME_HEADER.size:end]))
                offset = end
        finally:
            view.release()
        del self._data[:offset]
        return messages

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete frame still waiting for the rest."""
        return len(self._data)


def encode_spec(spec: WorkerSpec) -> bytes:
    return msgspec.json.encode(spec)


def decode_spec(data: bytes) -> WorkerSpec:
    return msgspec.json.decode(data, type=WorkerSpec)
