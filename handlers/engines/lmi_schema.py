"""LMI's text-generation schema: ``{"inputs", "parameters", "stream"}`` in,
``{"generated_text", "details"}`` out, as LMI documents it.

Parsing turns a request into prompts and vLLM sampling arguments; formatting
turns engine outputs into LMI's JSON, JSON lines or server-sent events (and the
TGI-compatible forms). Nothing here talks to the engine.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from container.core.errors import InputError
from container.core.request_priority import PRIORITY_MAX, PRIORITY_MIN

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 30  # LMI's default
OUTPUT_FORMATTERS = ("json", "jsonlines", "sse")
CONTENT_TYPES = {"json": "application/json", "jsonlines": "application/jsonlines", "sse": "text/event-stream"}
# Integers the engine can take (its requests cross a msgpack socket; vLLM's OpenAI routes
# bound `seed` the same way): anything outside is refused before the engine sees it.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Every stop sequence is looked for after every token, in the worker's event loop: bound them.
# The count is vLLM's (VLLM_MAX_STOP_STRINGS, as on its OpenAI routes; TGI's default is 4 too).
MAX_STOP_SEQUENCES = 4
MAX_STOP_SEQUENCE_CHARS = 1000


class LmiParameters(BaseModel):
    """The ``parameters`` object. Other vLLM ``SamplingParams`` names pass through."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, ge=1, le=INT64_MAX)
    do_sample: bool | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)  # vLLM checks -1, 0 or >= 1
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop_sequences: list[str] | str | None = None
    repetition_penalty: float | None = Field(default=None, gt=0)
    return_full_text: bool = False
    details: bool | None = None
    decoder_input_details: bool = False
    top_n_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    ignore_eos_token: bool = False
    priority: int | None = Field(
        default=None,
        ge=PRIORITY_MIN,
        le=PRIORITY_MAX,
        description="the request's scheduling priority, vLLM's: lower values are served first (default 0); "
        "needs option.scheduling_policy=priority. The X-Priority header wins over it",
    )


class LmiBody(BaseModel):
    """An LMI request body, as ``parse_request`` takes it (``/openapi.json`` is generated from it)."""

    model_config = ConfigDict(extra="allow")

    inputs: StrictStr | list[StrictStr] = Field(
        description="a prompt, or a list of prompts (answered with a list; not with stream)"
    )
    parameters: LmiParameters | None = None
    stream: StrictBool = False
    adapters: StrictStr | list[StrictStr | None] | None = Field(
        None, description="a LoRA adapter's name, or one per prompt (null: the base model) (option.enable_lora)"
    )


class LmiToken(BaseModel):
    id: int
    text: str
    log_prob: float | None = None


class LmiDetails(BaseModel):
    finish_reason: str | None
    generated_tokens: int
    inputs: str
    tokens: list[LmiToken] | None = None
    top_tokens: list[list[LmiToken]] | None = None
    prefill: list[LmiToken] | None = None


class LmiAnswer(BaseModel):
    """A non-streamed LMI answer (a list of them for a list of inputs)."""

    generated_text: str
    details: LmiDetails | None = None


@dataclass(frozen=True)
class LmiRequest:
    prompts: list[str]
    batched: bool  # "inputs" was a list: answer with a list
    stream: bool
    parameters: LmiParameters
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams arguments


