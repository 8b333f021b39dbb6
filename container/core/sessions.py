"""SageMaker's stateful sessions on the wire: the header names, the
``NEW_SESSION`` and ``CLOSE`` request forms, and the ``<id>; Expires=<time>``
value of a new session's header. The frontend (sticky routing) and the
handlers (which open and close sessions) both read them from here."""

from __future__ import annotations

import re
from datetime import datetime, timezone

SESSION_ID = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_ID = "X-Amzn-SageMaker-New-Session-Id"
CLOSED_SESSION_ID = "X-Amzn-SageMaker-Closed-Session-Id"
SESSION_CLOSED = "X-Amzn-SageMaker-Session-Closed"  # "true": what DJL's own stateful example answers on close
# The answer headers the frontend acts on (lower case): an answer with one has its head written there
SESSION_HEADERS = frozenset(name.lower() for name in (SESSION_ID, NEW_SESSION_ID, CLOSED_SESSION_ID, SESSION_CLOSED))
NEW_SESSION = "NEW_SESSION"
REQUEST_TYPES = ("NEW_SESSION", "CLOSE")  # {"requestType": ...} in the body, as LMI's vLLM handler reads it
EXPIRES_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
# SageMaker's pattern for a session id (InvokeEndpoint's SessionId): letters, digits and inner hyphens
SESSION_ID_PATTERN = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9])*")
MAX_SESSION_ID = 256


def expires_text(timestamp: float) -> str:
    """A Unix time as SageMaker writes a session's expiry: ``2026-11-24T22:46:06Z`` (UTC)."""
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).strftime(EXPIRES_FORMAT)


def new_session_value(session_id: str, expires_at: float) -> str:
    """The ``X-Amzn-SageMaker-New-Session-Id`` value: ``<id>; Expires=<time>``."""
    return f"{session_id}; Expires={expires_text(expires_at)}"


def parse_new_session(value: str) -> tuple[str, float | None]:
    """``<id>; Expires=<time>`` -> (id, expiry as Unix time); the expiry is None
    when the value has none or it does not parse."""
    session_id, _, rest = value.partition(";")
    expires = None
    for part in rest.split(";"):
        key, sep, text = part.strip().partition("=")
        if sep and key.strip().lower() == "expires":
            try:
                expires = datetime.strptime(text.strip(), EXPIRES_FORMAT).replace(tzinfo=timezone.utc).timestamp()
            except ValueError:
                expires = None
    return session_id.strip(), expires


def valid_session_id(session_id: str) -> bool:
    """Whether ``session_id`` has SageMaker's form (what InvokeEndpoint accepts)."""
    return len(session_id) <= MAX_SESSION_ID and SESSION_ID_PATTERN.fullmatch(session_id) is not None
