"""LMI import path ``djl_python.inputs``."""

from handlers.api import Input

__all__ = ["Input"]
