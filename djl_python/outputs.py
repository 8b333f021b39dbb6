"""LMI import path ``djl_python.outputs``."""

from handlers.api import Output

__all__ = ["Output"]
