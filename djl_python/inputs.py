"""LMI import path ``djl_python.inputs``."""

from handlers.api import Input, retrieve_buffer, retrieve_int, retrieve_short, retrieve_utf8

__all__ = ["Input", "retrieve_buffer", "retrieve_int", "retrieve_short", "retrieve_utf8"]
