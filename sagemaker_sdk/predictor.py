"""A predictor that speaks the container's schemas through ``/invocations``:
LMI text generation (``{"inputs", "parameters", "stream"}``) and OpenAI chat
(``{"messages", ...}``), which the built-in handler tells apart by the body
(``handlers/engines/vllm.py``), with streaming over SageMaker's
``invoke_endpoint_with_response_stream``. It stands on the installed ``sagemaker`` SDK's
predictor (``sagemaker_sdk.sdk_major``): 2.x's ``Predictor``, or with 3.x a class with its
arguments on ``sagemaker.core``'s runtime client."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from sagemaker_sdk.sdk_major import ByteIterator, PredictorBase
from sagemaker_sdk.streaming import parse_stream, stream_texts

_OPENAI_KEYS = ("messages", "prompt")


def request_body(data: Any, parameters: dict | None = None, stream: bool = False) -> dict:
    """The JSON body for ``data``: a prompt or a list of prompts becomes an LMI
    request with ``parameters``; a dict is sent as it is, ``parameters`` merged
    into its ``parameters`` (LMI) or at its top level (OpenAI: ``messages`` or
    ``prompt``). ``stream`` asks the server to stream."""
    if isinstance(data, str) or (isinstance(data, list) and all(isinstance(p, str) for p in data)):
        body: dict = {"inputs": data}
        if parameters:
            body["parameters"] = dict(parameters)
    elif isinstance(data, dict):
        body = dict(data)
        if parameters and any(k in body for k in _OPENAI_KEYS) and "inputs" not in body:
            body.update(parameters)
        elif parameters:
            body["parameters"] = {**(body.get("parameters") or {}), **parameters}
    else:
        raise TypeError(f"data must be a prompt, a list of prompts or a JSON object (dict), not {type(data).__name__}")
    if stream:
        body["stream"] = True
    return body


def check_request_args(initial_args: Any) -> None:
    """``initial_args`` are ``invoke_endpoint``'s arguments (``ContentType``,
    ``Accept``, ``CustomAttributes`` ...: capitalised, as boto3 spells them); a dict
    of generation parameters in their place is refused with a ``TypeError`` naming them."""
    if initial_args is None:
        return
    if not isinstance(initial_args, Mapping):
        raise TypeError(f"initial_args must be a dict of invoke_endpoint arguments, not {type(initial_args).__name__}")
    lower = sorted(k for k in initial_args if not str(k)[:1].isupper())
    if lower:
        raise TypeError(
            f"initial_args are invoke_endpoint's arguments (ContentType, Accept, CustomAttributes ...), not "
            f"{', '.join(lower)}: give generation parameters as parameters={{...}} or as keywords"
        )


class SagelmiPredictor(PredictorBase):
    """``predict("text", max_new_tokens=64)`` -> LMI's answer
    (``{"generated_text": ...}``); ``predict_stream`` -> the text as it is
    generated; ``chat(messages)`` -> an OpenAI chat completion.

    ``SagelmiPredictor(endpoint_name, sagemaker_session=None, serializer=None,
    deserializer=None, component_name=None)``: ``component_name`` names the inference
    component requests go to (``deploy(inference_component=...)`` sets it). ``predict`` and
    ``predict_stream`` take the ``sagemaker`` ``Predictor``'s arguments in its order
    (``initial_args`` second: ``{"ContentType": ..., "CustomAttributes": ...}``, then
    ``target_model``, ``target_variant``, ``inference_id``, ``custom_attributes``,
    ``component_name``); generation parameters are keywords only: ``parameters={...}`` and/or
    one keyword each."""

    def predict(
        self,
        data,
        initial_args=None,
        target_model=None,
        target_variant=None,
        inference_id=None,
        custom_attributes=None,
        component_name=None,
        *,
        parameters: dict | None = None,
        **generation,
    ) -> Any:
        """The answer to ``data`` (see ``request_body``), as JSON."""
        check_request_args(initial_args)
        body = request_body(data, {**(parameters or {}), **generation})
        return super().predict(
            body, initial_args, target_model, target_variant, inference_id, custom_attributes, component_name
        )

    def predict_stream(
        self,
        data,
        initial_args=None,
        target_variant=None,
        inference_id=None,
        custom_attributes=None,
        component_name=None,
        target_container_hostname=None,
        iterator=ByteIterator,
        *,
        parameters: dict | None = None,
        raw: bool = False,
        **generation,
    ) -> Iterator:
        """Stream the answer to ``data``: an iterator over the text pieces as they
        are generated, or with ``raw=True`` over the JSON items themselves (LMI's
        ``{"token": ...}`` lines, OpenAI chunks). An error the server sends after
        the stream began raises ``StreamError``. ``iterator`` stays ``ByteIterator``:
        the stream parser reads the bytes."""
        check_request_args(initial_args)
        if iterator is not ByteIterator:
            raise TypeError("SagelmiPredictor.predict_stream parses the stream itself: use raw=True for its JSON items")
        body = request_body(data, {**(parameters or {}), **generation}, stream=True)
        pieces = super().predict_stream(
            body,
            initial_args,
            target_variant,
            inference_id,
            custom_attributes,
            component_name,
            target_container_hostname,
            iterator=ByteIterator,
        )
        items = parse_stream(pieces)
        return items if raw else stream_texts(items)

    def chat(self, messages: list[dict], **params) -> dict:
        """An OpenAI chat completion for ``messages`` (``max_tokens``, ``temperature``
        ... as keywords), through ``/invocations``."""
        return self.predict({"messages": messages, **params})

    def chat_stream(self, messages: list[dict], *, raw: bool = False, **params) -> Iterator:
        """``chat``, streamed: the reply's text pieces (or the OpenAI chunks with ``raw=True``)."""
        return self.predict_stream({"messages": messages, **params}, raw=raw)
