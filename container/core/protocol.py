"""The wire contract between sagelmi's processes.

Every message that crosses a socket between the HTTP frontend (or the
supervisor) and a worker group's rank 0, or between rank 0 and the other ranks
of an MPI group, is one of the structs below, encoded with msgpack and sent as
a frame: a 4-byte big-endian payload length, then the payload. The struct's tag
travels inside the payload, so the receiver picks the right type without
guessing.

Conversation, per request id:

    frontend -> rank 0   Invoke            start a request
    rank 0 -> frontend   Head              status code and headers (exactly once)
    rank 0 -> frontend   Chunk*            body bytes, in order
    rank 0 -> frontend   End               the body is complete
                    or   Fail              the request failed (before or after Head)
    frontend -> rank 0   Cancel            abandon it (client gone, timeout)

A streamed answer (``Head.stream``) holds its body until the frontend, having sent the
HTTP headers, says where it goes (exactly once):

    frontend -> rank 0   Attach            on the descriptor channel, with the client's
                                           socket: rank 0 writes the body to it itself,
                                           sends an empty Chunk (``progress``) at most once
                                           a second meanwhile (at once when a send left part
                                           of an HTTP chunk on the socket: ``torn``),
                                           and End / Fail once it has stopped writing;
                    or   Attach            on the socket, ``direct=False``: the body comes
                                           as Chunks

A body rank 0 writes to an HTTP/1.1 client itself ends in one of two ways. Where the
client's socket takes the rest at once, rank 0 says so first, then writes the rest with
the chunked body's end, then lets go of the socket:

    rank 0 -> frontend   End               ``ending``: the answer is whole (its tokens, its body
                                           bytes): the frontend ends the request on its side
                                           (its completion line) and writes nothing more to
                                           the client, not even the chunked body's end
    rank 0 -> frontend   End               rank 0 has written it all and let go of the socket
                                           (only then may anything else go to the client)

Otherwise (a client that has not taken everything yet, an HTTP/1.0 client) rank 0 writes
the rest, lets go of the socket and sends End with the body bytes; the frontend writes the
chunked body's end.

A request that asks for a stream (its body says ``"stream": true``) can hand its client's
socket over before rank 0 answers, so that nothing crosses the frontend before the first
token:

    frontend -> rank 0   Attach            on the descriptor channel, with the client's
                                           socket and the frontend's part of the HTTP head
                                           (``ResponseHead``), before the Invoke
    frontend -> rank 0   Invoke            ``client=True``
    rank 0 -> frontend   Head              ``written=True``: rank 0 writes the head (status,
                                           the handler's headers and the frontend's) and the
                                           body itself, as after an Attach, and ends as above;
                                           the frontend sends no Attach
                    or   Head              ``written=False``: rank 0 let go of the socket (not
                                           a stream, or a head the frontend must write: not
                                           200, session headers ...); as without it
    rank 0 -> frontend   Fail              after a Cancel before the Head: rank 0 let go of the
                                           socket without writing

A connection whose next request, all there, looks like such a request can go to rank 0 before
anything of it is read, so that the frontend does no more than a look at it before rank 0 has
it:

    frontend -> rank 0   Attach            ``max_body`` (a hand-off): on the descriptor
                                           channel, with the client's socket, unread, and the
                                           frontend's part of the HTTP head
    rank 0 -> frontend   Taken             ``served``: rank 0 read the request (its bytes come
                                           back: the frontend's fallback reads them again) and
                                           serves it as an Invoke with ``client``: Head, Chunk
                                           ... as above; not ``served``: rank 0 read nothing (or
                                           gives back what it read), the frontend serves the
                                           request itself

rank 0 answers on the frontend's connection to it (the one from the process at the channel's
other end).

The descriptor channel is a second Unix socket beside rank 0's (``fd_channel_path``), of
``SOCK_SEQPACKET`` messages, each an ``Attach`` payload with one file descriptor
(``SCM_RIGHTS``; ``send_with_fd`` / ``receive_with_fd``).

An ``Invoke`` for ``METRICS_PATH`` is answered by rank 0 itself (Head, Chunk,
End) with the Prometheus text of its process, including the engine's metrics.

    rank 0 -> frontend   Status            health: sent on connect and on every change

LoRA adapters (the frontend's registry is the source of truth; it sends every
registration to every group, and all of them again first thing on every new
connection, so a restarted group gets them before any request):

    frontend -> rank 0   SetAdapter        serve adapter ``name`` from the local ``path``,
                                           or, without a path, stop serving it
    rank 0 -> frontend   End / Fail        done, or why not (with the message's id)

Between the ranks of an MPI group (rank 0 is the leader, the others follow):

    leader -> follower   Invoke, Cancel    every request and cancel, in rank 0's order
    follower -> leader   Status            the follower's own health (loading, ready, failed)
    leader -> follower   Invoke(METRICS_PATH)   asks for the follower's metrics ...
    follower -> leader   Chunk                  ... its Prometheus text, which rank 0 serves
                                                labelled by rank
"""

