"""A predictor that speaks the container's schemas through ``/invocations``:
LMI text generation (``{"inputs", "parameters", "stream"}``) and OpenAI chat
(``{"messages", ...}``), which the built-in handler tells apart by the body
(``handlers/engines/vllm.py``), with streaming over SageMaker's
``invoke_endpoint_with_response_stream``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sagemaker.deserializers import JSONDeserializer
from sagemaker.iterators import ByteIterator
from sagemaker.predictor import Predictor
from sagemaker.serializers import JSONSerializer

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


class SagelmiPredictor(Predictor):
    """``predict("text", max_new_tokens=64)`` -> LMI's answer
    (``{"generated_text": ...}``); ``predict_stream`` -> the text as it is
    generated; ``chat(messages)`` -> an OpenAI chat completion.

    Generation parameters are keyword arguments (or a ``parameters`` dict); the
    other keywords are the ``sagemaker`` ``Predictor``'s (``initial_args``,
    ``target_variant``, ``inference_id``, ``custom_attributes``, ``component_name``)."""

    def __init__(
        self, endpoint_name: str, sagemaker_session=None, serializer=None, deserializer=None, **kwargs
    ) -> None:
        super().__init__(
            endpoint_name,
            sagemaker_session,
            serializer=serializer or JSONSerializer(),
            deserializer=deserializer or JSONDeserializer(),
            **kwargs,
        )

    # LMI's predictor takes the generation parameters second (the SDK's takes initial_args there)
    def predict(  # type: ignore[override]
        self,
        data,
        parameters: dict | None = None,
        *,
        initial_args=None,
        target_model=None,
        target_variant=None,
        inference_id=None,
        custom_attributes=None,
        component_name=None,
        **generation,
    ) -> Any:
        """The answer to ``data`` (see ``request_body``), as JSON."""
        body = request_body(data, {**(parameters or {}), **generation})
        return super().predict(
            body,
            initial_args=initial_args,
            target_model=target_model,
            target_variant=target_variant,
            inference_id=inference_id,
            custom_attributes=custom_attributes,
            component_name=component_name,
        )

    def predict_stream(  # type: ignore[override]  # parameters second, as predict()
        self,
        data,
        parameters: dict | None = None,
        *,
        raw: bool = False,
        initial_args=None,
        target_variant=None,
        inference_id=None,
        custom_attributes=None,
        component_name=None,
        **generation,
    ) -> Iterator:
        """Stream the answer to ``data``: an iterator over the text pieces as they
        are generated, or with ``raw=True`` over the JSON items themselves (LMI's
        ``{"token": ...}`` lines, OpenAI chunks). An error the server sends after
        the stream began raises ``StreamError``."""
        body = request_body(data, {**(parameters or {}), **generation}, stream=True)
        pieces = super().predict_stream(
            body,
            initial_args=initial_args,
            target_variant=target_variant,
            inference_id=inference_id,
            custom_attributes=custom_attributes,
            component_name=component_name,
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
