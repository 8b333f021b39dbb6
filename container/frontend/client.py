"""The client's connection as the relay sees it: gunicorn's socket and response object, and who
writes to them (container/frontend/invocations.py; docs/architecture.md, "A stream's body goes
from rank 0 to the client without the frontend").

Where the request is served by gunicorn over a plain blocking socket, a streamed answer's body
is written by the worker group's rank 0 to the client's socket itself, once gunicorn sent the
head. Elsewhere (TLS, HTTP/2) the frontend writes everything.
"""

from __future__ import annotations

import socket

from container.core.ingress import chunk
from container.frontend.body import WSGI_RESPONSE
from container.frontend.main_loop import client_waiting

CLIENT_CHECK_INTERVAL = 0.5  # how often a request that waits on its group looks whether its client is still there


def client_gone(sock: socket.socket | None) -> bool:
    """Whether the client closed its connection."""
    return sock is not None and client_waiting(sock) is False


def _plain_socket(environ: dict) -> socket.socket | None:
    """The client's socket of a request gunicorn serves over a plain blocking socket (not TLS),
    which another thread or process may write to without gunicorn."""
    sock = environ.get("gunicorn.socket")
    return sock if type(sock) is socket.socket and sock.gettimeout() is None else None


class ClientSink:
    """The client's socket of a streamed answer whose headers gunicorn has sent,
    for ``PendingRequest.attach``: frames chunks as gunicorn does (HTTP/1.1
    chunked, or raw for an HTTP/1.0 client)."""

    def __init__(self, sock: socket.socket, chunked: bool) -> None:
        self.sock = sock
        self.chunked = chunked

    @classmethod
    def of(cls, environ: dict) -> ClientSink | None:
        """The sink of this request, if it is served by gunicorn over a plain
        blocking socket and its headers are sent; otherwise ``None`` (the request
        thread writes everything)."""
        response = environ.get(WSGI_RESPONSE)
        sock = _plain_socket(environ)
        if response is None or not getattr(response, "headers_sent", False) or sock is None:
            return None
        return cls(sock, bool(response.chunked))

    def frame(self, data: bytes) -> bytes:
        return chunk(data) if self.chunked else data

    def send_nowait(self, frame: bytes) -> int:
        return self.sock.send(frame, socket.MSG_DONTWAIT)

    def send_all(self, frame: bytes) -> None:
        self.sock.sendall(frame)
