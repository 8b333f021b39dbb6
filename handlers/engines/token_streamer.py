"""A ``transformers`` streamer of token ids, for the Accelerate engine's streamed answers."""

from __future__ import annotations

import queue
from collections.abc import Iterator

from container.core.errors import InputError


class TokenStreamer:
    """A ``transformers`` streamer (as ``TextIteratorStreamer``) handing out token ids:
    ``generate`` puts them in its thread, the answer's iterator takes them in another."""

    _END = object()

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.prompt_seen = False
        self.error: Exception | None = None

    def put(self, value) -> None:
        if not self.prompt_seen:  # the prompt (or the decoder's start token) comes first
            self.prompt_seen = True
            return
        for token_id in value.reshape(-1).tolist():
            self.queue.put(token_id)

    def fail(self, exc: Exception) -> None:
        self.error = exc

    def end(self) -> None:
        self.queue.put(self._END)

    def __iter__(self) -> Iterator[int]:
        while (item := self.queue.get()) is not self._END:
            yield item
        if self.error is not None:
            if isinstance(self.error, (TypeError, ValueError)):
                raise InputError(f"invalid generation parameters: {self.error}")
            raise self.error
