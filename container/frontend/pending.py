"""The answer to one request, as a worker group's connection delivers it to the request's
thread (``GroupClient`` in ``group_client.py`` owns the connection): the head, the body's
chunks merged while the thread is busy, the end or the error; and, once a stream's headers
are out, who writes its body to the client (``attach``, or the group itself: ``direct``)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Protocol

from container.core.errors import ClientClosedRequest, GatewayTimeout, ServingError
from container.core.protocol import Chunk, End, Fail, Head


class WorkerFailed(ServingError):
    """An error the worker group reported for one request; carries its status."""

    def __init__(self, fail: Fail) -> None:
        super().__init__(fail.error)
        self.status = fail.code
        self.message = fail.message


class Sink(Protocol):
    """Where a streamed answer can be written without its request thread: the
    client's socket (``sock``), framed as the HTTP server frames the rest of the body
    (HTTP/1.1 chunks when ``chunked``)."""

    sock: socket.socket
    chunked: bool

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
        self.direct = False  # the group writes the body to the client's socket itself (GroupClient.attach)
        self.torn = False  # ... and the client's socket holds part of an HTTP chunk (protocol: Chunk.torn)
        self.progress_at = time.monotonic()  # when the group last said something of this request

    # -- reader thread side
    def deliver(self, messages: list) -> None:
        """Take a batch of this request's messages; wake its thread once, and
        only if it has something to do."""
        head, data, last = None, [], None
        # a Head, then chunks (empty: progress), at most one End or Fail
        for message in messages:
            if isinstance(message, Chunk):
                if message.data:
                    data.append(message.data)
                else:  # progress of a body the group writes itself
                    self.torn = message.torn
            elif isinstance(message, Head):
                head = message
            else:
                last = message
        with self._cond:
            self.progress += 1
            self.progress_at = time.monotonic()
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
                self.body_bytes += last.body_bytes
            elif isinstance(last, Fail):
                self._error = WorkerFailed(last)
                self.body_bytes += last.body_bytes
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
    def head(self) -> Head | None:
        return self._head

    @property
    def tokens(self) -> tuple[int | None, int | None] | None:
        """(prompt, completion) tokens as the group counted them (its ``End``)."""
        last = self.end
        return None if last is None else (last.prompt_tokens, last.completion_tokens)

    @property
    def done(self) -> bool:
        return self._finished or self._error is not None

    def has_head(self) -> bool:
        return self._head is not None or self._error is not None

    def has_data(self) -> bool:
        return bool(self._chunks or self._unsent or self._finished or self._error is not None)

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
