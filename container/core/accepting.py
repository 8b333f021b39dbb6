"""An accept loop that survives its errors: the cluster's registration and launch services and
a worker group's rank relay each take connections from peers that may be broken or hostile."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

log = logging.getLogger("sagelmi.accept")

RETRY_AFTER = 0.1  # seconds before accepting again after an error (EMFILE would otherwise spin)


class AcceptLoop:
    """Accepts connections on ``sock`` in a thread and hands each to ``handle(conn, address)`` in a
    thread of its own, until ``close()``. An error accepting one connection (a reset before it
    was accepted, too many open files) or an exception raised by ``handle`` is logged, and the
    loop goes on: one bad peer never ends the service for the others."""

    def __init__(self, sock: socket.socket, handle: Callable[[socket.socket, tuple], object], name: str) -> None:
        self.sock = sock
        self.handle = handle
        self.name = name
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-accept", daemon=True)

    def start(self) -> AcceptLoop:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting and close the listening socket (a blocked ``accept`` returns at once)."""
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes accept(); close() alone would not
        except OSError:
            pass
        self.sock.close()

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, address = self.sock.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                log.warning("%s: accepting a connection failed (%s); still listening", self.name, exc)
                self._closed.wait(RETRY_AFTER)
                continue
            threading.Thread(target=self._serve, args=(conn, address), name=self.name, daemon=True).start()

    def _serve(self, conn: socket.socket, address: tuple) -> None:
        try:
            self.handle(conn, address)
        except Exception:
            log.exception("%s: the connection from %s failed", self.name, address[0] if address else "?")
            conn.close()
