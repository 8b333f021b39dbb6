"""The connections gthread's main loop holds without a request thread: idle between two requests
(kept alive), or sending a request head not yet whole (``container.frontend.server``). Such a
connection costs the server a socket and a few hundred bytes, and nothing else; a client may
hold many. This is their book: who holds which, oldest first, and when each head is due.

Past ``per_client`` waiting connections from one address, that address's oldest waiting one is
the one to close (``wait`` names it): a new connection is never refused, and connections whose
request is being served do not count, so the requests of a client holding many, SageMaker's
health check among them, still go through.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class WaitingConnections:
    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self._clients: dict[Any, str] = {}  # connection -> its client's address
        self._oldest_first: OrderedDict[Any, None] = OrderedDict()
        self._by_client: dict[str, OrderedDict[Any, None]] = {}
        self._heads: OrderedDict[Any, float] = OrderedDict()  # a head's deadline; all heads wait alike: in order

    def wait(self, conn: Any, client: str, deadline: float | None = None) -> Any | None:
        """``conn`` (from ``client``) waits from now: idle, or for its head until ``deadline``.
        Returns the connection to close for it, if ``client`` now holds more than ``per_client``
        (its oldest waiting one, never ``conn``)."""
        self.done(conn)
        self._clients[conn] = client
        self._oldest_first[conn] = None
        held = self._by_client.setdefault(client, OrderedDict())
        held[conn] = None
        if deadline is not None:
            self._heads[conn] = deadline
        return next(iter(held)) if len(held) > self.per_client else None

    def done(self, conn: Any) -> None:
        """``conn`` waits no more (a thread serves it, or it is closed)."""
        client = self._clients.pop(conn, None)
        if client is None:
            return
        del self._oldest_first[conn]
        self._heads.pop(conn, None)
        held = self._by_client[client]
        del held[conn]
        if not held:
            del self._by_client[client]

    def waiting_for_head(self, conn: Any) -> bool:
        return conn in self._heads

    def expired(self, now: float) -> list[Any]:
        """The connections whose head is due at ``now`` or before."""
        due = []
        for conn, deadline in self._heads.items():
            if deadline > now:
                break
            due.append(conn)
        return due

    def next_deadline(self) -> float | None:
        return next(iter(self._heads.values()), None)

    def oldest(self) -> Any | None:
        """The connection that has waited longest, of any client."""
        return next(iter(self._oldest_first), None)

    def __len__(self) -> int:
        return len(self._clients)

    def __contains__(self, conn: Any) -> bool:
        return conn in self._clients
