"""DJL's ``tensor/ndlist`` encoding of a list of numpy arrays (``NDList``, version 3).

Layout, big-endian: the number of arrays, then for each: the text ``NDAR``,
the version (3), a name flag (1: a name follows), the sparse format, the data
type (``FLOAT32`` ...), the shape (rank, then each dimension as 64 bits), the
layout (one character per dimension), the byte order, and the data's length
and bytes. Text is a 16-bit length and UTF-8. Bytes that start with ``PK`` are
read as an ``.npz`` file instead.
"""

from __future__ import annotations

import io
import struct

import numpy as np

MAGIC_NUMBER = "NDAR"
VERSION = 3


def set_int(value: int) -> bytes:
    return struct.pack(">i", value)


def set_long(value: int) -> bytes:
    return struct.pack(">q", value)


def set_str(value: str) -> bytes:
    data = value.encode("utf-8")
    return struct.pack(">h", len(data)) + data


def set_char(value: str) -> bytes:
    return struct.pack(">h", ord(value))


def get_byte_as_int(encoded: bytes, idx: int) -> tuple[int, int]:
    return encoded[idx], idx + 1


def get_bytes(encoded: bytes, idx: int, length: int) -> tuple[bytes, int]:
    if idx + length > len(encoded):
        raise ValueError("the ndlist data ends early")
    return bytes(encoded[idx : idx + length]), idx + length


def get_char(encoded: bytes, idx: int) -> tuple[str, int]:
    return chr(struct.unpack_from(">h", encoded, idx)[0]), idx + 2


def get_str(encoded: bytes, idx: int) -> tuple[str, int]:
    length = struct.unpack_from(">h", encoded, idx)[0]
    data, idx = get_bytes(encoded, idx + 2, length)
    return data.decode("utf-8"), idx


def get_int(encoded: bytes, idx: int) -> tuple[int, int]:
    return struct.unpack_from(">i", encoded, idx)[0], idx + 4


def get_long(encoded: bytes, idx: int) -> tuple[int, int]:
    return struct.unpack_from(">q", encoded, idx)[0], idx + 8


# DJL's names where numpy's differ (Java reads BOOLEAN, not BOOL).
_TO_DJL = {"BOOL": "BOOLEAN"}
_FROM_DJL = {"BOOLEAN": "bool"}


def _dtype_name(dtype: np.dtype) -> str:
    name = str(dtype).upper()
    return _TO_DJL.get(name, name)


def to_nd_list(np_list) -> bytearray:
    """Encode an array (or a list of arrays) as DJL's ``tensor/ndlist``."""
    arrays = np_list if type(np_list) is list else [np_list]
    out = bytearray(set_int(len(arrays)))
    for array in arrays:
        array = np.asarray(array)
        out += set_str(MAGIC_NUMBER) + set_int(VERSION)
        out += b"\x00"  # no name
        out += set_str("default") + set_str(_dtype_name(array.dtype))
        out += set_int(array.ndim) + b"".join(set_long(d) for d in array.shape)
        out += set_int(array.ndim) + b"".join(set_char("?") for _ in array.shape)
        data = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<"), copy=False)).tobytes("C")
        out += b"<" + set_int(len(data)) + data
    return out


def from_nd_list(encoded: bytes) -> list[np.ndarray]:
    """Decode DJL's ``tensor/ndlist`` (or an ``.npz`` file) into a list of arrays."""
    encoded = bytes(encoded)
    if len(encoded) >= 4 and encoded[:2] == b"PK":
        with np.load(io.BytesIO(encoded)) as npz:
            return [npz[name] for name in npz.files]
    try:
        count, idx = get_int(encoded, 0)
        arrays = []
        for _ in range(count):
            magic, idx = get_str(encoded, idx)
            if magic != MAGIC_NUMBER:
                raise ValueError(f"magic number is not {MAGIC_NUMBER}, actual {magic}")
            version, idx = get_int(encoded, idx)
            if version != VERSION:
                raise ValueError(f"require version {VERSION}, actual {version}")
            flag, idx = get_byte_as_int(encoded, idx)
            if flag == 1:
                _, idx = get_str(encoded, idx)
            _, idx = get_str(encoded, idx)  # sparse format
            dtype_name, idx = get_str(encoded, idx)
            ndim, idx = get_int(encoded, idx)
            shape = []
            for _ in range(ndim):
                dim, idx = get_long(encoded, idx)
                shape.append(dim)
            layout, idx = get_int(encoded, idx)
            idx += 2 * layout
            order, idx = get_byte_as_int(encoded, idx)
            length, idx = get_int(encoded, idx)
            data, idx = get_bytes(encoded, idx, length)
            # numpy types the byte order as its Literal characters; DJL writes one of them ('<', '>' ...)
            dtype = np.dtype(_FROM_DJL.get(dtype_name, dtype_name.lower())).newbyteorder(chr(order))  # type: ignore[arg-type]
            arrays.append(np.frombuffer(data, dtype=dtype).reshape(shape))
        return arrays
    except (struct.error, TypeError) as exc:
        raise ValueError(f"the body is not a valid tensor/ndlist: {exc}") from None
