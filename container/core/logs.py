"""Logging for every sagelmi process: one format, and the request id on every
line written while a request is being handled.

The request id lives in a context variable. The frontend sets it per request
thread; the worker sets it per request task, and hands the context to the
threads that run synchronous handlers, so a handler's own ``logging`` calls are
tagged too, and so are the lines of libraries that log in the worker's process
once their loggers are ``adopt``ed (vLLM's ``AsyncLLM``).

Two formats (the ``log_format`` setting, ``SAGELMI_LOG_FORMAT``): ``text``, one
line per record, and ``json``, one JSON object per line with the same fields
(``time``, ``level``, ``component``, ``request_id``, ``logger``, ``message``),
the ``fields`` a record carries (the frontend's completion line: route, status,
duration ...) and, for an exception, ``exception``.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import sys

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

_FORMAT = "%(asctime)s %(levelname)s %(component)s [%(request_id)s] %(name)s: %(message)s"
FORMATS = ("text", "json")


class _ContextFilter(logging.Filter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        record.component = self.component
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "component": getattr(record, "component", ""),
            "request_id": getattr(record, "request_id", "-"),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(component: str, level: str | int = "INFO", fmt: str = "text") -> None:
    """Send all logging of this process to stderr in sagelmi's format.

    ``component`` names the process on each line (``serve``, ``frontend``,
    ``worker-0``...); ``fmt`` is ``text`` or ``json``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter(component))
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def adopt(*names: str) -> None:
    """Route the loggers ``names`` through this process's handler (sagelmi's format,
    the request id) instead of the handlers their library gave them: vLLM
    configures a ``vllm`` logger of its own that does not propagate. Their levels
    are kept."""
    for name in names:
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.propagate = True
