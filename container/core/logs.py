"""Logging for every sagelmi process: one format, and the request id on every
line written while a request is being handled.

The request id lives in a context variable. The frontend sets it per request
thread; the worker sets it per request task, and hands the context to the
threads that run synchronous handlers, so a handler's own ``logging`` calls are
tagged too.
"""

from __future__ import annotations

import contextvars
import logging
import sys

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

_FORMAT = "%(asctime)s %(levelname)s %(component)s [%(request_id)s] %(name)s: %(message)s"


class _ContextFilter(logging.Filter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        record.component = self.component
        return True


def configure(component: str, level: str | int = "INFO") -> None:
    """Send all logging of this process to stderr in sagelmi's format.

    ``component`` names the process on each line (``serve``, ``frontend``,
    ``worker-0``...)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter(component))
    handler.setFormatter(logging.Formatter(_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
