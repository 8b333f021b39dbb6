"""LMI's request and generation-output records (``RequestInput``, ``TextGenerationOutput``,
``Sequence``, ``Token`` ...), as custom formatters receive them: the built-in engine hands a
``model.py``'s rolling-batch ``@output_formatter`` a ``TextGenerationOutput``
(``handlers.engines.rolling_formatter``); ``djl_python.request_io`` gives them LMI's import path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class Token:
    """One generated token."""

    def __init__(
        self,
        id: int,
        text: str,
        log_prob: float | None = None,
        special_token: bool | None = None,
        error_msg: str | None = None,
    ) -> None:
        self.id = id
        self.text = text
        self.log_prob = log_prob
        self.special_token = special_token
        self.error_msg = error_msg
        self.request_id = None

    def as_dict(self) -> dict:
        out = {"id": self.id, "text": self.text, "log_prob": self.log_prob}
        if self.special_token:
            out["special_token"] = self.special_token
        if self.error_msg:
            out["error_msg"] = self.error_msg
        return out

    def as_tgi_dict(self) -> dict:
        out = {"id": self.id, "text": self.text, "logprob": self.log_prob}
        if self.special_token:
            out["special"] = self.special_token
        return out


class Iterator:
    """A position that moves forward one step at a time."""

    def __init__(self) -> None:
        self._index = 0

    def get_index(self) -> int:
        return self._index

    def next_index(self) -> int:
        index = self._index
        self._index += 1
        return index


@dataclass
class Sequence:
    """One generated sequence: its tokens, read once each in order."""

    tokens: list[Token] = field(default_factory=list)
    top_tokens: list[list[Token]] = field(default_factory=list)
    cumulative_log_prob: float = 0.0
    finish_reason: str | None = None
    _last_token_index: int | None = None
    stop_reason: str | None = None

    def __post_init__(self) -> None:
        self._tokens_iterator = Iterator()
        self._top_tokens_iterator = Iterator()

    def set_next_token(self, token: Token, is_last_token: bool = False) -> None:
        self.tokens.append(token)
        if token.log_prob is not None:
            self.cumulative_log_prob += token.log_prob
        if is_last_token:
            self._last_token_index = len(self.tokens) - 1

    def set_next_top_tokens(self, top_tokens: list[Token]) -> None:
        self.top_tokens.append(top_tokens)

    def has_next_token(self) -> bool:
        return self._tokens_iterator.get_index() < len(self.tokens)

    def has_next_top_tokens(self) -> bool:
        return self._top_tokens_iterator.get_index() < len(self.top_tokens)

    def get_next_token(self) -> tuple[Token | None, int, bool, bool]:
        """``(token, index, is_first, is_last)``; ``(None, 0, False, False)`` when none is left."""
        if not self.has_next_token():
            return None, 0, False, False
        index = self._tokens_iterator.next_index()
        return self.tokens[index], index, index == 0, index == self._last_token_index

    def get_last_token(self) -> Token | None:
        return self.tokens[self._last_token_index] if self._last_token_index is not None else None

    def get_next_top_tokens(self) -> list[Token] | None:
        if not self.has_next_top_tokens():
            return None
        return self.top_tokens[self._top_tokens_iterator.next_index()]


@dataclass
class TripleSequence(Sequence):
    """A ``Sequence`` whose ``get_next_token()`` answers ``(token, is_first, is_last)``, as in
    djl_python 0.28 to 0.31 (0.32 added the index), for a ``model.py`` that unpacks three."""

    def get_next_token(self) -> tuple[Token | None, bool, bool]:  # type: ignore[override]
        token, _, first, last = super().get_next_token()
        return token, first, last


@dataclass
class RequestInput:
    request_id: int | None = None
    client_request_id: str | None = None
    output_formatter: str | Callable | None = None
    parameters: dict = field(default_factory=dict)
    server_parameters: dict = field(default_factory=dict)
    tgi_compat: bool = False


@dataclass
class TextInput(RequestInput):
    input_text: str | list[str] | None = None
    adapters: Any = None
    tokenizer: Any = None


@dataclass
class RequestOutput:
    request_id: int | None = None
    input: RequestInput | None = None
    finished: bool = False


@dataclass
class TextGenerationOutput(RequestOutput):
    sequences: dict[int, Sequence] = field(default_factory=dict)
    best_sequence_index: int = 0
    prompt_tokens_details: list[Token] = field(default_factory=list)
    other_sequences_indices: list[int] = field(default_factory=list)
    error: str | None = None
    code: int | None = None

    def __post_init__(self) -> None:
        self.sequences.setdefault(self.best_sequence_index, Sequence())

    def _sequence(self, index: int) -> Sequence:
        return self.sequences.setdefault(index, Sequence())

    def set_next_token(
        self, token: Token, sequence_index: int = 0, is_last_token: bool = False, finish_reason: str | None = None
    ) -> None:
        sequence = self._sequence(sequence_index)
        sequence.set_next_token(token, is_last_token)
        if finish_reason is not None:
            sequence.finish_reason = finish_reason

    def set_next_top_tokens(self, top_tokens: list[Token], sequence_index: int = 0) -> None:
        self._sequence(sequence_index).set_next_top_tokens(top_tokens)

    def set_best_sequence_index(self, sequence_index: int) -> None:
        self.best_sequence_index = sequence_index

    def set_finish_reason(self, finish_reason: str, sequence_index: int = 0) -> None:
        self._sequence(sequence_index).finish_reason = finish_reason

    def _token_dict(self, token: Token) -> dict:
        return token.as_tgi_dict() if self.input is not None and self.input.tgi_compat else token.as_dict()

    def get_tokens_as_dict(self, sequence_index: int = 0) -> list[dict]:
        return [self._token_dict(t) for t in self._sequence(sequence_index).tokens]

    def get_prompt_tokens_as_dict(self) -> list[dict]:
        return [self._token_dict(t) for t in self.prompt_tokens_details]

    def get_top_tokens_as_dict(self, sequence_index: int = 0) -> list[list[dict]]:
        return [[self._token_dict(t) for t in top] for top in self._sequence(sequence_index).top_tokens]
