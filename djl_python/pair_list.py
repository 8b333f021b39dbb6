"""LMI import path ``djl_python.pair_list``."""

from handlers.api import PairList

__all__ = ["PairList"]
