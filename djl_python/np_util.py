"""LMI import path ``djl_python.np_util`` (the encoding lives in ``handlers.api.np_util``)."""

from handlers.api.np_util import (
    MAGIC_NUMBER,
    VERSION,
    from_nd_list,
    get_byte_as_int,
    get_bytes,
    get_char,
    get_int,
    get_long,
    get_str,
    set_char,
    set_int,
    set_long,
    set_str,
    to_nd_list,
)

__all__ = [
    "MAGIC_NUMBER",
    "VERSION",
    "from_nd_list",
    "get_byte_as_int",
    "get_bytes",
    "get_char",
    "get_int",
    "get_long",
    "get_str",
    "set_char",
    "set_int",
    "set_long",
    "set_str",
    "to_nd_list",
]
