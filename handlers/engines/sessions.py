"""Stateful sessions in the built-in engines, as LMI's vLLM handler keeps them:
``{"requestType": "NEW_SESSION"}`` opens a session (a directory under
``option.sessions_path``, ``handlers/api/sessions.py``) and answers its id in
``X-Amzn-SageMaker-New-Session-Id: <id>; Expires=<time>``; ``{"requestType":
"CLOSE"}`` with ``X-Amzn-SageMaker-Session-Id: <id>`` removes it and answers
``X-Amzn-SageMaker-Closed-Session-Id: <id>``. Every other request that names a
session must name a live one. As in LMI, a session holds no engine state: the
engine's prefix cache is what a session's requests share, and the frontend's
sticky routing sends them all to the group that holds it.

Refusals are 400 naming the session, as vLLM's SageMaker routes answer an unknown
session (LMI answers 424 for the same); a new session past ``option.max_sessions``
open ones is 429 (``TooManySessions``, from the ``SessionManager``)."""

from __future__ import annotations

import logging

from container.core.errors import InputError
from container.core.sessions import CLOSED_SESSION_ID, NEW_SESSION, NEW_SESSION_ID, SESSION_ID, new_session_value
from container.core.settings import Settings
from handlers.api import Input, Output
from handlers.api.sessions import SessionManager

log = logging.getLogger("sagelmi.sessions")


class EngineSessions:
    """The sessions of one worker group's built-in engine (``None`` manager: disabled)."""

    def __init__(self, settings: Settings) -> None:
        self.manager: SessionManager | None = None
        if settings.enable_stateful_sessions:
            properties = {
                "sessions_expiration": str(settings.sessions_expiration),
                "max_sessions": str(settings.max_sessions),
            }
            if settings.sessions_path:
                properties["sessions_path"] = settings.sessions_path
            self.manager = SessionManager(properties)

    def check(self, session_id: str) -> None:
        """Refuse a request that names ``session_id``, a session this group does not hold
        (unknown, closed or expired), or any session when sessions are off."""
        if session_id == NEW_SESSION:
            return
        manager = self._enabled(f"{SESSION_ID} {session_id}")
        try:
            session = manager.get_session(session_id)
        except ValueError:
            raise InputError(f"session {session_id} is not open on this server") from None
        if session is None:
            raise InputError(f"session {session_id} has expired")

    def answer(self, inputs: Input, body: dict) -> Output:
        """Answer a ``{"requestType": ...}`` body: open or close a session."""
        request_type = body.get("requestType")
        manager = self._enabled(f"requestType {request_type}")
        if request_type == "NEW_SESSION":
            session = manager.create_session()
            assert session.expiration_ts is not None  # a new session always has one
            return (
                Output()
                .add_property(NEW_SESSION_ID, new_session_value(session.session_id, session.expiration_ts))
                .add_as_json({"result": f"Session {session.session_id} created"})
            )
        if request_type == "CLOSE":
            session_id = inputs.get_property(SESSION_ID)
            if not session_id or session_id == NEW_SESSION:
                raise InputError(f'{{"requestType": "CLOSE"}} needs the session to close in {SESSION_ID}')
            try:
                manager.close_session(session_id)
            except ValueError:
                raise InputError(f"session {session_id} is not open on this server") from None
            return (
                Output()
                .add_property(CLOSED_SESSION_ID, session_id)
                .add_as_json({"result": f"Session {session_id} closed"})
            )
        raise InputError(f"requestType must be NEW_SESSION or CLOSE, not {request_type!r}")

    def _enabled(self, what: str) -> SessionManager:
        if self.manager is None:
            raise InputError(f"stateful sessions are not enabled (option.enable_stateful_sessions=false): {what}")
        return self.manager
