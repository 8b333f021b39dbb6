"""LMI compatibility: ``from djl_python import Input, Output`` works unchanged.

The classes are sagelmi's own (``handlers.api``); this package only gives them
the import path LMI's ``model.py`` files use.
"""

from handlers.api import Input, Output, PairList

__all__ = ["Input", "Output", "PairList"]
