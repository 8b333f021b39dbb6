"""LMI's sessions (``djl_python.session_manager``): state kept on disk between
the requests of one SageMaker session (pickled values, or numpy memory maps),
each session expiring ``sessions_expiration`` seconds after it was created.

The API is LMI's: ``SessionManager(properties)``, ``create_session()``,
``get_session(id)`` (``None`` for ``NEW_SESSION``, an empty id or an expired
session; ``ValueError`` for one it does not know), ``close_session(id)``;
``Session.put/get/get_as_numpy/remove``. Which worker group a session's requests
reach is the frontend's business (``container/frontend/sessions.py``)."""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import tempfile
import threading
import time
import uuid

import numpy as np

from container.core.sessions import NEW_SESSION

log = logging.getLogger(__name__)

UUID_PATTERN = re.compile("[0-9a-f-]{36}")
DEFAULT_EXPIRATION = 20 * 60


def default_sessions_path() -> str:
    """``/dev/shm/djl_sessions`` as LMI, or ``djl_sessions`` in the temporary directory without /dev/shm."""
    return "/dev/shm/djl_sessions" if os.path.isdir("/dev/shm") else os.path.join(tempfile.gettempdir(), "djl_sessions")


class Session:
    def __init__(self, session_id: str, session_root: str, expiration_ts: float | None = None) -> None:
        self.session_id = session_id
        self.files_path = os.path.join(session_root, session_id)
        self.expiration_ts = expiration_ts if expiration_ts is not None else self.get(".expiration_ts")

    def _path(self, key: str) -> str:
        name = key.replace("/", "-")
        if name in ("", ".", ".."):
            raise ValueError(f"invalid session key: {key!r}")
        return os.path.join(self.files_path, name)

    def put(self, key: str, value) -> None:
        with open(self._path(key), "wb") as f:
            pickle.dump(value, f)

    def get(self, key: str, d=None):
        path = self._path(key)
        if not os.path.isfile(path):
            return d
        with open(path, "rb") as f:
            return pickle.load(f)

    def get_as_numpy(self, key: str, shape, dtype=np.float32, create: bool = False) -> np.memmap:
        path = self._path(key)
        if create:
            with open(path, "wb") as f:
                f.truncate(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        return np.memmap(path, dtype=dtype, mode="r+", shape=shape)

    def expired(self, now: float | None = None) -> bool:
        return self.expiration_ts is not None and (now or time.time()) > self.expiration_ts

    def remove(self) -> bool:
        if not os.path.isdir(self.files_path):
            raise ValueError(f"session directory does not exist: {self.session_id}")
        shutil.rmtree(self.files_path)
        return True


class SessionManager:
    """Sessions under ``sessions_path`` (default: ``default_sessions_path()``),
    expiring after ``sessions_expiration`` seconds (1200). Safe to share between
    the threads of a synchronous handler."""

    def __init__(self, properties: dict) -> None:
        self.expiration = int(properties.get("sessions_expiration") or DEFAULT_EXPIRATION)
        self.sessions_path = properties.get("sessions_path") or default_sessions_path()
        self.sessions_s3url = properties.get("sessions_s3url")
        if self.sessions_s3url:
            log.warning("sessions_s3url is not used: sessions are kept in %s only", self.sessions_path)
        os.makedirs(self.sessions_path, exist_ok=True)
        self._lock = threading.RLock()
        self.sessions: dict[str, Session] = {}
        for name in os.listdir(self.sessions_path):  # LMI takes up the sessions it finds on disk
            if UUID_PATTERN.fullmatch(name):
                self.sessions[name] = Session(name, self.sessions_path)

    def create_session(self) -> Session:
        with self._lock:
            self._clean_expired_session()
            session_id = str(uuid.uuid4())
            session = Session(session_id, self.sessions_path, time.time() + self.expiration)
            os.makedirs(session.files_path)
            session.put(".expiration_ts", session.expiration_ts)
            self.sessions[session_id] = session
            log.info("session %s created (expires in %ds)", session_id, self.expiration)
            return session

    def get_session(self, session_id: str | None) -> Session | None:
        if not session_id or session_id == NEW_SESSION:
            return None
        with self._lock:
            session = self.sessions.get(session_id)
        if session is None:
            raise ValueError(f"session not found: {session_id}")
        return None if session.expired() else session

    def close_session(self, session_id: str | None) -> None:
        if not session_id:
            raise ValueError(f"invalid session_id: {session_id}")
        with self._lock:
            session = self.sessions.get(session_id)
            if session is None:
                raise ValueError(f"session not found: {session_id}")
            del self.sessions[session_id]
        session.remove()
        log.info("session %s closed", session_id)

    def _clean_expired_session(self) -> None:
        now = time.time()
        with self._lock:
            for session_id, session in list(self.sessions.items()):
                if session.expired(now):
                    del self.sessions[session_id]
                    try:
                        session.remove()
                    except (ValueError, OSError):
                        pass
