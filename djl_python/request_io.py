"""LMI's request and generation-output records (``RequestInput``, ``TextInput``,
``TextGenerationOutput``, ``Sequence``, ``Token`` ...), as custom formatters receive them.

The classes are sagelmi's own (``handlers.api.request_io``); this module gives them LMI's
import path."""

from handlers.api.request_io import (
    Iterator,
    RequestInput,
    RequestOutput,
    Sequence,
    TextGenerationOutput,
    TextInput,
    Token,
)

__all__ = ["Iterator", "RequestInput", "RequestOutput", "Sequence", "TextGenerationOutput", "TextInput", "Token"]
