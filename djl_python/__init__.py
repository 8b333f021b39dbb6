"""LMI compatibility: ``from djl_python import Input, Output`` (and the other
modules of LMI's ``djl_python`` that handlers import) work unchanged.

The classes are sagelmi's own (``handlers.api``); this package gives them the
import paths LMI's ``model.py`` files use."""

from djl_python.session_manager import Session, SessionManager
from handlers.api import Input, Output, PairList

__version__ = "0.36.0"  # the djl_python release whose behaviour this package follows

__all__ = ["Input", "Output", "PairList", "Session", "SessionManager"]
