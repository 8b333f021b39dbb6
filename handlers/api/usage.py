"""What one request used, as its handler reports it: tokens in and out.

The worker gives every request a ``RequestUsage`` in a context variable before it
calls the handler, and sends the counts back with the answer's end (the
frontend puts them in the request's completion log line and span). The
built-in vLLM engine counts them from the engine's outputs; a ``model.py`` may
call ``count_tokens`` itself. ``trace_headers`` are the W3C headers of the
worker's span around the call (empty when tracing is off), for an engine that
traces on its own (vLLM's ``trace_headers``).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field


@dataclass
class RequestUsage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    trace_headers: dict[str, str] = field(default_factory=dict)

    def add(self, prompt: int = 0, completion: int = 0) -> None:
        self.prompt_tokens = (self.prompt_tokens or 0) + prompt
        self.completion_tokens = (self.completion_tokens or 0) + completion


current_usage: contextvars.ContextVar[RequestUsage | None] = contextvars.ContextVar("sagelmi_usage", default=None)


def count_tokens(prompt: int = 0, completion: int = 0) -> None:
    """Add to the token counts of the request being handled (nothing outside a request)."""
    usage = current_usage.get()
    if usage is not None:
        usage.add(prompt, completion)
