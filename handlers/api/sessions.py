"""LMI's sessions (``djl_python.session_manager``): state kept on disk between
the requests of one SageMaker session (pickled values, or numpy memory maps),
each session expiring ``sessions_expiration`` seconds after it was created.

The API is LMI's: ``SessionManager(properties)``, ``create_session()``,
``get_session(id)`` (``None`` for ``NEW_SESSION``, an empty id or an expired
session; ``ValueError`` for one it does not know), ``close_session(id)``;
``Session.put/get/get_as_numpy/remove``. Which worker group a session's requests
reach is the frontend's business (``container/frontend/sessions.py``).

Bounded, unlike LMI's: at most ``max_sessions`` sessions opened by a manager are
open at once (``create_session`` raises ``TooManySessions``, 429, past it), and a
thread of the manager removes each session's files when it expires, without
waiting for traffic. The sessions are indexed in memory by expiry: no request
lists the directory or looks at every session."""

from __future__ import annotations

import logging
import math
import os
import pickle
import re
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections import OrderedDict

import numpy as np
from prometheus_client import Counter

from container.core.errors import TooManySessions
from container.core.sessions import DEFAULT_MAX_SESSIONS, NEW_SESSION, ExpiryIndex

log = logging.getLogger(__name__)

UUID_PATTERN = re.compile("[0-9a-f-]{36}")
DEFAULT_EXPIRATION = 20 * 60
SWEEP_IDLE = 60.0  # the sweeper's longest sleep: it also notices then that its manager is gone
SWEEP_LATE = 0.01  # seconds after an expiry the sweeper wakes, so that the session is due then
EXPIRED_KEPT = 10_000  # expired sessions remembered, for get_session to answer None rather than raise

