"""SageMaker's stateful sessions on the wire: the header names, the
``NEW_SESSION`` and ``CLOSE`` request forms, and the ``<id>; Expires=<time>``
value of a new session's header. The frontend (sticky routing) and the
handlers (which open and close sessions) both read them from here, and both keep
their sessions in an ``ExpiryIndex``."""

from __future__ import annotations

import heapq
import itertools
import re
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Generic, TypeVar

SESSION_ID = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_ID = "X-Amzn-SageMaker-New-Session-Id"
CLOSED_SESSION_ID = "X-Amzn-SageMaker-Closed-Session-Id"
SESSION_CLOSED = "X-Amzn-SageMaker-Session-Closed"  # "true": what DJL's own stateful example answers on close
# The answer headers that say something of sessions (lower case)
SESSION_HEADERS = frozenset(name.lower() for name in (SESSION_ID, NEW_SESSION_ID, CLOSED_SESSION_ID, SESSION_CLOSED))
_CHANGES = frozenset((NEW_SESSION_ID.lower(), CLOSED_SESSION_ID.lower()))
NEW_SESSION = "NEW_SESSION"
REQUEST_TYPES = ("NEW_SESSION", "CLOSE")  # {"requestType": ...} in the body, as LMI's vLLM handler reads it
EXPIRES_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
# SageMaker's pattern for a session id (InvokeEndpoint's SessionId): letters, digits and inner hyphens
SESSION_ID_PATTERN = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9])*")
MAX_SESSION_ID = 256
DEFAULT_MAX_SESSIONS = 1000  # option.max_sessions' default: open sessions per worker group


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


def changes_sessions(headers: Mapping[str, str]) -> bool:
    """Whether an answer's headers (as ``answer_sessions`` completed them) open or close a session:
    rank 0 holds such an answer until the frontend's routing knows it (``Connection.delivered``)."""
    return any(name.lower() in _CHANGES for name in headers)


def _header(headers: dict[str, str], name: str) -> str | None:
    wanted = name.lower()
    return next((v for k, v in headers.items() if k.lower() == wanted), None)


def answer_sessions(
    asked: str | None, headers: dict[str, str], expiration: float
) -> tuple[dict[str, str], tuple[str, float] | None, str | None]:
    """What a successful answer to a request that named session ``asked`` says of sessions: the
    headers to send (with SageMaker's ``New-Session-Id`` / ``Closed-Session-Id`` added where the
    handler answered in LMI's or DJL's form only; a new session expires ``expiration`` seconds
    from now unless the handler said when), the session it opened (id, expiry) and the one it
    closed."""
    headers = dict(headers)
    opened = None
    value = _header(headers, NEW_SESSION_ID)
    if value is None and (lmi_form := _header(headers, SESSION_ID)) is not None:
        value = lmi_form if parse_new_session(lmi_form)[0] != asked else None
    if value is not None:
        session_id, expires_at = parse_new_session(value)
        if valid_session_id(session_id):
            opened = (session_id, expires_at or time.time() + expiration)
            if _header(headers, NEW_SESSION_ID) is None:
                headers[NEW_SESSION_ID] = new_session_value(*opened)
    closed = _header(headers, CLOSED_SESSION_ID)
    if closed is None and asked and (_header(headers, SESSION_CLOSED) or "").lower() == "true":
        closed = headers[CLOSED_SESSION_ID] = asked
    return headers, opened, closed.strip() if closed is not None else None


T = TypeVar("T")


class ExpiryIndex(Generic[T]):
    """Values by session id, each with an expiry (a Unix time, ``inf`` for never).

    ``take_due`` finds the expired ones without looking at the others: a heap of
    expiries stands beside the dict. Entries removed or replaced before they expire
    stay in the heap, recognised as stale when they reach its top; when stale ones
    outnumber the live, the heap is rebuilt from the dict, which keeps its size
    within twice the live entries at an amortised constant cost per removal.
    Not thread-safe: its owner locks."""

    COMPACT_SLACK = 64

    def __init__(self) -> None:
        self._entries: dict[str, tuple[float, int, T]] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    def get(self, session_id: str) -> T | None:
        entry = self._entries.get(session_id)
        return None if entry is None else entry[2]

    def put(self, session_id: str, expires_at: float, value: T) -> None:
        """Add (or replace) ``session_id``, due at ``expires_at``."""
        number = next(self._counter)
        self._entries[session_id] = (expires_at, number, value)
        heapq.heappush(self._heap, (expires_at, number, session_id))
        self._compact_if_stale()

    def pop(self, session_id: str) -> T | None:
        """Remove ``session_id``; its value, or None when it was not here."""
        entry = self._entries.pop(session_id, None)
        if entry is None:
            return None
        self._compact_if_stale()
        return entry[2]

    def take_due(self, now: float) -> list[tuple[str, T]]:
        """Remove and return the entries due at ``now`` (expiry < ``now``), earliest first."""
        due = []
        while self._heap and self._heap[0][0] < now:
            _, number, session_id = heapq.heappop(self._heap)
            entry = self._entries.get(session_id)
            if entry is not None and entry[1] == number:
                del self._entries[session_id]
                due.append((session_id, entry[2]))
        return due

    def next_expiry(self) -> float | None:
        """When the earliest live entry is due; None when there is none."""
        while self._heap:
            _, number, session_id = self._heap[0]
            entry = self._entries.get(session_id)
            if entry is not None and entry[1] == number:
                return entry[0]
            heapq.heappop(self._heap)
        return None

    def _compact_if_stale(self) -> None:
        if len(self._heap) > 2 * len(self._entries) + self.COMPACT_SLACK:
            self._heap = [(expires_at, number, sid) for sid, (expires_at, number, _) in self._entries.items()]
            heapq.heapify(self._heap)
