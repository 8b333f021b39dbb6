"""Sticky routing of SageMaker's stateful sessions.

A request with ``X-Amzn-SageMaker-Session-Id: <id>`` must reach the worker group
that created the session: its state (files, a ``model.py``'s memory, the
engine's prefix cache) lives there. ``SessionRoutes`` learns sessions from the
answers: one that carries ``X-Amzn-SageMaker-New-Session-Id`` (or LMI's form,
``X-Amzn-SageMaker-Session-Id`` with a new id) opened a session on the group that
answered, in the group's current *incarnation*; one with
``X-Amzn-SageMaker-Closed-Session-Id`` (or DJL's ``X-Amzn-SageMaker-Session-Closed:
true``) closed it. A session is refused with 400 naming it, never silently served
elsewhere, when it is unknown, closed, expired, or its group has stopped or
restarted since (a new incarnation: the state is gone). 400 is what vLLM's
SageMaker routes answer for a session they do not hold.

The table is indexed by expiry (``ExpiryIndex``): opening a session forgets the
ones expired by then without looking at the others, so no request's cost grows
with the number of open sessions. How many a group may hold is the group's
business (``option.max_sessions``, its ``SessionManager``): only the handler
knows whether a request opens a session, so the table holds what the groups
opened.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from container.core.errors import InputError, ServiceUnavailable
from container.core.protocol import WorkerState
from container.core.sessions import (
    NEW_SESSION,
    SESSION_ID,
    ExpiryIndex,
    answer_sessions,
    expires_text,
    valid_session_id,
)
from container.frontend.group_client import GroupClient

ENDED_KEPT = 10_000  # ended sessions remembered, to say why one is refused


@dataclass(frozen=True)
class _Held:
    group: GroupClient
    incarnation: int
    expires_at: float


class SessionRoutes:
    """Which worker group holds each open session. Thread-safe."""

    def __init__(self, enabled: bool, expiration: float) -> None:
        self.enabled = enabled
        self.expiration = expiration
        self._lock = threading.Lock()
        self._held: ExpiryIndex[_Held] = ExpiryIndex()
        self._ended: OrderedDict[str, str] = OrderedDict()  # session id -> why it ended

    def route(self, session_id: str | None) -> GroupClient | None:
        """The group a request naming ``session_id`` must go to; ``None`` when it
        names none (or ``NEW_SESSION``): any group will do. Raises ``InputError``
        (400) for a session that cannot be served, ``ServiceUnavailable`` while its
        group is busy becoming ready again without having restarted."""
        if not session_id:
            return None
        if not self.enabled:
            raise InputError(
                f"stateful sessions are not enabled (option.enable_stateful_sessions=false); "
                f"remove the {SESSION_ID} header"
            )
        if session_id == NEW_SESSION:
            return None
        if not valid_session_id(session_id):
            raise InputError(f"{SESSION_ID} {session_id[:80]!r} is not a session id (letters, digits, hyphens)")
        with self._lock:
            held = self._held.get(session_id)
            if held is None:
                reason = self._ended.get(session_id)
                if reason is not None:
                    raise InputError(f"session {session_id} {reason}")
                raise InputError(
                    f"session {session_id} is not open on this server (never opened here, or the server "
                    f"restarted since); open one with {SESSION_ID}: {NEW_SESSION}"
                )
            group = held.group
            if time.time() > held.expires_at:
                reason = f"expired at {expires_text(held.expires_at)}"
                raise InputError(f"session {session_id} {self._end(session_id, reason)}")
            if group.incarnation != held.incarnation or group.state in (WorkerState.DOWN, WorkerState.FAILED):
                reason = f"was held by worker group {group.name}, which stopped since: its state is gone"
                raise InputError(f"session {session_id} {self._end(session_id, reason)}")
        if group.state is not WorkerState.READY:
            state = group.state.value
            raise ServiceUnavailable(f"worker group {group.name}, which holds session {session_id}, is {state}")
        return group

    def observe(
        self, asked: str | None, group: GroupClient, incarnation: int, code: int, headers: dict[str, str]
    ) -> dict[str, str]:
        """Learn from an answer of ``group`` (in ``incarnation``) to a request that
        named session ``asked``; returns the headers to send, with SageMaker's
        ``New-Session-Id`` / ``Closed-Session-Id`` added where the handler answered
        in LMI's or DJL's form only."""
        if not self.enabled or code >= 300:
            return dict(headers)
        headers, opened, closed = answer_sessions(asked, headers, self.expiration)
        if opened is not None:
            self._open(opened[0], _Held(group, incarnation, opened[1]))
        if closed is not None:
            with self._lock:
                if self._held.pop(closed) is not None:
                    self._remember(closed, "was closed")
        return headers

    @property
    def open_count(self) -> int:
        return len(self._held)

    def _open(self, session_id: str, held: _Held) -> None:
        with self._lock:
            for other, entry in self._held.take_due(time.time()):
                self._remember(other, f"expired at {expires_text(entry.expires_at)}")
            self._held.put(session_id, held.expires_at, held)
            self._ended.pop(session_id, None)

    def _end(self, session_id: str, reason: str) -> str:
        """Forget an open session (the lock is held), remembering why; returns the reason."""
        self._held.pop(session_id)
        return self._remember(session_id, reason)

    def _remember(self, session_id: str, reason: str) -> str:
        """Remember why a session ended (the lock is held), the latest ``ENDED_KEPT``; returns the reason."""
        self._ended[session_id] = reason
        self._ended.move_to_end(session_id)
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        return reason
