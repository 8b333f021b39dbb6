"""The answer to one of the frontend's own messages to a worker group (its ``/metrics``, an
adapter's registration), as the group's connection delivers it (``GroupClient`` in
``group_client.py`` owns the connection): the head, the body, the end or the error. The
handler's requests do not come here: rank 0 answers their clients itself
(``container.frontend.early``)."""

from __future__ import annotations

import threading
import time

from container.core.errors import GatewayTimeout, ServingError
from container.core.protocol import Chunk, End, Fail, Head


class WorkerFailed(ServingError):
    """An error the worker group reported for one request; carries its status."""

    def __init__(self, fail: Fail) -> None:
        super().__init__(fail.error)
        self.status = fail.code
        self.message = fail.message


class PendingRequest:
    """The answer to one message, filled in by the group connection's reader thread."""

    def __init__(self, request_id: str) -> None:
        self.id = request_id
        self.tag: tuple[str, str, str] | None = None  # what GroupClient.on_lost is told: nothing
        self._cond = threading.Condition()
        self._head: Head | None = None
        self._chunks: list[bytes] = []
        self._finished = False
        self.error: ServingError | None = None

    def deliver(self, messages: list) -> None:
        """The reader thread: a batch of this request's messages."""
        with self._cond:
            for message in messages:
                if isinstance(message, Head):
                    self._head = message
                elif isinstance(message, Chunk):
                    self._chunks.append(message.data)
                elif isinstance(message, End):
                    self._finished = True
                elif isinstance(message, Fail):
                    self.error = WorkerFailed(message)
            self._cond.notify_all()

    def fail(self, error: ServingError) -> None:
        with self._cond:
            if not self._finished and self.error is None:
                self.error = error
            self._cond.notify_all()

    @property
    def done(self) -> bool:
        return self._finished or self.error is not None

    def wait_done_for(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the answer to end (or fail)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.done, timeout)

    def read_body(self, timeout: float) -> bytes:
        """The whole answer's body, complete within ``timeout`` seconds; raises its error, or
        ``GatewayTimeout``."""
        deadline = time.monotonic() + timeout
        if not self.wait_done_for(max(deadline - time.monotonic(), 0.0)):
            raise GatewayTimeout(f"no whole answer from the worker group within {timeout:g}s")
        if self.error is not None:
            raise self.error
        return b"".join(self._chunks)
