"""LMI's request parsing: the ``@input_formatter`` decorator (and
``@prediction_handler`` / ``@init_handler``), and the default parsing of a
request into a ``TextInput`` (``inputs`` + ``parameters``, or chat ``messages``).

A function marked ``@input_formatter`` in ``model.py`` reaches the handler as
the ``input_formatter`` property (and with no ``handle``, the built-in handler
uses it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from djl_python.encode_decode import decode
from djl_python.request_io import RequestInput, TextInput
from handlers.api import Input

SAGEMAKER_ADAPTER_IDENTIFIER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"

_F = TypeVar("_F", bound=Callable[..., Any])

_PARSE_FAILED = "Input Parsing failed. Ensure that the request payload is valid. "


def input_formatter(function: _F) -> _F:
    """Mark ``function`` as the model's input formatter."""
    function.is_input_formatter = True  # type: ignore[attr-defined]  # LMI's marker on the function itself
    return function


def prediction_handler(function: _F) -> _F:
    function.is_prediction_handler = True  # type: ignore[attr-defined]  # LMI's marker on the function itself
    return function


def init_handler(function: _F) -> _F:
    function.is_init_handler = True  # type: ignore[attr-defined]  # LMI's marker on the function itself
    return function


@dataclass
class ParsedInput:
    errors: dict = field(default_factory=dict)  # batch index -> message
    requests: list = field(default_factory=list)  # the parsed RequestInputs
    batch: list = field(default_factory=list)  # the batch's Inputs


def get_batch_start_id(batch: list, **kwargs) -> int:
    """Where the new requests of ``batch`` start (a rolling batch keeps its active ones first)."""
    rolling_batch = kwargs.get("rolling_batch")
    if kwargs.get("is_rolling_batch") and rolling_batch is not None:
        active = len(getattr(rolling_batch, "active_requests", []))
        return active if len(batch) > active else len(batch)
    return 0


def get_req_id_counter(kwargs: dict):
    rolling_batch = kwargs.get("rolling_batch")
    return getattr(rolling_batch, "req_id_counter", None) if rolling_batch is not None else None


def parse_input_with_formatter(inputs: Input, **kwargs) -> ParsedInput:
    """Parse every item of ``inputs`` with the configured input formatter (or
    ``format_input``); an item that fails is recorded in ``errors``."""
    configs = kwargs.get("configs")
    kwargs["is_rolling_batch"] = kwargs.get("rolling_batch") is not None
    formatter = getattr(configs, "input_formatter", None) or format_input
    parsed = ParsedInput(batch=inputs.get_batches())
    counter = get_req_id_counter(kwargs)
    start = get_batch_start_id(parsed.batch, **kwargs)
    for i, item in enumerate(parsed.batch[start:], start):
        try:
            request = formatter(item, **kwargs)
            request.request_id = counter.next_id() if counter is not None else i
            request.client_request_id = item.get_property("requestId")
            if isinstance(request, TextInput):
                request.tokenizer = kwargs.get("tokenizer")
            request.tgi_compat = bool(getattr(configs, "tgi_compat", False))
            add_server_maintained_params(request, item, **kwargs)
            parsed.requests.append(request)
        except KeyError as exc:
            parsed.errors[i] = f"{_PARSE_FAILED}Invalid Request Property: {exc}"
        except Exception as exc:
            parsed.errors[i] = f"{_PARSE_FAILED}{exc}"
    return parsed


def format_input(input_item: Input, **kwargs) -> RequestInput:
    """The default input formatter: decode after the content type, then read
    ``inputs`` and ``parameters`` (or chat ``messages``)."""
    request = TextInput()
    payload = decode(input_item, input_item.get_property("Content-Type"))
    parse_text_inputs_params(request, input_item, payload, **kwargs)
    parse_adapters(request, input_item, payload, **kwargs)
    return request


def parse_text_inputs_params(request_input: TextInput, input_item: Input, input_map: Any, **kwargs) -> None:
    if isinstance(input_map, dict) and "messages" in input_map:
        request_input.input_text = input_map["messages"]
        request_input.parameters = {k: v for k, v in input_map.items() if k != "messages"}
        return
    if kwargs.get("is_rolling_batch"):
        inputs, parameters = parse_lmi_default_request_rolling_batch(input_map)
    elif isinstance(input_map, dict):
        inputs = input_map.pop("inputs", input_map)
        parameters = input_map.pop("parameters", {})
    else:
        inputs, parameters = input_map, {}
    request_input.input_text = inputs
    request_input.parameters = parameters
    if isinstance(input_map, dict) and "cached_prompt" in input_map:
        request_input.parameters["cached_prompt"] = input_map.pop("cached_prompt")


def add_server_maintained_params(request_input: RequestInput, input_item: Input, **kwargs) -> None:
    """Copy the parameters the server adds itself (seed, output formatter) into
    ``server_parameters``."""
    configs = kwargs.get("configs")
    request_input.server_parameters = dict(request_input.parameters)
    if "seed" not in request_input.server_parameters and input_item.contains_key("seed"):
        request_input.server_parameters["seed"] = input_item.get_as_string(key="seed")
    if "output_formatter" not in request_input.server_parameters:
        request_input.server_parameters["output_formatter"] = getattr(configs, "output_formatter", None)
    request_input.output_formatter = request_input.server_parameters.get("output_formatter")
    if request_input.output_formatter in ("json", "sse"):
        request_input.tgi_compat = bool(getattr(configs, "tgi_compat", False))


def parse_adapters(request_input: TextInput, input_item: Input, input_map: Any, **kwargs) -> None:
    """The adapter a request names (payload ``adapters``, content ``adapter`` or
    the SageMaker header), when LoRA is enabled."""
    configs = kwargs.get("configs")
    if not getattr(configs, "enable_lora", False):
        return
    adapters = input_map.pop("adapters", None) if isinstance(input_map, dict) else None
    if input_item.contains_key("adapter"):
        adapters = input_item.get_as_string(key="adapter")
    header = input_item.get_property(SAGEMAKER_ADAPTER_IDENTIFIER_HEADER)
    if header:
        adapters = header
    registry = kwargs.get("adapter_registry") or {}
    names = adapters if isinstance(adapters, list) else [adapters] if adapters else []
    for name in names:
        if registry and name not in registry:
            raise ValueError(f"Adapter {name} is not registered")
    request_input.adapters = adapters


def parse_lmi_default_request_rolling_batch(payload: Any) -> tuple[str, dict]:
    """``inputs`` (a non-empty string) and ``parameters`` (an object) of an LMI request."""
    if not isinstance(payload, dict):
        raise ValueError(
            "Invalid request payload. Request payload should be a json object specifying the 'inputs' field"
        )
    inputs = payload.get("inputs")
    if not isinstance(inputs, str) or not inputs:
        raise ValueError("Invalid request payload. Request payload should have a non-empty string 'inputs'")
    parameters = payload.get("parameters", {})
    if not isinstance(parameters, dict):
        raise ValueError("Invalid request payload. 'parameters' should be a json object")
    parameters["stream"] = payload.get("stream", False)
    return inputs, parameters
