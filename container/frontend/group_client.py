"""The client side of the wire protocol: one connection to one worker group
(its rank 0), shared by the frontend's threads.

``GroupClient`` owns a background thread that (re)connects to the group's Unix
socket and reads every message from it. Status messages update ``state``;
answers go to what waits for their request id: a hand-off's ``HandedOff``
(``container.frontend.early``: rank 0 answers the client itself, ``hand_off``), or the
``PendingRequest`` of the frontend's own messages (``/metrics``, adapters). A thread writes
its frame itself when no other write is queued or under way and the socket takes it at
once; otherwise the frame goes to a sender thread, which writes whatever is queued in one
write.

When the connection drops, every request in flight on it fails at once with
503 and the client keeps trying to reconnect (a restarted group binds the same
path). The frontend holds one per group to send requests; the supervisor holds
one per group to learn its state.

``on_connect`` (optional) gives the messages a new connection starts with,
before any request can use it: the frontend replays its LoRA adapter registry
there, so a restarted group serves every registered adapter.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Protocol, cast

from container.core.errors import GatewayTimeout, ServiceUnavailable, ServingError
from container.core.protocol import (
    CHANNEL_MESSAGE_BYTES,
    METRICS_PATH,
    Attach,
    Chunk,
    End,
    Fail,
    FrameBuffer,
    Head,
    Invoke,
    Message,
    ProtocolError,
    ResponseHead,
    SetAdapter,
    Status,
    Taken,
    WorkerState,
    encode,
    fd_channel_path,
    is_last,
    send_with_fd,
)
from container.frontend.pending import PendingRequest, WorkerFailed


class Answered(Protocol):
    """What the reader thread hands a request's answers to: a ``PendingRequest``, or a connection
    rank 0 answers itself (``container.frontend.early.HandedOff``)."""

    id: str
    tag: tuple[str, str, str] | None

    def deliver(self, messages: list) -> None: ...

    def fail(self, error: ServingError) -> None: ...


log = logging.getLogger("sagelmi.group")

RECONNECT_INTERVAL = 0.1
CHANNEL_TIMEOUT = 5.0  # for connecting to a group's descriptor channel and sending on it
READ_SIZE = 1 << 18  # read up to this much per system call: a whole backlog of frames at once


class GroupClient:
    """A connection to one worker group, re-established whenever it drops."""

    def __init__(self, name: str, socket_path: str) -> None:
        self.name = name
        self.socket_path = socket_path
        self.state = WorkerState.STARTING
        self.detail = ""
        self.incarnation = 0  # which start of the group the last Status came from
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._outbox: list[tuple[socket.socket, bytes]] = []  # frames for the sender thread, in order
        self._writing = False  # a thread is writing to the socket: the others queue behind it
        self._outbox_ready = threading.Condition()
        self._pending: dict[str, Answered] = {}
        self._stopped = threading.Event()
        self._channel: socket.socket | None = None  # the group's descriptor channel, while connected
        self._channel_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"group-{name}", daemon=True)
        self._sender = threading.Thread(target=self._send_queued, name=f"group-{name}-send", daemon=True)
        self.on_connect: Callable[[], list[Message]] | None = None
        # Told the tags of the requests in flight when the connection dropped (the group died)
        self.on_lost: Callable[[str, list[tuple[str, str, str]]], None] | None = None
        self.last_words = ""  # why the group's current start said it stops (a DOWN Status), if it did

    def start(self) -> GroupClient:
        self._thread.start()
        self._sender.start()
        return self

    def close(self) -> None:
        self._stopped.set()
        with self._outbox_ready:
            self._outbox_ready.notify()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def connected(self) -> bool:
        return self._sock is not None

    # -- requests
    def submit(self, invoke: Invoke, require_ready: bool = True) -> PendingRequest:
        """Send ``invoke``; raises ``ServiceUnavailable`` if the group is not
        ready (or, with ``require_ready=False``, not connected)."""
        pending = PendingRequest(invoke.id)
        sock = self._register(pending, require_ready)
        self._send(sock, encode(invoke))  # a connection that drops fails the request (503) in _lost
        return pending

    def hand_off(
        self,
        client: socket.socket,
        head: ResponseHead,
        max_body: int,
        answered: Answered,
        seen: bool = False,
        trace: dict[str, str] | None = None,
        prefix: bytes = b"",
        refused: dict[str, float] | None = None,
    ) -> None:
        """Hand a client's connection to the group with its next request unread (an ``Attach`` with
        ``head``): rank 0 reads the request and answers it on that connection; ``answered`` learns
        what rank 0 says of it. Raises ``ServiceUnavailable`` if the group is not ready or its
        descriptor channel did not take it. ``seen``: the frontend saw the whole request (no ``Taken``);
        ``trace``: its span's W3C headers (tracing on); ``prefix``: what the frontend read of the
        request; ``refused``: poison fingerprints rank 0 refuses (``PoisonRequests.refusals``)."""
        self._register(answered, require_ready=True)
        attach = Attach(
            id=answered.id,
            head=head,
            max_body=max_body,
            seen=seen,
            trace=trace or {},
            prefix=prefix,
            refused=refused or {},
        )
        if not self._hand_over(attach, client):
            self._pending.pop(answered.id, None)
            raise ServiceUnavailable(f"worker group {self.name}'s descriptor channel is not available")

    def _register(self, pending: Answered, require_ready: bool) -> socket.socket:
        """Expect answers for ``pending`` on the group's connection, which is returned; raises
        ``ServiceUnavailable`` if the group is not ready (or, without ``require_ready``, not connected)."""
        with self._lock:
            if (require_ready and self.state is not WorkerState.READY) or self._sock is None:
                raise ServiceUnavailable(f"worker group {self.name} is {self.state.value}")
            self._pending[pending.id] = pending
            return self._sock

    def fetch_metrics(self, timeout: float) -> str:
        """The group's Prometheus metrics (text format)."""
        request_id = f"metrics-{uuid.uuid4().hex}"
        pending = self.submit(Invoke(id=request_id, properties={}, body=b"", path=METRICS_PATH), require_ready=False)
        try:
            return pending.read_body(timeout).decode("utf-8")
        finally:
            self._pending.pop(request_id, None)

    def send_adapter(self, message: SetAdapter, timeout: float) -> bool:
        """Send an adapter message and wait for the group's answer; raise its error
        (``WorkerFailed``). False when the group is not connected: it gets the
        registry when it connects."""
        pending = PendingRequest(message.id)
        with self._lock:
            if self._sock is None:
                return False
            self._pending[message.id] = pending
            sock = self._sock
        try:
            self._send(sock, encode(message))
            if not pending.wait_done_for(timeout):
                raise GatewayTimeout(f"worker group {self.name} did not answer within {timeout:g}s")
            error = pending.error
            if isinstance(error, WorkerFailed):
                raise error
            return error is None  # a connection that dropped meanwhile: the replay covers it
        finally:
            self._pending.pop(message.id, None)

    def routed(self, request_id: str) -> None:
        """Tell rank 0 the routing knows the session a hand-off's answer opens or closes: it
        writes the answer, which it held until now (an ``Attach`` without a descriptor)."""
        sock = self._sock
        if sock is not None:  # no connection: the request fails with it
            self._send(sock, encode(Attach(id=request_id)))

    def _hand_over(self, message: Attach, client: socket.socket) -> bool:
        """Send ``message`` with ``client``'s descriptor on the descriptor channel (connected on
        first use after each connect); False when it cannot be done."""
        with self._channel_lock:
            channel = self._channel
            if channel is None and self._sock is not None:
                channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                channel.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CHANNEL_MESSAGE_BYTES)  # an Attach's prefix
                channel.settimeout(CHANNEL_TIMEOUT)
                try:
                    channel.connect(fd_channel_path(self.socket_path))
                except OSError as exc:
                    log.warning(
                        "worker group %s's descriptor channel: %s; streams go through the frontend", self.name, exc
                    )
                    channel.close()
                    return False
                self._channel = channel
        if channel is None:
            return False
        try:
            send_with_fd(channel, message, client.fileno())
        except OSError:
            self._close_channel(channel)
            return False
        return True

    def _close_channel(self, channel: socket.socket | None = None) -> None:
        with self._channel_lock:
            if channel is None or channel is self._channel:
                channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def _send(self, sock: socket.socket, frame: bytes) -> None:
        """Write ``frame`` to ``sock`` now if nothing is queued or being written and the
        socket takes it without waiting; otherwise queue it (what was not taken) for the
        sender thread. A request thread never waits for the socket, and never holds a
        lock around a system call (a thread that holds a lock the others need and then
        waits for the GIL after its write: that convoy held new requests for up to
        seconds at 32-64 streams). At one stream this saves waking the sender thread."""
        with self._outbox_ready:
            if self._outbox or self._writing:
                self._outbox.append((sock, frame))
                self._outbox_ready.notify()
                return
            self._writing = True
        try:
            sent = sock.send(frame, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError:
            sent = len(frame)  # the connection broke: the reader thread notices, and fails its requests
        with self._outbox_ready:
            self._writing = False
            if sent < len(frame):  # the rest goes before anything queued meanwhile
                self._outbox.insert(0, (sock, frame[sent:]))
            if self._outbox:
                self._outbox_ready.notify()

    def _send_queued(self) -> None:
        """The sender thread: writes what is queued, in order, every frame queued
        meanwhile in one write. Frames for a connection that has been replaced
        are dropped (their requests failed with it); a write that fails leaves
        the reader thread to notice the broken connection."""
        while True:
            with self._outbox_ready:
                while (not self._outbox or self._writing) and not self._stopped.is_set():
                    self._outbox_ready.wait()
                if self._stopped.is_set():
                    return
                queued, self._outbox = self._outbox, []
                self._writing = True
            sock = self._sock
            frames = [frame for target, frame in queued if target is sock]
            try:
                if frames and sock is not None:  # no connection: no frame is queued for it
                    sock.sendall(b"".join(frames))
            except OSError:
                pass
            finally:
                with self._outbox_ready:
                    self._writing = False
                    if self._outbox:
                        self._outbox_ready.notify()

    # -- reader thread
    def _set_state(self, state: WorkerState, detail: str = "") -> None:
        self.state, self.detail = state, detail

    def _run(self) -> None:
        while not self._stopped.is_set():
            sock = self._connect()
            if sock is None:
                return
            try:
                self._read(sock)
            except (OSError, ProtocolError) as exc:
                if not self._stopped.is_set():
                    log.warning("connection to worker group %s broke: %s", self.name, exc)
            finally:
                self._lost(sock)

    def _connect(self) -> socket.socket | None:
        while not self._stopped.is_set():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.socket_path)
            except OSError:
                sock.close()
                time.sleep(RECONNECT_INTERVAL)
                continue
            try:
                for message in self.on_connect() if self.on_connect is not None else []:
                    sock.sendall(encode(message))
            except OSError:
                sock.close()
                time.sleep(RECONNECT_INTERVAL)
                continue
            with self._lock:
                self._sock = sock
            return sock
        return None

    def _read(self, sock: socket.socket) -> None:
        frames = FrameBuffer()
        while data := sock.recv(READ_SIZE):
            # Everything that arrived is handled as one batch: each request's thread
            # wakes once per batch, so a reader that fell behind catches up faster.
            batches: dict[str, list] = {}
            for message in frames.feed(data):
                if isinstance(message, Status):
                    self.incarnation = message.incarnation
                    self._set_state(message.state, message.detail)
                    self.last_words = message.detail if message.state is WorkerState.DOWN else ""
                else:  # rank 0 answers with these (its InvokeBatch goes to the other ranks)
                    answer = cast("Head | Chunk | End | Fail | Taken", message)
                    batches.setdefault(answer.id, []).append(answer)
            for request_id, messages in batches.items():
                pending = self._pending.get(request_id)
                if pending is None:
                    continue  # cancelled or timed out: the answer is no longer wanted
                pending.deliver(messages)
                if is_last(messages[-1]):
                    self._pending.pop(request_id, None)
        if frames.pending_bytes:
            raise ProtocolError("connection closed in the middle of a frame")

    def _lost(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = None
            orphans = list(self._pending.values())
            self._pending.clear()
        sock.close()
        self._close_channel()
        if self._stopped.is_set():
            return
        if self.state not in (WorkerState.FAILED, WorkerState.DOWN):  # a DOWN Status said why
            self._set_state(WorkerState.DOWN, "the worker group's process is not running")
        if orphans:
            log.error("worker group %s went away with %d request(s) in flight", self.name, len(orphans))
            tags = [pending.tag for pending in orphans if pending.tag is not None]
            if tags and self.on_lost is not None:
                self.on_lost(self.name, tags)
        for pending in orphans:
            pending.fail(
                ServiceUnavailable(
                    f"worker group {self.name} stopped while handling the request; it is being restarted, retry"
                )
            )
