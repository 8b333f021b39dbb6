"""Reading a request body from a client that may not play by HTTP's rules.

Werkzeug's own limit only looks at ``Content-Length``: a chunked body past
``max_payload_in_mb`` was cut at the limit and handed to the handler. Here the
body is read from gunicorn's ``wsgi.input`` directly, and:

- a body past the limit is 413, whether its size was announced or not; reading
  stops as soon as it passes the limit (the rest is left unread, and the
  connection is closed after the answer: ``CLOSE_CONNECTION``);
"""

from __future__ import annotations

from container.errors import PayloadTooLarge

READ_SIZE = 1 << 16

# Set in a request's WSGI environ when its connection must not be reused (the
# body was not read to its end); container.frontend.server closes it.
CLOSE_CONNECTION = "sagelmi.close_connection"


def too_large(announced: int | None, limit: int) -> PayloadTooLarge:
    size = f"{announced} bytes" if announced is not None else "more than that"
    return PayloadTooLarge(f"the request body is {size}; the limit is {limit} bytes "
                           f"(max_payload_in_mb / SAGEMAKER_MAX_PAYLOAD_IN_MB)")


def read_body(environ: dict, announced: int | None, limit: int) -> bytes:
    """The whole body of the request of ``environ`` (``announced`` is its
    Content-Length, None when chunked). Raises ``PayloadTooLarge`` past ``limit``."""
    if announced is not None and announced > limit:
        environ[CLOSE_CONNECTION] = True
        raise too_large(announced, limit)
    stream = environ["wsgi.input"]
    parts: list[bytes] = []
    size = 0
    while True:
        part = stream.read(min(READ_SIZE, (limit + 1 if announced is None else announced) - size))
        if not part:
            break
        parts.append(part)
        size += len(part)
        if size > limit:
            environ[CLOSE_CONNECTION] = True
            raise too_large(None, limit)
        if announced is not None and size >= announced:
            break
    return b"".join(parts)
