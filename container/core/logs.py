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

A record's text can carry what a client sent (a URL path, a header, a model or
adapter name): neither format lets it start a line of its own. JSON escapes
control characters; the text format writes them as escapes (``\\n``, ``\\x1b``)
and indents the lines of a traceback, so that every line at the left margin
begins a record.

Secrets: ``is_secret`` is the one rule for which settings, engine arguments,
environment variables and command-line words hold a secret; ``redacted``,
``redacted_value`` and ``redacted_command`` replace their values with ``***``
wherever such things are logged or printed.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import re
import sys
from collections.abc import Mapping
from typing import Any

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

_FORMAT = "%(asctime)s %(levelname)s %(component)s [%(request_id)s] %(name)s: %(message)s"
FORMATS = ("text", "json")

REDACTED = "***"

# Words that name a secret wherever they stand in a name (``AWS_SECRET_ACCESS_KEY``,
# ``SAGELMI_CLUSTER_SECRET``, ``db_password``); "token" only as the last word (``hf_token``,
# ``AWS_SESSION_TOKEN``, ``use_auth_token``), since elsewhere it counts tokens
# (``max_rolling_batch_prefill_tokens``, ``sink_token_length``); ``*_per_token`` is a unit.
# A bare ``key`` is one too (``watermark_config``'s, which vLLM keeps out of its own logs).
_SECRET_WORDS = frozenset(
    {"secret", "secrets", "password", "passwd", "credential", "credentials", "apikey", "authorization"}
)
_SECRET_PAIRS = frozenset({("api", "key"), ("private", "key")})
_WORD = re.compile(r"[a-z0-9]+")
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")


def is_secret(name: str) -> bool:
    """Whether a setting, engine argument, environment variable or option named ``name``
    holds a secret whose value must not be logged or printed."""
    words = _WORD.findall(_CAMEL.sub(r"\1_\2", name).lower())
    if not words:
        return False
    if _SECRET_WORDS.intersection(words) or words == ["key"]:
        return True
    if words[-1] == "token":
        return len(words) < 2 or words[-2] != "per"
    return any(tuple(words[i : i + 2]) in _SECRET_PAIRS for i in range(len(words) - 1))


def redacted_value(name: str, value: Any) -> Any:
    """``value``, or ``***`` when ``name`` holds a secret and ``value`` is set (an empty or
    missing value is shown: a reader sees that it is not set)."""
    if value is None or value == "" or not is_secret(name):
        return value
    return REDACTED


def redacted(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``mapping`` (engine arguments, settings, an environment) with every secret's
    value replaced by ``***``, in nested mappings and lists of them too; the keys stay, so a
    reader sees what was set."""
    return {str(key): _redacted_item(str(key), value) for key, value in mapping.items()}


def redacted_json(mapping: Mapping[str, Any]) -> str:
    """``mapping`` as one line of JSON for a log, secrets redacted (``redacted``)."""
    return json.dumps(redacted(mapping), default=str, sort_keys=True)


def _redacted_item(name: str, value: Any) -> Any:
    if isinstance(value, Mapping):
        return redacted(value)
    if isinstance(value, (list, tuple)):
        return [_redacted_item(name, item) for item in value]
    return redacted_value(name, value)


def redacted_command(words: list[str]) -> list[str]:
    """A command line for a log: the value of ``NAME=value`` words whose name holds a secret
    (``-x HF_TOKEN=...``, ``--hf-token=...``) and the word after a flag named so
    (``--hf-token ...``) replaced by ``***``."""
    out: list[str] = []
    hide_next = False
    for word in words:
        name, equals, value = word.partition("=")
        if hide_next:
            out.append(REDACTED)
        elif equals and value and is_secret(name.lstrip("-")):
            out.append(f"{name}={REDACTED}")
        else:
            out.append(word)
        hide_next = not hide_next and word.startswith("-") and not equals and is_secret(word.lstrip("-"))
    return out


# Characters that end a line, or move or restyle a terminal's cursor, in a text log: C0 and C1
# controls (the tab excepted), DEL, and Unicode's line and paragraph separators.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
_ESCAPES = {"\n": "\\n", "\r": "\\r"}


def _escape_one(match: re.Match) -> str:
    char = match.group()
    return _ESCAPES.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def escape_controls(text: str) -> str:
    """``text`` on one line: control characters written as escapes (``\\n``, ``\\x1b``)."""
    return text if text.isprintable() else _CONTROL.sub(_escape_one, text)  # the first test is the cheap one


class _ContextFilter(logging.Filter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        record.component = self.component
        return True


class TextFormatter(logging.Formatter):
    """One line per record, the first line of each record at the left margin: control
    characters in the line (the message, its arguments, the request id) are escaped, and the
    lines of a traceback or stack are indented (their own control characters escaped too)."""

    def __init__(self) -> None:
        super().__init__(_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape_controls(super().formatMessage(record))

    def formatException(self, ei) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join("    " + escape_controls(line) for line in text.split("\n"))


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
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
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