from __future__ import annotations

import array
import enum
import os
import socket
import struct
from typing import Union

import msgspec

FRAME_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 30  # a frame larger than this means a corrupt stream

# Exit codes of a worker process the supervisor acts on: "the handler could not
# be loaded" stops start-up; "the engine died" and "a rank went away" restart the group.
EXIT_LOAD_FAILED = 3
EXIT_ENGINE_DEAD = 4
EXIT_RANK_LOST = 5

# An Invoke with this path asks the worker for its Prometheus metrics (text format)
# instead of calling the handler.
METRICS_PATH = "/metrics"


class Invoke(msgspec.Struct, tag="invoke", frozen=True):
    id: str
    properties: dict[str, str]
    """The ``Input`` properties of the request: headers, custom attributes, ``requestId``."""
    body: bytes
    path: str = "/invocations"  # the HTTP route; METRICS_PATH is answered by the worker itself
    query: str = ""  # the URL's query string (its parameters become content entries)
    client: bool = False
    """The client's socket came before this on the descriptor channel (an ``Attach`` with a
    ``head``): rank 0 may write a streamed answer's HTTP head and body itself (``Head.written``)."""


class InvokeBatch(msgspec.Struct, tag="invoke_batch", frozen=True):
    """Rank 0 to the other ranks (MPI mode with dynamic batching): the requests
    of one batch, in the order the handler sees them."""

    items: list[Invoke]


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    id: str


class Head(msgspec.Struct, tag="head", frozen=True, omit_defaults=True):
    id: str
    code: int
    headers: dict[str, str]
    stream: bool
    started: float = 0.0
    """``time.monotonic()`` (one clock for every process of the machine) when the handler
    call began, for the frontend's queue-wait metric; 0: not a handler call."""
    written: bool = False
    """Rank 0 writes this stream's HTTP head and body to the client itself (the socket came
    with the ``Invoke``): the frontend writes nothing before the stream's ending ``End``."""


class Chunk(msgspec.Struct, tag="chunk", frozen=True, omit_defaults=True):
    """Body bytes of request ``id``. Empty (``progress``): rank 0 is writing the body to the client
    itself (at most once a second, and at once when ``torn`` changes); the frontend's
    ``predict_timeout`` counts from the last one. ``torn``: the client's socket took part of an
    HTTP chunk and the rest waits in rank 0, so if rank 0 goes away nothing may follow on that
    connection (the frontend closes it instead of ending the body with an error)."""

    id: str
    data: bytes
    torn: bool = False


def progress(id: str, torn: bool = False) -> Chunk:
    """The empty ``Chunk`` that says rank 0 is still writing request ``id``'s body itself."""
    return Chunk(id=id, data=b"", torn=torn)


class End(msgspec.Struct, tag="end", frozen=True, omit_defaults=True):
    """The answer is complete. ``ending``: a body rank 0 writes to the client itself is whole and
    its last bytes, with the chunked body's end, go to the client now; a plain End follows once
    rank 0 has let go of the socket (module docstring)."""

    id: str
    prompt_tokens: int | None = None  # what the engine counted, when it did (the frontend logs them)
    completion_tokens: int | None = None
    body_bytes: int = 0  # body bytes rank 0 wrote to the client itself (an ending End: all of them)
    ending: bool = False


class ResponseHead(msgspec.Struct, frozen=True):
    """What the frontend would put in a streamed answer's HTTP head around the handler's status
    and headers, for rank 0 to write it itself: the status line's version (``HTTP/1.1``), the
    ``Server`` header, whether the connection closes after the answer, and the headers that
    follow the handler's (which worker group answered, the request id)."""

    version: str
    server: str
    close: bool
    headers: dict[str, str]


class Attach(msgspec.Struct, tag="attach", frozen=True, omit_defaults=True):
    """Where a streamed answer's body goes, once the frontend has sent its HTTP headers: the
    client's socket (sent with it on the descriptor channel; framed as HTTP/1.1 chunks when
    ``chunked``), or, ``direct=False``, the frontend (as Chunks). With ``head``, sent before the
    request's ``Invoke`` (``Invoke.client``): the socket of a request whose answer may be a
    stream, whose HTTP head rank 0 then writes itself."""

    id: str
    direct: bool = False
    chunked: bool = True
    head: ResponseHead | None = None
    max_body: int = 0
    """Not 0: a hand-off. The client's connection, whose next request the frontend has not read:
    rank 0 reads it, if it is a request it may read (``container.core.ingress``: ``read_request``
    with ``max_body``) and all there, and answers ``Taken``, ``served`` or not. ``head`` is then
    the frontend's part of a streamed answer's HTTP head, to which rank 0 adds the request id."""


