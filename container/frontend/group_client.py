"""The client side of the wire protocol: one connection to one worker group
(its rank 0), shared by many request threads.

``GroupClient`` owns a background thread that (re)connects to the group's Unix
socket and reads every message from it. Status messages update ``state``;
answers are handed to the ``PendingRequest`` of their request id. A request
thread writes its frame itself when no other write is queued or under way and
the socket takes it at once; otherwise the frame goes to a sender thread, which
writes whatever is queued in one write. Request threads wait on their own
``PendingRequest``, which merges the chunks that arrive while its reader is
busy, so a slow client never makes a queue grow one entry per token. Once a
stream's headers are out, the reader thread writes its chunks to the client itself (``attach``).

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

from container.core.errors import ClientClosedRequest, GatewayTimeout, ServiceUnavailable, ServingError
from container.core.protocol import (
    METRICS_PATH,
    Cancel,
    Chunk,
    End,
    Fail,
    FrameBuffer,
    Head,
    Invoke,
    Message,
    ProtocolError,
    RegisterAdapter,
    Status,
    UnregisterAdapter,
    WorkerState,
    encode,
)

log = logging.getLogger("sagelmi.group")

RECONNECT_INTERVAL = 0.1
READ_SIZE = 1 << 18  # read up to this much per system call: a whole backlog of frames at once


class WorkerFailed(ServingError):
    """An error the worker group reported for one request; carries its status."""

    def __init__(self, fail: Fail) -> None:
        super().__init__(fail.error)
        self.status = fail.code
        self.message = fail.message


class Sink(Protocol):
    """Where a streamed answer can be written without its request thread: the
    client's socket, framed as the HTTP server frames the rest of the body."""

    def frame(self, data: bytes) -> bytes: ...

    def send_nowait(self, frame: bytes) -> int:
        """Send what the socket takes now (raises ``OSError`` when the client is gone)."""

    def send_all(self, frame: bytes) -> None:
        """Send all of it, waiting for the client to read."""


