"""Admission, routing and health for the frontend process.

``Router`` holds one ``WorkerLink`` per worker group. It admits at most
``job_queue_size`` requests at once (503 beyond), sends each to the ready group
with the fewest requests in flight (ties go round-robin), reports health for
``/ping``, and, once draining, admits nothing and tells when the last request
has finished.
"""

from __future__ import annotations

import itertools
import threading

from container.frontend.spec import FrontendSpec
from container.worker_client import WorkerLink
from handlers.errors import ServiceUnavailable


class Router:
    def __init__(self, spec: FrontendSpec) -> None:
        self.spec = spec
        self.links = [WorkerLink(f"group-{g.index}", g.socket_path) for g in spec.groups]
        self._devices = {id(link): g.devices for link, g in zip(self.links, spec.groups)}
        self._cond = threading.Condition()
        self._in_flight = 0
        self._turn = itertools.count()
        self.draining = False

    def start(self) -> None:
        for link in self.links:
            link.start()

    def close(self) -> None:
        for link in self.links:
            link.close()

    # -- admission
    def admit(self) -> None:
        """Count a request in, or raise ``ServiceUnavailable``."""
        with self._cond:
            if self.draining:
                raise ServiceUnavailable("the server is shutting down")
            if self._in_flight >= self.spec.job_queue_size:
                raise ServiceUnavailable(
                    f"the request queue is full ({self._in_flight} requests in progress, "
                    f"job_queue_size={self.spec.job_queue_size}); retry later")
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
    def pick(self) -> WorkerLink:
        """The ready worker group with the fewest requests in flight."""
        ready = [link for link in self.links if link.state == "ready"]
        if not ready:
            raise ServiceUnavailable(f"no model worker is ready ({self._summary()})")
        low = min(link.in_flight for link in ready)
        candidates = [link for link in ready if link.in_flight == low]
        return candidates[next(self._turn) % len(candidates)]

    def _summary(self) -> str:
        return ", ".join(f"{link.name}: {link.state}" for link in self.links)

    # -- health
    def health(self) -> tuple[bool, dict]:
        workers = [{"group": link.name, "state": link.state, "devices": self._devices[id(link)],
                    "in_flight": link.in_flight, **({"detail": link.detail} if link.detail else {})}
                   for link in self.links]
        states = {link.state for link in self.links}
        if self.draining:
            status = "Draining"
        elif states == {"ready"}:
            status = "Healthy"
        elif states <= {"starting", "loading", "ready"}:
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
