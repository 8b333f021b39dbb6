"""Admission, routing and health for the frontend process.

``Router`` holds one ``GroupClient`` per worker group. It admits at most
``job_queue_size`` requests at once (503 beyond), sends each to the ready group
with the fewest requests in flight (ties go round-robin) unless it names a
stateful session, which goes to the group holding it (``SessionRoutes``), reports health for
``/ping``, and, once draining, admits nothing and tells when the last request
has finished.
"""

from __future__ import annotations

import itertools
import threading

from container.core.errors import QueueFull, ServiceUnavailable, scrub
from container.core.launch import FrontendLaunch, read_note
from container.core.protocol import WorkerState
from container.frontend.group_client import GroupClient
from container.frontend.poison import PoisonRequests
from container.frontend.sessions import SessionRoutes


class Router:
    def __init__(self, launch: FrontendLaunch) -> None:
        self.launch = launch
        self.groups = [GroupClient(str(g.index), g.socket_path) for g in launch.groups]
        self._cond = threading.Condition()
        self._in_flight = 0
        self._turn = itertools.count()
        self.draining = False
        self.poison = PoisonRequests()
        for client in self.groups:
            client.on_lost = self.poison.group_died
        self.sessions = SessionRoutes(launch.stateful_sessions, launch.sessions_expiration)

    def start(self) -> None:
        for client in self.groups:
            client.start()

    def close(self) -> None:
        for client in self.groups:
            client.close()

    # -- admission
    def admit(self) -> None:
        """Count a request in, or raise ``ServiceUnavailable`` (``QueueFull`` when it is)."""
        with self._cond:
            if self.draining:
                raise ServiceUnavailable("the server is shutting down")
            if self._in_flight >= self.launch.job_queue_size:
                raise QueueFull(
                    f"the request queue is full ({self._in_flight} requests in progress, "
                    f"job_queue_size={self.launch.job_queue_size}); retry later"
                )
            self._in_flight += 1

    def release(self) -> None:
        with self._cond:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # -- routing
    def pick_for(self, session_id: str | None) -> GroupClient:
        """The group holding session ``session_id`` (``SessionRoutes.route``), else ``pick()``."""
        return (session_id and self.sessions.route(session_id)) or self.pick()

    def pick(self) -> GroupClient:
        """The ready worker group with the fewest requests in flight."""
        ready = [client for client in self.groups if client.state is WorkerState.READY]
        if not ready:
            raise ServiceUnavailable(f"no worker group is ready ({self._summary()})")
        low = min(client.in_flight for client in ready)
        candidates = [client for client in ready if client.in_flight == low]
        return candidates[next(self._turn) % len(candidates)]

    def _summary(self) -> str:
        return ", ".join(f"group {client.name}: {client.state.value}" for client in self.groups)

    # -- health
    def health(self) -> tuple[bool, dict]:
        """Whether every group is ready, and ``/ping``'s body. A group's detail and last exit
        name what failed; local paths in them are replaced (``scrub``): the log has them whole."""
        workers = []
        crash_loop = False
        for client, address in zip(self.groups, self.launch.groups):
            worker = {
                "group": f"group-{client.name}",
                "state": client.state.value,
                "devices": address.devices,
                "in_flight": client.in_flight,
                **({"detail": scrub(client.detail)} if client.detail else {}),
            }
            note = read_note(address.note_path) if address.note_path else None
            if note is not None and note.last_exit and (note.crash_loop or client.state is not WorkerState.READY):
                worker["last_exit"] = scrub(note.last_exit)
            if note is not None and note.crash_loop:
                worker["crash_loop"] = True
                worker["restarts"] = note.restarts
                crash_loop = True
            workers.append(worker)
        states = {client.state for client in self.groups}
        if self.draining:
            status = "Draining"
        elif crash_loop:
            status = "Unhealthy"  # until a start stays up (the supervisor's GroupNote)
        elif states == {WorkerState.READY}:
            status = "Healthy"
        elif states <= {WorkerState.STARTING, WorkerState.LOADING, WorkerState.READY}:
            status = "Loading"
        else:
            status = "Unhealthy"
        return status == "Healthy", {"status": status, "workers": workers}

    # -- shutdown
    def begin_drain(self) -> None:
        with self._cond:
            self.draining = True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout)