class PendingRequest:
    """The answer to one request, filled in by the client's reader thread.

    Once a stream's headers are out, its request thread can ``attach`` a
    ``Sink``: from then on the reader thread writes each chunk to the client's
    socket itself, without waking the request thread, as long as the socket
    takes it at once. What it does not take (a slow client), and every chunk
    after it, is left to the request thread, which writes with back-pressure;
    the reader writes again once that backlog is gone. So at load a token
    costs one system call in the reader thread, not a thread switch."""

    def __init__(self, request_id: str, tag: tuple[str, str, str] | None = None) -> None:
        self.id = request_id
        self.tag = tag  # (fingerprint, request id, route): what GroupClient.on_lost is told
        self._cond = threading.Condition()
        self._head: Head | None = None
        self._chunks: list[bytes] = []
        self._finished = False
        self._error: ServingError | None = None
        self._sink: Sink | None = None
        self._unsent = b""  # the part of a frame the sink did not take; the request thread sends it
        self._writing = False  # the request thread is writing to the client: the reader must not
        self.progress = 0  # batches delivered: a stream written by the reader still shows it is alive
        self.body_bytes = 0  # body bytes received, whoever writes them to the client
        self.end: End | None = None  # the answer's End (with the tokens the group counted)

    # -- reader thread side
    def deliver(self, messages: list) -> None:
        """Take a batch of this request's messages; wake its thread once, and
        only if it has something to do."""
        head, data, last = None, [], None
        for message in messages:  # a Head first, then chunks, then at most one End or Fail
            if isinstance(message, Chunk):
                data.append(message.data)
            elif isinstance(message, Head):
                head = message
            else:
                last = message
        with self._cond:
            self.progress += 1
            if head is not None:
                self._head = head
            if data:  # the batch's chunks of this request go out in one write
                joined = b"".join(data)  # one item: joined is that item, no copy
                self.body_bytes += len(joined)
                if not self._write_direct(joined):
                    self._chunks.append(joined)
            if isinstance(last, End):
                self._finished = True
                self.end = last
            elif isinstance(last, Fail):
                self._error = WorkerFailed(last)
            if self._sink is None or self.has_data():
                self._cond.notify_all()

    def _write_direct(self, data: bytes) -> bool:
        """Write a chunk to the attached sink now if nothing is queued before it;
        False leaves it for the request thread. A chunk for a client that is
        gone is dropped."""
        if self._error is not None:
            return True
        if self._sink is None or self._writing or self._chunks or self._unsent:
            return False
        frame = self._sink.frame(data)
        try:
            sent = self._sink.send_nowait(frame)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._error = ClientClosedRequest("the client closed the connection during the stream")
            return True
        self._unsent = frame[sent:]
        return True

    def fail(self, error: ServingError) -> None:
        with self._cond:
            if not self._finished and self._error is None:
                self._error = error
            self._cond.notify_all()

    @property
    def done(self) -> bool:
        return self._finished or self._error is not None

    def has_head(self) -> bool:
        return self._head is not None or self._error is not None

    def has_data(self) -> bool:
        return bool(self._chunks or self._unsent) or self._finished or self._error is not None

    def wait_head_for(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the ``Head`` (or an error); False if it did not come."""
        with self._cond:
            return self._cond.wait_for(self.has_head, timeout)

    def wait_done_for(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the answer to end (or fail)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.done, timeout)

    def wait_data_for(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for something to take with ``next_data``;
        False if nothing came. The caller is not writing to the client
        meanwhile, so the reader thread writes to an attached sink itself."""
        with self._cond:
            self._writing = False
            return self._cond.wait_for(self.has_data, timeout)

    # -- request thread side
    def wait_head(self, timeout: float) -> Head:
        """Block until the worker answered with a Head; raise its error instead
        if it failed, ``GatewayTimeout`` after ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(self.has_head, timeout):
                raise GatewayTimeout(f"no answer from the model within {timeout:g}s (option.predict_timeout)")
            if self._head is None:
                assert self._error is not None  # has_head(): a Head or an error
                raise self._error
            return self._head

    def attach(self, sink: Sink) -> None:
        """Let the reader thread write the rest of the stream to ``sink``. Called
        by the request thread between two writes of its own."""
        with self._cond:
            self._sink = sink

    def take_over(self) -> None:
        """Make the request thread the only writer to the client from now on
        (before it writes something of its own, an in-band error): the reader
        stops writing, and what the sink left unsent goes out first. Raises
        ``ClientClosedRequest`` if the client is gone."""
        with self._cond:
            self._writing = True
            unsent, self._unsent = self._unsent, b""
        self._send_unsent(unsent)

    def _send_unsent(self, unsent: bytes) -> None:
        """Send what the sink did not take, waiting for the client (the caller is the writer)."""
        if not unsent:
            return
        assert self._sink is not None  # only a sink leaves something unsent (_write_direct)
        try:
            self._sink.send_all(unsent)
        except OSError:
            raise ClientClosedRequest("the client closed the connection during the stream") from None

    def read_body(self, timeout: float) -> bytes:
        """The whole answer body, which must be complete within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        parts = []
        while (data := self.next_data(max(deadline - time.monotonic(), 0.0))) is not None:
            parts.append(data)
        return b"".join(parts)

    def next_data(self, timeout: float) -> bytes | None:
        """Everything received since the last call, as one piece, for the caller
        to write; ``None`` once the answer is complete. Raises the request's
        error, or ``GatewayTimeout`` when nothing arrives for ``timeout``
        seconds. Until the next call the caller is writing to the client, so
        the reader thread leaves chunks to it; a sink's backlog is sent here
        (the answer is then ``b""``)."""
        with self._cond:
            self._writing = False
            ready = self._cond.wait_for(self.has_data, timeout)
            if self._unsent:
                unsent, self._unsent = self._unsent, b""
                self._writing = True
            elif self._chunks:
                data = b"".join(self._chunks)
                self._chunks.clear()
                self._writing = True
                return data
            elif self._error is not None:
                raise self._error
            elif self._finished:
                return None
            else:
                assert not ready
                raise GatewayTimeout(f"the model sent nothing for {timeout:g}s (option.predict_timeout)")
        self._send_unsent(unsent)
        return b""


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
        self._pending: dict[str, PendingRequest] = {}
        self._stopped = threading.Event()
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
    def submit(
        self, invoke: Invoke, require_ready: bool = True, tag: tuple[str, str, str] | None = None
    ) -> PendingRequest:
        """Send ``invoke``; raises ``ServiceUnavailable`` if the group is not
        ready (or, with ``require_ready=False``, not connected). ``tag``: see ``on_lost``."""
        pending = PendingRequest(invoke.id, tag)
        with self._lock:
            if (require_ready and self.state is not WorkerState.READY) or self._sock is None:
                raise ServiceUnavailable(f"worker group {self.name} is {self.state.value}")
            self._pending[invoke.id] = pending
            sock = self._sock
        self._send(sock, encode(invoke))  # a connection that drops fails the request (503) in _lost
        return pending

    def fetch_metrics(self, timeout: float) -> str:
        """The group's Prometheus metrics (text format)."""
        request_id = f"metrics-{uuid.uuid4().hex}"
        pending = self.submit(Invoke(id=request_id, properties={}, body=b"", path=METRICS_PATH), require_ready=False)
        try:
            pending.wait_head(timeout)
            return pending.read_body(timeout).decode("utf-8")
        finally:
            self._pending.pop(request_id, None)

    def send_adapter(self, message: RegisterAdapter | UnregisterAdapter, timeout: float) -> bool:
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
            with pending._cond:
                error = pending._error
            if isinstance(error, WorkerFailed):
                raise error
            return error is None  # a connection that dropped meanwhile: the replay covers it
        finally:
            self._pending.pop(message.id, None)

    def cancel(self, request_id: str) -> None:
        """Abandon a request: the group cancels it; late answers are dropped."""
        pending = self._pending.pop(request_id, None)  # the reader drops it at End or Fail
        sock = self._sock
        if pending is None or sock is None:
            return
        self._send(sock, encode(Cancel(id=request_id)))

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
                else:  # rank 0 answers with these (its InvokeBatch and Broadcast go to the other ranks)
                    answer = cast("Head | Chunk | End | Fail", message)
                    batches.setdefault(answer.id, []).append(answer)
            for request_id, messages in batches.items():
                pending = self._pending.get(request_id)
                if pending is None:
                    continue  # cancelled or timed out: the answer is no longer wanted
                pending.deliver(messages)
                if isinstance(messages[-1], (End, Fail)):
                    self._pending.pop(request_id, None)
        if frames.pending_bytes:
            raise ProtocolError("connection closed in the middle of a frame")

    def _lost(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = None
            orphans = list(self._pending.values())
            self._pending.clear()
        sock.close()
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
