"""Requests that stop the engine: remembered by a fingerprint, refused once they have done it twice.

When a worker group dies with requests in flight, each of them may be the cause (a prompt or
a parameter combination that crashes the engine) or a bystander. A request whose fingerprint
(its route and body, hashed: the body itself is never kept or logged) was in flight at two
deaths of a group within ``WINDOW`` seconds is the likely cause: further copies of it are
refused for ``REFUSE_FOR`` seconds with a 422 in the route's envelope, before they reach a
group, so a client retrying it cannot take the group (and everything in flight on it) down
again and again. Every other request is served as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from container.core.errors import stopped_engine

log = logging.getLogger("sagelmi.frontend")

DEATHS_TO_REFUSE = 2
WINDOW = 600.0  # deaths further apart than this are not counted together
REFUSE_FOR = 600.0
MAX_REMEMBERED = 10_000  # fingerprints kept at most (the oldest are forgotten first)


class PoisonRequests:
    """The fingerprints of requests in flight at group deaths, and those refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deaths: dict[str, list[float]] = {}  # fingerprint -> when groups died with it in flight
        self._refused_until: dict[str, float] = {}
        self.refusing = False  # some request was refused lately (``refused`` says whether still): a look without a call

    def check(self, print_: str, now: float | None = None) -> None:
        """Raise ``errors.RequestStoppedEngine`` if copies of this request are refused now."""
        until = self._refused_until.get(print_)
        if until is None:
            return
        now = time.monotonic() if now is None else now
        if now < until:
            raise stopped_engine(until - now)
        with self._lock:
            self._refused_until.pop(print_, None)

    def group_died(self, group: str, in_flight: Iterable[tuple[str, str, str]], now: float | None = None) -> None:
        """A group died with these requests in flight: ``(fingerprint, request id, route)`` each.
        Copies of one request count once per death."""
        now = time.monotonic() if now is None else now
        seen: dict[str, tuple[str, str]] = {}
        for print_, request_id, route in in_flight:
            if print_:
                seen.setdefault(print_, (request_id, route))
        with self._lock:
            for print_, (request_id, route) in seen.items():
                deaths = [t for t in self._deaths.pop(print_, []) if now - t < WINDOW] + [now]
                self._deaths[print_] = deaths  # re-inserted: the dict's order is the order of use
                if len(deaths) >= DEATHS_TO_REFUSE and print_ not in self._refused_until:
                    self._refused_until[print_] = now + REFUSE_FOR
                    self.refusing = True
                    log.error(
                        "request %s (%s) was in flight at %d deaths of worker groups within %.0f s, the last of "
                        "group %s: copies of it are refused with 422 for %.0f s",
                        request_id,
                        route,
                        len(deaths),
                        WINDOW,
                        group,
                        REFUSE_FOR,
                    )
            for table in (self._deaths, self._refused_until):
                while len(table) > MAX_REMEMBERED:
                    del table[next(iter(table))]

    def refusals(self, limit: int) -> dict[str, float]:
        """The fingerprints refused now, each with the seconds it stays refused, the latest ``limit``
        of them (rank 0 checks a request the frontend did not see whole against them:
        ``protocol.Attach.refused``)."""
        now = time.monotonic()
        refused = [(print_, until - now) for print_, until in list(self._refused_until.items()) if until > now]
        self.refusing = bool(refused)
        return dict(refused[-limit:])

    @property
    def refused(self) -> int:
        """How many requests are refused now."""
        now = time.monotonic()
        count = sum(1 for until in self._refused_until.values() if until > now)
        self.refusing = count > 0
        return count
