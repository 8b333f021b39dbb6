"""A ``model.py``'s ``@output_formatter`` written for LMI's rolling batch.

LMI tells this form by the formatter's first parameter: annotated ``TextGenerationOutput`` or
``RequestOutput`` (anything else is sagelmi's answer-as-a-dict form, ``handlers.engines.formatters``).
As LMI's rolling batch does, the formatter gets the request's ``TextGenerationOutput`` once per
generated token, that token appended to the best sequence; on the last call the token is marked
last, the sequence has its ``finish_reason`` and the output is ``finished``. The texts it returns,
joined, are the answer: streamed as they come with ``stream``, else the whole body.

``Sequence.get_next_token()`` answers ``(token, index, first, last)`` as djl_python does now;
a ``model.py`` that unpacks it into three names (djl_python 0.28 to 0.31, djl-demo's
customized-processing notebook) gets ``(token, first, last)`` (``next_token_fields``).
"""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import logging
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

from container.core.errors import HandlerError
from handlers.api.request_io import Sequence, TextGenerationOutput, TextInput, Token, TripleSequence
from handlers.engines.lmi_schema import TokenInfo

log = logging.getLogger("sagelmi.formatters")

_REQUEST_OUTPUT_TYPES = {"TextGenerationOutput", "RequestOutput"}


def takes_request_output(formatter: Callable[..., Any]) -> bool:
    """``formatter``'s first parameter is annotated ``TextGenerationOutput`` or ``RequestOutput``
    (the class, or its name as a string annotation): LMI's rolling-batch form."""
    try:
        params = list(inspect.signature(formatter).parameters.values())
    except (TypeError, ValueError):  # a callable without a signature to read: not annotated
        return False
    if not params:
        return False
    annotation = params[0].annotation
    if isinstance(annotation, str):
        name = annotation.rsplit(".", 1)[-1]
    else:
        name = getattr(annotation, "__name__", "")
    return name in _REQUEST_OUTPUT_TYPES


def next_token_fields(formatter: Callable[..., Any]) -> int:
    """How many values ``Sequence.get_next_token()`` answers for ``formatter``: 3 when its module
    unpacks a ``get_next_token()`` call into three names and never into another count, else 4."""
    module = inspect.getmodule(formatter)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(module if module is not None else formatter)))
    except (OSError, TypeError, SyntaxError):  # no source to read: djl_python's current form
        return 4
    counts = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        called = node.value.func
        if not (isinstance(called, ast.Attribute) and called.attr == "get_next_token"):
            continue
        for target in node.targets:
            if isinstance(target, (ast.Tuple, ast.List)) and not any(isinstance(e, ast.Starred) for e in target.elts):
                counts.add(len(target.elts))
    return 3 if counts == {3} else 4


def _text(result: Any) -> bytes:
    """What a formatter returned, as the answer's bytes: text and bytes as they are, ``None`` as
    nothing, anything else as one JSON line."""
    if result is None:
        return b""
    if isinstance(result, str):
        return result.encode()
    if isinstance(result, (bytes, bytearray)):
        return bytes(result)
    if hasattr(result, "model_dump_json"):
        return result.model_dump_json().encode() + b"\n"
    return json.dumps(result, ensure_ascii=False).encode() + b"\n"


def _token(info: TokenInfo) -> Token:
    return Token(info.id, info.text, info.log_prob)


class RollingBatchFormatter:
    """A rolling-batch ``@output_formatter`` and what every request's ``TextGenerationOutput``
    is made with (``tgi``: ``option.tgi_compat``; ``tokenizer``: the engine's, as LMI sets it)."""

    def __init__(self, fn: Callable[..., Any], tgi: bool, tokenizer: Any) -> None:
        self.fn = fn
        self.fields = next_token_fields(fn)
        self.tgi = tgi
        self.tokenizer = tokenizer
        self._ids = itertools.count()

    def describe(self) -> str:
        name = getattr(self.fn, "__name__", "the formatter")
        form = "(token, first, last)" if self.fields == 3 else "(token, index, first, last)"
        return (
            f"model.py's @output_formatter {name} takes LMI's rolling-batch TextGenerationOutput: it is called "
            f"once per generated token of an LMI-schema request ('inputs'), its texts are the answer; "
            f"Sequence.get_next_token() answers {form}; OpenAI-schema requests are answered without it"
        )

    def start(self, prompt: str, parameters: dict, client_request_id: str | None) -> RequestFormatting:
        """The formatting of one request's answer."""
        request_input = TextInput(
            request_id=next(self._ids),
            client_request_id=client_request_id,
            output_formatter=self.fn,
            parameters=dict(parameters),
            tgi_compat=self.tgi,
            input_text=prompt,
            tokenizer=self.tokenizer,
        )
        sequence = TripleSequence() if self.fields == 3 else Sequence()
        output = TextGenerationOutput(request_id=request_input.request_id, input=request_input, sequences={0: sequence})
        return RequestFormatting(self.fn, output)


class RequestFormatting:
    """One request's ``TextGenerationOutput``, grown token by token, and its formatter's calls."""

    def __init__(self, fn: Callable[..., Any], output: TextGenerationOutput) -> None:
        self.fn = fn
        self.output = output

    def tokens(
        self, new: list[TokenInfo], finish_reason: str | None, finished: bool, prefill: list[TokenInfo]
    ) -> Iterator[bytes]:
        """The formatter's text for each of ``new`` (the tokens the engine added), in order; with
        ``finished``, the last of them (or an empty token, id -1, when there is none, as LMI adds)
        carries ``finish_reason``. ``prefill``: the prompt's tokens, when asked for."""
        if prefill and not self.output.prompt_tokens_details:
            self.output.prompt_tokens_details = [_token(t) for t in prefill]
        for i, info in enumerate(new):
            yield self._call(_token(info), [_token(t) for t in info.top], finished and i == len(new) - 1, finish_reason)
        if finished and not new:
            yield self._call(Token(-1, ""), [], True, finish_reason)

    def _call(self, token: Token, top: list[Token], last: bool, finish_reason: str | None) -> bytes:
        self.output.set_next_token(token, is_last_token=last, finish_reason=finish_reason if last else None)
        self.output.set_next_top_tokens(top)
        if last:
            self.output.finished = True
        try:
            result = self.fn(self.output)
        except Exception as exc:
            log.exception("model.py's @output_formatter failed")  # the log line carries the request id
            raise HandlerError(f"Custom formatter failed: {type(exc).__name__}: {exc}") from None
        return _text(result)
