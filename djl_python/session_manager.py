"""LMI's sessions: per-client state kept on disk between requests (pickled
values, or numpy memory maps), each session expiring after a while."""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import tempfile
import time
import uuid

import numpy as np

log = logging.getLogger(__name__)

UUID_PATTERN = re.compile("[0-9a-f-]{36}")


class Session:
    def __init__(self, session_id: str, session_root: str, expiration_ts: float | None = None) -> None:
        self.session_id = session_id
        self.files_path = os.path.join(session_root, session_id)
        self.expiration_ts = expiration_ts if expiration_ts is not None else self.get(".expiration_ts")

    def _path(self, key: str) -> str:
        return os.path.join(self.files_path, key.replace("/", "-"))

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

    def remove(self) -> bool:
        if not os.path.isdir(self.files_path):
            raise ValueError(f"session directory does not exist: {self.session_id}")
        shutil.rmtree(self.files_path)
        return True


class SessionManager:
    """Sessions under ``sessions_path`` (``/dev/shm/djl_sessions`` when there is
    /dev/shm), expiring after ``sessions_expiration`` seconds (1200)."""

    def __init__(self, properties: dict) -> None:
        self.expiration = int(properties.get("sessions_expiration", "1200"))
        default = (
            "/dev/shm/djl_sessions"
            if os.path.isdir("/dev/shm")
            else os.path.join(tempfile.gettempdir(), "djl_sessions")
        )
        self.sessions_path = properties.get("sessions_path", default)
        self.sessions_s3url = properties.get("sessions_s3url")
        if self.sessions_s3url:
            log.warning("sessions_s3url is not used: sessions are kept in %s only", self.sessions_path)
        os.makedirs(self.sessions_path, exist_ok=True)
        self.sessions: dict[str, Session] = {}
        for name in os.listdir(self.sessions_path):
            if UUID_PATTERN.fullmatch(name):
                self.sessions[name] = Session(name, self.sessions_path)

    def create_session(self) -> Session:
        self._clean_expired()
        session_id = str(uuid.uuid4())
        session = Session(session_id, self.sessions_path, time.time() + self.expiration)
        os.makedirs(session.files_path)
        session.put(".expiration_ts", session.expiration_ts)
        self.sessions[session_id] = session
        return session

    def get_session(self, session_id: str) -> Session | None:
        if not session_id or session_id == "NEW_SESSION":
            return None
        session = self.sessions.get(session_id)
        if session is None:
            raise ValueError(f"session not found: {session_id}")
        if session.expiration_ts is not None and session.expiration_ts < time.time():
            return None
        return session

    def close_session(self, session_id: str) -> None:
        if not session_id:
            raise ValueError(f"invalid session_id: {session_id}")
        session = self.sessions.get(session_id)
        if session is None:
            raise ValueError(f"session not found: {session_id}")
        session.remove()
        del self.sessions[session_id]

    def _clean_expired(self) -> None:
        now = time.time()
        for session_id, session in list(self.sessions.items()):
            if session.expiration_ts is not None and session.expiration_ts < now:
                try:
                    session.remove()
                except ValueError:
                    pass
                del self.sessions[session_id]
