"""A TCP port that must see no connection: tests of what the server refuses to reach."""

from __future__ import annotations

import socket


class Listener:
    """A listening TCP port on ``address`` that counts the connections made to it, accepted or not
    (a completed handshake waits in the backlog until accepted)."""

    def __init__(self, address: str = "127.0.0.1") -> None:
        self.socket = socket.create_server((address, 0), backlog=16)
        self.socket.setblocking(False)
        self.port = self.socket.getsockname()[1]

    def connections(self) -> int:
        """Connections made since the last call."""
        count = 0
        while True:
            try:
                connection, _ = self.socket.accept()
            except BlockingIOError:
                return count
            connection.close()
            count += 1

    def close(self) -> None:
        self.socket.close()
