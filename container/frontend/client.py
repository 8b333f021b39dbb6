"""The client's connection as the relay sees it: gunicorn's socket and response object, and who
writes to them (container/frontend/invocations.py; docs/architecture.md, "A stream's body goes
from rank 0 to the client without the frontend").

Where the request is served by gunicorn over a plain blocking socket, a streamed answer's body
is written by the worker group's rank 0 to the client's socket itself, and, for a request that
asked for a stream, its head too: the helpers here tell gunicorn's response what the group
wrote, so that it writes nothing twice. Elsewhere (TLS, HTTP/2) the frontend writes everything.
"""

from __future__ import annotations

import socket

from container.core.ingress import chunk
from container.core.protocol import ResponseHead
from container.frontend.body import WSGI_RESPONSE

CLIENT_CHECK_INTERVAL = 0.5  # how often a request that waits on its group looks whether its client is still there


def client_waiting(sock: socket.socket) -> bool | None:
    """What the client of a connection did that the server has not read yet: True when it sent
    more (a next request), False when it closed the connection, None when neither (or the
    socket cannot be peeked without gunicorn: TLS). One non-blocking peek."""
    if type(sock) is not socket.socket:
        return None
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return None
    except OSError:
        return False


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

    @staticmethod
    def before_head(environ: dict, ours: dict[str, str]) -> tuple[socket.socket, bool, ResponseHead] | None:
        """For ``GroupClient.submit``: the client's socket of a request served by gunicorn over a
        plain blocking socket, whether its body would be chunked, and what gunicorn and this
        frontend would put in its HTTP head around the handler's status and headers (as
        ``HandlerRoutes.respond`` and gunicorn's ``Response.default_headers`` do: gunicorn's
        ``Connection`` header follows from a keep-alive it decided before the app was called;
        ``ours``: the headers this frontend adds after the handler's); ``None`` where the group
        cannot write the head."""
        response = environ.get(WSGI_RESPONSE)
        sock = _plain_socket(environ)
        request = getattr(response, "req", None)
        if response is None or request is None or response.headers_sent or sock is None:
            return None
        if getattr(request, "version", None) not in ((1, 0), (1, 1)):  # HTTP/2 frames its own
            return None
        chunked = request.version == (1, 1)  # a stream's answer has no length: chunked for HTTP/1.1, else closed
        close = bool(response.must_close or request.should_close()) or not chunked
        version = "HTTP/{}.{}".format(*request.version)
        return sock, chunked, ResponseHead(version, response.version, close, ours)

    def frame(self, data: bytes) -> bytes:
        return chunk(data) if self.chunked else data

    def send_nowait(self, frame: bytes) -> int:
        return self.sock.send(frame, socket.MSG_DONTWAIT)

    def send_all(self, frame: bytes) -> None:
        self.sock.sendall(frame)


class HeadWrittenByGroup(Exception):
    """The request ended before the frontend took its head, and the group may have written
    that head to the client itself: the connection is closed instead of an error written
    after it (``status``: what the completion line says)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def head_written_by_group(environ: dict) -> None:
    """The group wrote the response's head to the client itself (``Head.written``): gunicorn's
    response sends none, and frames what it still writes (an in-band error, the chunked body's
    end) as it would after its own."""
    response = environ.get(WSGI_RESPONSE)
    if response is not None:
        response.headers_sent = True


def body_ended_by_group(environ: dict) -> None:
    """The group wrote the chunked body's end itself (an ending ``End``): gunicorn's response writes
    nothing more and keeps the connection (its close writes the last chunk of a chunked
    response, and keeps the connection only with a length or chunked)."""
    response = environ.get(WSGI_RESPONSE)
    if response is not None:
        response.chunked = False
        response.response_length = response.sent
