"""The handler API: what a handler author imports (``Input``, ``Output``, ``PairList``, also
importable as LMI's ``djl_python``), the context a built-in engine is given
(``handlers.api.context``), the engine contract (``handlers.api.engine``) and the loading of a
handler (``handlers.api.loader``). It stands on the core (``container.core``) alone."""

from handlers.api.djl_framing import retrieve_buffer, retrieve_int, retrieve_short, retrieve_utf8
from handlers.api.io import MAX_JSON_DEPTH, Input, Output, PairList, json_line, prepend

__all__ = [
    "MAX_JSON_DEPTH",
    "Input",
    "Output",
    "PairList",
    "json_line",
    "prepend",
    "retrieve_buffer",
    "retrieve_int",
    "retrieve_short",
    "retrieve_utf8",
]