# In the worker's own registry: /metrics shows it per worker group (and rank)
SESSIONS_REFUSED = Counter(
    "sagelmi_sessions_refused", "New stateful sessions refused because option.max_sessions sessions were open"
)


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
    expiring after ``sessions_expiration`` seconds (1200), at most ``max_sessions``
    (1000) of its own open at once. Safe to share between the threads of a
    synchronous handler and with an async one's loop."""

    def __init__(self, properties: dict) -> None:
        self.expiration = int(properties.get("sessions_expiration") or DEFAULT_EXPIRATION)
        self.max_sessions = int(properties.get("max_sessions") or DEFAULT_MAX_SESSIONS)
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be 1 or more, not {self.max_sessions}")
        self.sessions_path = properties.get("sessions_path") or default_sessions_path()
        self.sessions_s3url = properties.get("sessions_s3url")
        if self.sessions_s3url:
            log.warning("sessions_s3url is not used: sessions are kept in %s only", self.sessions_path)
        os.makedirs(self.sessions_path, exist_ok=True)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # the sweeper waits on it for an earlier expiry
        self._index: ExpiryIndex[Session] = ExpiryIndex()
        self._opened: set[str] = set()  # the sessions this manager created: what max_sessions counts
        self._expired: OrderedDict[str, None] = OrderedDict()
        with self._lock:
            for name in os.listdir(self.sessions_path):  # LMI takes up the sessions it finds on disk
                if UUID_PATTERN.fullmatch(name):
                    self._add(Session(name, self.sessions_path))
        self._sweeper: threading.Thread | None = None
        self._ensure_sweeper()

    def create_session(self) -> Session:
        """A new session, expiring in ``sessions_expiration`` seconds. Raises
        ``TooManySessions`` when ``max_sessions`` sessions it created are open."""
        self._ensure_sweeper()
        due: list[Session] = []
        try:
            with self._lock:
                if len(self._opened) >= self.max_sessions:
                    due = self._take_due(time.time())  # expired a moment ago: the sweeper has not run yet
                if len(self._opened) >= self.max_sessions:
                    SESSIONS_REFUSED.inc()
                    raise TooManySessions(
                        f"{len(self._opened)} stateful sessions are open in this worker group, as many as "
                        f"option.max_sessions={self.max_sessions} allows: close one, or wait until one expires "
                        f"(option.sessions_expiration={self.expiration} s)"
                    )
                session_id = str(uuid.uuid4())
                session = Session(session_id, self.sessions_path, time.time() + self.expiration)
                os.makedirs(session.files_path)
                session.put(".expiration_ts", session.expiration_ts)
                self._add(session)
                self._opened.add(session_id)
        finally:
            _remove_files(due)
        log.info("session %s created (expires in %ds)", session_id, self.expiration)
        return session

    def get_session(self, session_id: str | None) -> Session | None:
        if not session_id or session_id == NEW_SESSION:
            return None
        with self._lock:
            session = self._index.get(session_id)
            if session is None and session_id in self._expired:
                return None  # expired, and its files removed since
        if session is None:
            raise ValueError(f"session not found: {session_id}")
        return None if session.expired() else session

    def close_session(self, session_id: str | None) -> None:
        if not session_id:
            raise ValueError(f"invalid session_id: {session_id}")
        with self._lock:
            session = self._index.pop(session_id)
            if session is None:
                raise ValueError(f"session not found: {session_id}")
            self._opened.discard(session_id)
        session.remove()
        log.info("session %s closed", session_id)

    def _add(self, session: Session) -> None:
        """Index ``session`` by its expiry (the lock is held); wakes the sweeper when it is due first."""
        expires_at = math.inf if session.expiration_ts is None else session.expiration_ts
        self._index.put(session.session_id, expires_at, session)
        if self._index.next_expiry() == expires_at:
            self._changed.notify()

    def _take_due(self, now: float) -> list[Session]:
        """Forget the sessions expired at ``now`` (the lock is held); their files are the caller's to remove."""
        taken = []
        for session_id, session in self._index.take_due(now):
            if not session.expired(now):  # its expiration_ts was moved later since it was indexed
                self._add(session)
                continue
            self._opened.discard(session_id)
            self._expired[session_id] = None
            while len(self._expired) > EXPIRED_KEPT:
                self._expired.popitem(last=False)
            taken.append(session)
        return taken

    def _sweep(self) -> None:
        """Remove the files of the sessions expired by now."""
        with self._lock:
            due = self._take_due(time.time())
        _remove_files(due)

    def _seconds_to_next(self) -> float:
        """How long the sweeper may sleep (the lock is held)."""
        next_expiry = self._index.next_expiry()
        if next_expiry is None or next_expiry == math.inf:
            return SWEEP_IDLE
        return min(SWEEP_IDLE, max(0.0, next_expiry - time.time()) + SWEEP_LATE)

    def _ensure_sweeper(self) -> None:
        """Start the sweeper thread, or start it again in a forked child (threads do not survive a fork)."""
        with self._lock:
            if self._sweeper is None or not self._sweeper.is_alive():
                self._sweeper = threading.Thread(
                    target=_sweep_until_dropped, args=(weakref.ref(self),), name="sagelmi-sessions", daemon=True
                )
                self._sweeper.start()


def _sweep_until_dropped(ref: weakref.ref[SessionManager]) -> None:
    """The sweeper: remove expired sessions' files as they expire, until the manager is garbage."""
    while (manager := ref()) is not None:
        try:
            manager._sweep()
        except Exception:  # noqa: BLE001 - a sweeper that stops would leave sessions on disk for good
            log.exception("removing expired sessions failed; trying again")
        changed = manager._changed
        with changed:
            wait = manager._seconds_to_next()
            del manager  # not kept alive by its sweeper's sleep
            changed.wait(wait)


def _remove_files(sessions: list[Session]) -> None:
    for session in sessions:
        shutil.rmtree(session.files_path, ignore_errors=True)
    if sessions:
        log.info("%d expired sessions removed (%s ...)", len(sessions), sessions[0].session_id)
