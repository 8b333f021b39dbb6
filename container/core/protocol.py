"""The wire contract between sagelmi's processes.

Every message that crosses a socket between the HTTP frontend (or the
supervisor) and a worker group's rank 0, or between rank 0 and the other ranks
of an MPI group, is one of the structs below, encoded with msgpack and sent as
a frame: a 4-byte big-endian payload length, then the payload. The struct's tag
travels inside the payload, so the receiver picks the right type without
guessing.

Every request on the handler's routes goes to rank 0 before anything of it is read (a
hand-off); rank 0 reads the request and writes its whole answer to the client itself:

    frontend -> rank 0   Attach            ``head``: on the descriptor channel, with the client's
                                           socket, unread but ``prefix``, and the frontend's part
                                           of the answer's HTTP head (``ResponseHead``)
    rank 0 -> frontend   Taken             the request is read (its id, route, fingerprint), unless
                                           the frontend saw it whole (``Attach.seen``)
    rank 0 -> frontend   Head              ``written``: sent before the first byte of the answer
                                           goes to the client
    frontend -> rank 0   Attach            without a descriptor, on the socket: the Head opened or
                                           closed a session, which the frontend's routing now
                                           knows; rank 0 held the answer until then
    rank 0 -> frontend   Chunk*            empty (``progress``): the body is being written, at most
                                           once a second, and at once when a send left part of an
                                           HTTP chunk on the socket or the rest went out (``torn``)
    rank 0 -> frontend   End               rank 0 let go of the socket: the status written, how
                                           the answer ended, whether the connection closes

rank 0 answers on the frontend's connection to it (the one from the process at the channel's
other end). The descriptor channel is a second Unix socket beside rank 0's
(``fd_channel_path``), of ``SOCK_SEQPACKET`` messages, each an ``Attach`` payload with one file
descriptor (``SCM_RIGHTS``; ``send_with_fd`` / ``receive_with_fd``).

The frontend's own request, an ``Invoke`` for ``METRICS_PATH``, is answered by rank 0 itself
(Head, Chunk, End, or Fail) with the Prometheus text of its process, including the engine's
metrics.

    rank 0 -> frontend   Status            health: sent on connect and on every change

LoRA adapters (the frontend's registry is the source of truth; it sends every
registration to every group, and all of them again first thing on every new
connection, so a restarted group gets them before any request):

    frontend -> rank 0   SetAdapter        serve adapter ``name`` from the local ``path``,
                                           or, without a path, stop serving it
    rank 0 -> frontend   End / Fail        done, or why not (with the message's id)

Between the ranks of an MPI group (rank 0 is the leader, the others follow):

    leader -> follower   Invoke, Cancel    every request and its stop (a timeout, the client
                                           gone), in rank 0's order
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
    """Rank 0 writes this answer's HTTP head and body to the client itself (a hand-off): sent
    before the first byte goes to the client, so the frontend knows the client's connection
    carries an answer."""
    held: bool = False
    """The answer opens or closes a stateful session: rank 0 holds it until the frontend's
    routing knows (an ``Attach`` without a descriptor)."""


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
    """The answer is complete. For a hand-off, rank 0 has written all it will to the client and let
    go of its socket: ``code`` is the status it wrote (0: none, the connection must close),
    ``outcome`` how the answer ended (``completed``, ``error``, ``timeout``, ``client_gone``,
    ``refused``: a copy of a poison request, its 422 written),
    ``close`` whether the connection closes now."""

    id: str
    prompt_tokens: int | None = None  # what the engine counted, when it did (the frontend logs them)
    completion_tokens: int | None = None
    body_bytes: int = 0  # body bytes rank 0 wrote to the client itself
    code: int = 0
    outcome: str = ""
    close: bool = False


class ResponseHead(msgspec.Struct, frozen=True):
    """What the frontend puts in the HTTP head of an answer rank 0 writes, around the handler's
    status and headers: the status line's version (``HTTP/1.1``), the ``Server`` header, whether
    the connection closes after the answer, and the headers that follow the handler's (which
    worker group answered; rank 0 adds the request id)."""

    version: str
    server: str
    close: bool
    headers: dict[str, str]


class Attach(msgspec.Struct, tag="attach", frozen=True, omit_defaults=True):
    """A client's connection, with ``head`` on the descriptor channel (a hand-off): its next
    request, which the frontend has not read but ``prefix`` (what it read of it: a head that came
    in pieces or past 64 KiB, bytes gunicorn read ahead), is rank 0's to read (a body of at most
    ``max_body`` bytes) and answer on that connection (``Taken``, ``Head.written``), refusing it
    (422, ``End.outcome`` ``refused``) where its fingerprint is one of ``refused`` (sent while
    copies of some request are refused, when the frontend did not see it whole). On the group's
    connection, for such a request: its answer, which opens or closes a session, goes to the
    client now (the frontend's routing knows the session)."""

    id: str
    head: ResponseHead | None = None
    max_body: int = 0
    seen: bool = False  # a hand-off whose whole request the frontend saw (its fingerprint): no Taken
    trace: dict[str, str] = {}  # a hand-off's: the frontend span's W3C headers (tracing on), the worker's parent
    prefix: bytes = b""  # a hand-off's: what the frontend read of the request (its start)
    refused: dict[str, float] = {}  # a hand-off's: poison requests' fingerprints, the seconds each stays refused


class Taken(msgspec.Struct, tag="taken", frozen=True):
    """Rank 0 read the request of hand-off ``id``: its id (the client's, else a new one), its
    route and its ``fingerprint`` (what the frontend refuses copies of once it stopped groups)."""

    id: str
    request_id: str
    path: str
    fingerprint: str


class Fail(msgspec.Struct, tag="fail", frozen=True, omit_defaults=True):
    id: str
    code: int
    message: str
    error: str


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
    """Whether ``message`` is the last rank 0 sends of its request: an ``End`` or a ``Fail``."""
    return isinstance(message, (End, Fail))


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
# A descriptor-channel message is one datagram: the sender asks for a send buffer this large (the
# kernel caps it at net.core.wmem_max, 425,952 bytes a message at its default) and the receiver
# takes one this large. An Attach's prefix (MAX_PREFIX_BYTES) and refused fingerprints (at most
# MAX_REFUSED_SENT) fit the default with room for the rest.
CHANNEL_MESSAGE_BYTES = 1 << 20
MAX_PREFIX_BYTES = 1 << 18
MAX_REFUSED_SENT = 1000


def receive_with_fd(sock: socket.socket) -> tuple[Message, int | None] | None:
    """One descriptor-channel message and the descriptor that came with it (the caller
    owns it and must close it); ``None`` once the peer has closed the channel. Raises
    ``BlockingIOError`` when nothing is waiting, ``ProtocolError`` for bad bytes (the
    descriptor is closed then)."""
    data, ancillary, _flags, _address = sock.recvmsg(CHANNEL_MESSAGE_BYTES, _FD_SPACE)
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


_CREDENTIALS = struct.Struct("3i")  # SO_PEERCRED's pid, uid, gid


def peer_pid(sock: object) -> int:
    """The process at the other end of a Unix socket (0 when it cannot be told)."""
    try:
        pid, _, _ = _CREDENTIALS.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)  # type: ignore[attr-defined]
        )
    except (AttributeError, OSError, struct.error):
        return 0
    return pid
