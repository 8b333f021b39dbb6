"""LMI's ``djl_python.session_manager``: sessions kept on disk between the
requests of one SageMaker session (``handlers/api/sessions.py``)."""

from handlers.api.sessions import UUID_PATTERN, Session, SessionManager

__all__ = ["UUID_PATTERN", "Session", "SessionManager"]