class Taken(msgspec.Struct, tag="taken", frozen=True, omit_defaults=True):
    """Rank 0's answer to a hand-off (``Attach.max_body``). ``served``: it read request ``id`` from the socket and
    serves it as an ``Invoke`` with ``client``; ``raw`` is the request's bytes as the client sent
    them, ``request_id`` its id (the client's, else a new one), ``path`` its route, ``close``
    whether the connection closes after the answer. Not ``served`` (declined): the frontend reads
    the request, after ``raw``, what rank 0 read of it (nothing, unless the socket gave less than
    it had shown)."""

    id: str
    served: bool
    raw: bytes = b""
    request_id: str = ""
    path: str = ""
    close: bool = False


class Fail(msgspec.Struct, tag="fail", frozen=True, omit_defaults=True):
    id: str
    code: int
    message: str
    error: str
    body_bytes: int = 0  # body bytes rank 0 wrote to the client itself before the failure


class WorkerState(str, enum.Enum):
    """The health of a worker group (or of one rank), as ``/ping`` reports it."""

    STARTING = "starting"  # the process is starting: not connected yet
    LOADING = "loading"  # connected; the model is loading
    READY = "ready"  # serving requests
    FAILED = "failed"  # the model could not be loaded (``detail`` says why)
    DOWN = "down"  # the process went away; the supervisor restarts it


class Status(msgspec.Struct, tag="status", frozen=True):
    """Health of a worker group (from rank 0) or of a follower rank (to rank 0).
    ``incarnation`` tells which start of the group the status belongs to."""

    state: WorkerState
    detail: str = ""
    incarnation: int = 0
    rank: int = 0


class SetAdapter(msgspec.Struct, tag="set_adapter", frozen=True, omit_defaults=True):
    """Serve the LoRA adapter in the local directory ``path`` as ``name`` (validated by the
    frontend; the engine loads it and may still refuse it); without ``path``, stop serving it."""

    id: str
    name: str
    path: str | None = None


Message = Union[  # noqa: UP007 (a runtime alias msgspec decodes with; kept in one form)
    Invoke,
    InvokeBatch,
    Cancel,
    Head,
    Chunk,
    End,
    Attach,
    Taken,
    Fail,
    Status,
    SetAdapter,
]


def is_last(message: Message) -> bool:
    """Whether ``message`` is the last rank 0 sends of its request: a plain ``End``, a ``Fail``,
    or a ``Taken`` not ``served``."""
    if isinstance(message, End):
        return not message.ending
    if isinstance(message, Taken):
        return not message.served
    return isinstance(message, Fail)


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


def frame_length(header: bytes | memoryview) -> int:
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
                length = frame_length(view[offset : offset + FRAME_HEADER.size])
                end = offset + FRAME_HEADER.size + length
                if end > size:
                    break
                messages.append(decode(view[offset + FRAME_HEADER.size : end]))
                offset = end
        finally:
            view.release()
        del self._data[:offset]
        return messages

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete frame still waiting for the rest."""
        return len(self._data)


FD_CHANNEL_SUFFIX = ".fd"


def fd_channel_path(socket_path: str) -> str:
    """The descriptor channel of the rank 0 listening on ``socket_path``."""
    return socket_path + FD_CHANNEL_SUFFIX


def send_with_fd(sock: socket.socket, message: Attach, fd: int) -> None:
    """Send ``message`` and a duplicate of ``fd`` as one descriptor-channel message."""
    sock.sendmsg([_encoder.encode(message)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


_FD_SPACE = socket.CMSG_SPACE(array.array("i").itemsize)


def receive_with_fd(sock: socket.socket) -> tuple[Message, int | None] | None:
    """One descriptor-channel message and the descriptor that came with it (the caller
    owns it and must close it); ``None`` once the peer has closed the channel. Raises
    ``BlockingIOError`` when nothing is waiting, ``ProtocolError`` for bad bytes (the
    descriptor is closed then)."""
    data, ancillary, _flags, _address = sock.recvmsg(1 << 16, _FD_SPACE)
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if not data and not fds:
        return None
    try:
        message = decode(data)
    except ProtocolError:
        for fd in fds:
            os.close(fd)
        raise
    for extra in fds[1:]:  # one descriptor a message: any other is closed
        os.close(extra)
    return message, (fds[0] if fds else None)