def _check_numbers(value: Any, where: str) -> None:
    """Refuse an integer outside int64 or a float that is not finite anywhere in ``value``
    (a passed-through parameter: vLLM checks its meaning, not that it fits the engine)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        raise InputError(f"{where}: {value} is out of range; integers must be within [{INT64_MIN}, {INT64_MAX}]")
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{where}: {value} is not a finite number")
    if isinstance(value, list):
        for item in value:
            _check_numbers(item, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_numbers(item, f"{where}.{key}")


# vLLM's structured-output request forms in LMI's parameters (LMI hands its parameters to vLLM's
# CompletionRequest): the older guided_* names, OpenAI's response_format and structured_outputs.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_NAMES = ("structured_outputs", "response_format", *GUIDED)


def structured_outputs(extra: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's ``StructuredOutputsParams`` fields from LMI parameters: ``structured_outputs``
    (``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` ...), OpenAI's
    ``response_format`` (``json_object``, ``json_schema``) or the older ``guided_*`` names.
    One of them at most; ``InputError`` naming the field for a shape that cannot work."""
    given = [name for name in STRUCTURED_NAMES if extra.get(name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InputError(f"parameters: {' and '.join(given)} each ask for structured output; give one")
    name = given[0]
    value = extra[name]
    if name in GUIDED:
        return {GUIDED[name]: value}
    if not isinstance(value, dict):
        raise InputError(f"parameters.{name} must be an object")
    if name == "structured_outputs":
        return dict(value)
    kind = value.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema") if isinstance(value.get("json_schema"), dict) else None
        if not isinstance(schema, dict):
            raise InputError("parameters.response_format.json_schema.schema must be a JSON schema (an object)")
        return {"json": schema}
    if kind == "text":
        return None
    raise InputError(f"parameters.response_format.type={kind!r} is not one of text, json_object, json_schema")


def sampling_arguments(params: LmiParameters, known: set[str]) -> dict[str, Any]:
    """vLLM ``SamplingParams`` keyword arguments for ``params``.

    ``known`` is the set of SamplingParams field names: extra parameters with
    those names pass through, others are ignored with a warning (as LMI does)."""
    args: dict[str, Any] = {"max_tokens": params.max_new_tokens, "logprobs": params.top_n_tokens}
    for name in ("temperature", "top_p", "top_k", "seed", "repetition_penalty"):
        value = getattr(params, name)
        if value is not None:
            args[name] = value
    if params.stop_sequences:
        args["stop"] = [params.stop_sequences] if isinstance(params.stop_sequences, str) else params.stop_sequences
    if params.ignore_eos_token:
        args["ignore_eos"] = True
    if params.decoder_input_details:
        args["prompt_logprobs"] = 1
    # Greedy unless sampling was asked for, explicitly or by giving a temperature.
    if params.do_sample is False or (params.do_sample is None and params.temperature is None):
        args["temperature"] = 0.0
    structured = structured_outputs(params.model_extra or {})
    if structured is not None:
        args["structured_outputs"] = structured  # a dict: the engine makes vLLM's StructuredOutputsParams of it
    for name, value in (params.model_extra or {}).items():
        if name in STRUCTURED_NAMES:
            continue
        if name in known and name not in ("output_kind", "detokenize"):
            args[name] = value
        else:
            log.warning("ignoring unknown generation parameter %r", name)
    return args


def _check_stops(params: LmiParameters, limit: int) -> None:
    """At most ``limit`` stop sequences of at most ``MAX_STOP_SEQUENCE_CHARS`` characters,
    in ``stop_sequences`` and in vLLM's ``stop`` passed through."""
    for name, value in (("stop_sequences", params.stop_sequences), ("stop", (params.model_extra or {}).get("stop"))):
        stops = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        if len(stops) > limit:
            raise InputError(f"parameters.{name}: {len(stops)} stop sequences; at most {limit} are allowed")
        longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
        if longest > MAX_STOP_SEQUENCE_CHARS:
            raise InputError(
                f"parameters.{name}: a stop sequence of {longest} characters; "
                f"at most {MAX_STOP_SEQUENCE_CHARS} are allowed"
            )


def _body_errors(exc: ValidationError, body: dict) -> str:
    """What is wrong with an LMI body, a message per top-level field."""
    messages = []
    for name in dict.fromkeys(str(err["loc"][0]) for err in exc.errors()):
        if name == "inputs":
            messages.append("'inputs' must be a non-empty string or a non-empty list of strings")
        elif name == "stream":
            messages.append(f"'stream' must be true or false, not {body['stream']!r}")
        elif name == "parameters" and not isinstance(body["parameters"], dict):
            messages.append("'parameters' must be a JSON object")
        elif name == "adapters":
            messages.append("'adapters' must be an adapter's name or a list of names (null for the base model)")
        else:
            messages.append(
                "; ".join(
                    f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
                    for err in exc.errors()
                    if str(err["loc"][0]) == name
                )
            )
    return "; ".join(messages)


def parse_request(body: Any, known_sampling: set[str], max_stop_sequences: int = MAX_STOP_SEQUENCES) -> LmiRequest:
    """Validate an LMI request body. Raises ``InputError`` naming the bad field.
    ``max_stop_sequences``: the engine's bound (``VLLM_MAX_STOP_STRINGS``)."""
    if not isinstance(body, dict):
        raise InputError("the request body must be a JSON object with 'inputs'")
    try:
        parsed = LmiBody.model_validate(body)
    except ValidationError as exc:
        raise InputError(_body_errors(exc, body)) from None
    prompts = [parsed.inputs] if isinstance(parsed.inputs, str) else list(parsed.inputs)
    batched = isinstance(parsed.inputs, list)
    if not prompts:
        raise InputError("'inputs' must be a non-empty string or a non-empty list of strings")
    if any(not p for p in prompts):
        raise InputError("'inputs' must not contain an empty prompt")
    stream = parsed.stream
    if stream and batched:
        raise InputError("streaming takes one prompt: send 'inputs' as a string, or set 'stream' to false")
    params = parsed.parameters or LmiParameters()
    _check_stops(params, max_stop_sequences)
    for name, value in (params.model_extra or {}).items():
        _check_numbers(value, f"parameters.{name}")
    if int((params.model_extra or {}).get("n", 1) or 1) > 1:
        raise InputError("parameters.n > 1 is not supported by the LMI schema; use /v1/completions")
    return LmiRequest(prompts, batched, stream, params, sampling_arguments(params, known_sampling))


# -- answers ---------------------------------------------------------------------------


def finish_reason(reason: str | None, stop_reason: Any) -> str | None:
    """vLLM's finish reason in LMI's words."""
    if reason == "stop":
        return "eos_token" if stop_reason is None else "stop_sequence"
    return reason


@dataclass
class TokenInfo:
    id: int
    text: str
    log_prob: float | None
    top: list[TokenInfo] = field(default_factory=list)

    def as_dict(self, tgi: bool) -> dict:
        return {"id": self.id, "text": self.text, ("logprob" if tgi else "log_prob"): self.log_prob}


@dataclass
class Generation:
    """Everything known about one prompt's answer so far."""

    prompt: str
    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)
    prefill: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None


class Formatter:
    """Builds LMI answers; ``tgi`` selects the TGI-compatible forms."""

    def __init__(self, output_formatter: str, tgi: bool) -> None:
        if output_formatter not in OUTPUT_FORMATTERS:
            raise ValueError(
                f"option.output_formatter={output_formatter!r} is not one of {', '.join(OUTPUT_FORMATTERS)}"
            )
        self.tgi = tgi
        self.stream_format = "sse" if tgi and output_formatter != "jsonlines" else output_formatter
        if self.stream_format == "json":
            self.stream_format = "jsonlines"

    @property
    def stream_content_type(self) -> str:
        return CONTENT_TYPES[self.stream_format]

    def wants_details(self, params: LmiParameters) -> bool:
        return params.details if params.details is not None else self.tgi

    def _generated_text(self, gen: Generation, params: LmiParameters) -> str:
        return gen.prompt + gen.text if params.return_full_text else gen.text

    def _details(self, gen: Generation, params: LmiParameters, with_tokens: bool) -> dict:
        details: dict[str, Any] = {
            "finish_reason": gen.finish_reason,
            "generated_tokens": len(gen.tokens),
            "inputs": gen.prompt,
        }
        if with_tokens:
            details["tokens"] = [t.as_dict(self.tgi) for t in gen.tokens]
        if params.top_n_tokens:
            details["top_tokens"] = [[c.as_dict(self.tgi) for c in t.top] for t in gen.tokens]
        if params.decoder_input_details:
            details["prefill"] = [t.as_dict(self.tgi) for t in gen.prefill]
        return details

    def answer(self, gen: Generation, params: LmiParameters) -> dict:
        out: dict[str, Any] = {"generated_text": self._generated_text(gen, params)}
        if self.wants_details(params):
            out["details"] = self._details(gen, params, with_tokens=True)
        return out

    def body(self, generations: list[Generation], request: LmiRequest) -> Any:
        """The non-streaming answer: one object, a list for a list of inputs,
        and always a list in TGI-compatible mode."""
        answers = [self.answer(g, request.parameters) for g in generations]
        return answers if request.batched or self.tgi else answers[0]

    def stream_item(self, token: TokenInfo | None, gen: Generation, params: LmiParameters, last: bool) -> bytes:
        """One line (or event) of a stream; the last one carries the whole text."""
        item: dict[str, Any] = {}
        if token is not None:
            item["token"] = token.as_dict(self.tgi)
        if last:
            item["generated_text"] = self._generated_text(gen, params)
            if self.wants_details(params):
                item["details"] = self._details(gen, params, with_tokens=False)
        line = json.dumps(item, ensure_ascii=False, separators=(",", ":"))
        return f"data: {line}\n\n".encode() if self.stream_format == "sse" else f"{line}\n".encode()
