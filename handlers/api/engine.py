"""The engine contract: what every built-in engine (vLLM, Accelerate) implements.

The worker owns one engine per process. It starts it with the group's context (typed settings,
layout) and the ``@input_formatter`` / ``@output_formatter`` of a ``model.py`` that has no
``handle`` of its own, then calls ``handle`` for each request (a coroutine, or a plain function
the worker runs on its handler threads), ``check_health`` every second once it is ready,
``add_adapter`` / ``remove_adapter`` for what the frontend registered, and ``shutdown`` when it
stops.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from container.core.errors import InputError
from handlers.api.context import Formatters, WorkerContext
from handlers.api.io import Input

__all__ = ["Engine", "Formatters"]


class Engine(ABC):
    """A built-in engine, started once per worker process."""

    dynamic_batching: ClassVar[bool] = False  # the worker's dynamic batching feeds it, as it feeds a model.py
    serves_adapters: ClassVar[bool] = False  # it serves LoRA adapters (add_adapter / remove_adapter)
    reads_forms: ClassVar[bool] = False  # it reads form fields; False: multipart bodies are refused (415)

    @classmethod
    @abstractmethod
    async def start(cls, context: WorkerContext, formatters: Formatters) -> Engine:
        """Load the model and return the running engine (raises with the reason it cannot)."""

    @abstractmethod
    def handle(self, inputs: Input) -> Any:
        """Answer one request (or a batch): an ``Output``, or ``None`` for an empty input. A
        subclass defines it ``async def`` (run on the worker's loop) or ``def`` (run on a
        handler thread)."""

    def check_health(self) -> None:  # noqa: B027 - an engine without a health signal is always healthy
        """Raise once the engine can no longer serve (its processes died): the group restarts."""

    async def add_adapter(self, name: str, path: str) -> None:
        """Serve the LoRA adapter in ``path`` as ``name`` (``InputError`` if it cannot)."""
        raise InputError(f"the {type(self).__name__} engine does not serve LoRA adapters")

    async def remove_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``."""
        raise InputError(f"the {type(self).__name__} engine does not serve LoRA adapters")

    def shutdown(self) -> None:  # noqa: B027 - nothing to stop by default
        """Stop the engine and the processes it started."""
