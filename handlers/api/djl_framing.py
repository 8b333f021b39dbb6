"""DJL Serving's socket framing of a request and an answer (``Input.read``, ``Output.send``), as
LMI's ``djl_python`` has it: a handler or tool written against those calls keeps working. The
sagelmi worker does not use it (its protocol is ``container.core.protocol``)."""

from __future__ import annotations

import logging
import struct
from typing import Any

log = logging.getLogger("handlers.api.io")

_SHORT = struct.Struct(">h")
_INT = struct.Struct(">i")


def retrieve_buffer(conn, length: int) -> bytearray:
    """Read exactly ``length`` bytes from socket ``conn``."""
    data = bytearray()
    while len(data) < length:
        chunk = conn.recv(length - len(data))
        if not chunk:
            raise ValueError("Connection disconnected")
        data += chunk
    return data


def retrieve_int(conn) -> int:
    return _INT.unpack(retrieve_buffer(conn, 4))[0]


def retrieve_short(conn) -> int:
    return _SHORT.unpack(retrieve_buffer(conn, 2))[0]


def retrieve_utf8(conn) -> str | None:
    length = retrieve_int(conn)
    return None if length < 0 else retrieve_buffer(conn, length).decode("utf-8")


def write_utf8(msg: bytearray, val: str | None) -> None:
    """Append ``val`` to ``msg`` as DJL writes text: its length, then UTF-8 (-1 for None)."""
    if val is None:
        msg += _INT.pack(-1)
    else:
        data = val.encode("utf-8")
        msg += _INT.pack(len(data))
        msg += data


def binary_encode(data: dict) -> bytearray:
    """A dict of strings in DJL's binary form (what async-mode answers carry)."""
    msg = bytearray(_SHORT.pack(len(data)))
    for key, value in data.items():
        write_utf8(msg, key)
        write_utf8(msg, str(value))
    return msg


def read_input(inputs: Any, conn: Any) -> None:
    """Read one request from ``conn`` into ``inputs`` (an ``Input``)."""
    for _ in range(retrieve_short(conn)):
        key = retrieve_utf8(conn)
        inputs.properties[key] = retrieve_utf8(conn)
    for _ in range(retrieve_short(conn)):
        key = retrieve_utf8(conn)
        inputs.content.add(key=key, value=retrieve_buffer(conn, retrieve_int(conn)))
    inputs.function_name = inputs.properties.get("handler")


def send_output(output: Any, sock: Any) -> None:
    """Write ``output`` (an ``Output``) to socket ``sock``; a stream item by item."""
    msg = bytearray(_SHORT.pack(output.code))
    write_utf8(msg, output.message)
    msg += _SHORT.pack(len(output.properties))
    for key, value in output.properties.items():
        write_utf8(msg, key)
        write_utf8(msg, str(value))
    if output.stream_content is None:
        msg += _SHORT.pack(output.content.size())
        for key, value in zip(output.content.get_keys(), output.content.get_values()):
            write_utf8(msg, key)
            msg += _INT.pack(len(value))
            msg += value
        sock.sendall(msg)
        return
    msg += _SHORT.pack(-1)
    sock.sendall(msg)
    try:
        for item in output.stream_content:
            data = output.format_stream_item(item)
            sock.sendall(b"\x01" + _INT.pack(len(data)) + data)
    except Exception as exc:
        log.exception("Failed read streaming content from output")
        text = str(exc).encode("utf-8")
        sock.sendall(b"\x00" + _INT.pack(len(text)) + text)
        return
    sock.sendall(b"\x00" + _INT.pack(0))
