"""SageMaker inference toolkit scripts (``inference.py``) as a handler, as Hugging Face's and
PyTorch's SageMaker containers run them (``sagemaker_inference.transformer.Transformer``).

The script defines ``model_fn(model_dir)`` (without it, the model is what the toolkits load by
default: ``handlers/api/toolkit_model.py``) and either ``transform_fn(model, body, content_type,
accept)`` or any of ``input_fn(body, content_type)``, ``predict_fn(data, model)`` and
``output_fn(prediction, accept)``; the ones it leaves out are the defaults of
``handlers/api/toolkit_codecs.py``. Each function may take one more argument, the context
(``ToolkitContext``), as the toolkit passes it. ``model_fn`` runs once, on the worker's
initialisation call. Per request: a JSON or CSV body reaches ``input_fn`` as text, any other as
bytes; ``Accept`` missing or ``*/*`` is ``option.default_invocations_accept``
(``SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT``, ``application/json``); what ``output_fn`` returns is
the body (a ``(body, content type)`` pair sets the type, else it is the accept type).

Errors, as the toolkit maps them: an exception with an integer ``status_code`` (the toolkit's
``BaseInferenceToolkitError``) or ``error_code`` (the model server's ``PredictionException``)
answers with that status and its ``message``; any other answers 500 with its text (tracebacks
stay in the log). A batch (``batch_size`` > 1) runs the functions once per request, as the
toolkit's transformer does, and fails as a whole.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from container.core.errors import AnswerError
from handlers.api import Input, Output
from handlers.api.toolkit_codecs import (
    ANY,
    UTF8_TYPES,
    default_input_fn,
    default_output_fn,
    default_predict_fn,
    media_type,
)
from handlers.api.toolkit_model import default_model_loader

log = logging.getLogger(__name__)

FUNCTIONS = ("model_fn", "transform_fn", "input_fn", "predict_fn", "output_fn")


def is_toolkit_script(module: Any) -> bool:
    """Whether ``module`` defines any of the toolkit's functions."""
    return any(callable(getattr(module, name, None)) for name in FUNCTIONS)


@dataclass
class _Request:
    properties: dict

    def get_request_properties(self) -> dict:
        return self.properties


@dataclass
class ToolkitContext:
    """What the toolkit's functions get as ``context``: the model server's ``Context`` in the
    parts scripts read (``system_properties``, the request headers)."""

    system_properties: dict
    request_processor: list[_Request] = field(default_factory=list)

    def get_request_header(self, idx: int, key: str) -> str | None:
        headers = self.request_processor[idx].properties
        return next((v for k, v in headers.items() if k.lower() == key.lower()), None)

    def get_all_request_header(self, idx: int) -> dict:
        return dict(self.request_processor[idx].properties)


def _call(fn: Callable[..., Any], context: ToolkitContext, *args: Any) -> Any:
    """Call ``fn`` with ``args``, plus the context when it takes one more argument."""
    wanted = len(inspect.signature(fn).parameters)
    if wanted == len(args):
        return fn(*args)
    if wanted == len(args) + 1:
        return fn(*args, context)
    raise TypeError(f"{fn.__name__} takes {wanted} arguments but {len(args)} were given")


def _status_error(exc: Exception) -> AnswerError:
    for attribute in ("status_code", "error_code"):
        status = getattr(exc, attribute, None)
        if isinstance(status, int) and not isinstance(status, bool):
            return AnswerError(str(getattr(exc, "message", None) or exc), status)
    return AnswerError(str(exc) or "Invalid Request", 500)  # the toolkit's words for an empty message


class ToolkitHandler:
    """A toolkit script as a ``handle(inputs) -> Output`` function."""

    def __init__(self, module: Any, model_dir: str, default_accept: str, task: str | None = None) -> None:
        self.model_dir = model_dir
        self.default_accept = default_accept
        self.model: Any = None
        self.loaded = False
        self.model_fn = getattr(module, "model_fn", None)
        self.transform_fn = getattr(module, "transform_fn", None)
        pieces = {name: getattr(module, name, None) for name in ("input_fn", "predict_fn", "output_fn")}
        if self.transform_fn is not None and any(pieces.values()):
            raise ValueError("transform_fn cannot be combined with input_fn, predict_fn or output_fn")
        self.load: Callable[..., Any] = self.model_fn or default_model_loader(model_dir, task)
        if self.model_fn is None:
            log.info("the script defines no model_fn: loading with %s", self.load.__doc__)
        self.input_fn = pieces["input_fn"] or default_input_fn
        self.predict_fn = pieces["predict_fn"] or default_predict_fn
        self.output_fn = pieces["output_fn"] or default_output_fn

    def handle(self, inputs: Input) -> Output | None:
        if inputs.is_empty():  # the initialisation call
            if not self.loaded:
                context = ToolkitContext(self._system_properties(inputs))
                self.model = _call(self.load, context, self.model_dir)
                self.loaded = True
                log.info("model_fn loaded a %s", type(self.model).__name__)
            return None
        items = inputs.get_batches()
        context = ToolkitContext(self._system_properties(inputs), [_Request(i.get_properties()) for i in items])
        try:
            answers = [self._transform(item, context) for item in items]
        except Exception as exc:
            log.exception("the inference script failed")
            raise _status_error(exc) from None
        output = Output()
        if not inputs.is_batch():
            body, content_type = answers[0]
            return output.add(body).add_property("Content-Type", content_type)
        for index, (body, _) in enumerate(answers):
            output.add(body, batch_index=index)
        return output.add_property("Content-Type", answers[0][1])

    def _system_properties(self, inputs: Input) -> dict:
        device = inputs.get_property("device_id")
        return {
            "model_dir": self.model_dir,
            "gpu_id": int(device) if device not in (None, "-1") else None,
            "batch_size": inputs.get_batch_size(),
        }

    def _transform(self, item: Input, context: ToolkitContext) -> tuple[Any, str]:
        body: Any = item.get_as_bytes() or b""
        content_type = item.get_property("Content-Type")
        accept = item.get_property("Accept")
        if not accept or accept == ANY:
            accept = self.default_accept
        if media_type(content_type) in UTF8_TYPES:
            body = bytes(body).decode("utf-8")
        if self.transform_fn is not None:
            result = _call(self.transform_fn, context, self.model, body, content_type, accept)
        else:
            data = _call(self.input_fn, context, body, content_type)
            prediction = _call(self.predict_fn, context, data, self.model)
            result = _call(self.output_fn, context, prediction, accept)
        if isinstance(result, tuple):
            return result[0], str(result[1])
        return result, accept
