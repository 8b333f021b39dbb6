"""Reading a request body from a client that may not play by HTTP's rules.

Werkzeug's own limit only looks at ``Content-Length``: a chunked body past
``max_payload_in_mb`` was cut at the limit and handed to the handler. And
gunicorn waits for a body without a time limit: a ``Content-Length`` larger
than what the client sends held a thread until the client left, and then the
truncated body was served. Here the body is read from gunicorn's
``wsgi.input`` directly, and:

- a body past the limit is 413, whether its size was announced or not; reading
  stops as soon as it passes the limit (the rest is left unread, and the
  connection is closed after the answer: ``CLOSE_CONNECTION``);
- the whole body must arrive within ``body_read_timeout`` seconds: a body still
  incomplete then is 408; one the client ended early (fewer bytes than its
  ``Content-Length``, a chunked body without its last chunk) is 400. Neither is
  ever handed to the handler.
"""

from __future__ import annotations

import socket
import time

from gunicorn.http.errors import NoMoreData

from container.core.errors import body_cut, body_late, too_large

READ_SIZE = 1 << 16

# Set in a request's WSGI environ when its connection must not be reused (the
# body was not read to its end); container.frontend.server closes it.
CLOSE_CONNECTION = "sagelmi.close_connection"
# Set in every request's WSGI environ by container.frontend.server: gunicorn's
# response object (whether it sent the headers, whether it frames chunks).
WSGI_RESPONSE = "sagelmi.wsgi_response"


def read_body(environ: dict, announced: int | None, limit: int, timeout: float) -> bytes:
    """The whole body of the request of ``environ`` (``announced`` is its
    Content-Length, None when chunked), read within ``timeout`` seconds.
    Raises ``PayloadTooLarge`` past ``limit``, ``RequestTimeout`` for a body
    that did not arrive in time, ``IncompleteBody`` for one that ended early."""
    if announced is not None and announced > limit:
        environ[CLOSE_CONNECTION] = True
        raise too_large(announced, limit)
    stream = environ["wsgi.input"]
    sock: socket.socket | None = environ.get("gunicorn.socket")
    deadline = time.monotonic() + timeout
    parts: list[bytes] = []
    size = 0
    try:
        while announced is None or size < announced:
            if sock is not None:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
            part = stream.read(min(READ_SIZE, (limit + 1 if announced is None else announced) - size))
            if not part:
                break
            parts.append(part)
            size += len(part)
            if size > limit:
                environ[CLOSE_CONNECTION] = True
                raise too_large(None, limit)
    except TimeoutError:
        environ[CLOSE_CONNECTION] = True
        # (what did come may sit in gunicorn's buffer, uncounted here)
        raise body_late(announced, timeout) from None
    except NoMoreData:
        environ[CLOSE_CONNECTION] = True
        raise body_cut(size, announced) from None
    finally:
        if sock is not None:
            sock.settimeout(None)  # blocking again, as gunicorn left it
    if announced is not None and size < announced:
        environ[CLOSE_CONNECTION] = True
        raise body_cut(size, announced)
    return b"".join(parts)
