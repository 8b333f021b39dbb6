"""The SageMaker inference toolkit's default ``input_fn``, ``predict_fn`` and ``output_fn``,
for a script that leaves some of them out (``handlers/api/inference_toolkit.py``).

Decoding, as ``sagemaker_inference.decoder`` does it: ``application/json`` to a numpy array
(a JSON object stays a dict, as the Hugging Face toolkit decodes it: a numpy array of a dict is
of no use to any script), ``text/csv`` with ``numpy.genfromtxt``, ``application/x-npy`` with
``numpy.load`` (without pickles: a request body never runs code here). Encoding, as
``sagemaker_inference.encoder``: the first type of the ``Accept`` list among JSON, CSV and NPY;
tensors and numpy values become lists. Prediction: a ``torch.nn.Module`` is called as the
PyTorch toolkit calls it (a float tensor, ``eval()``, no gradients), a callable with a dict as
the Hugging Face toolkit calls a pipeline (``inputs`` and ``parameters``).
"""

from __future__ import annotations

import io
import json
import sys
from typing import Any

import numpy as np

JSON = "application/json"
CSV = "text/csv"
NPY = "application/x-npy"
ANY = "*/*"
UTF8_TYPES = (JSON, CSV)  # bodies of these types reach input_fn as text


class UnsupportedFormatError(Exception):
    """The content type (or no type of the ``Accept`` list) has no default codec."""

    def __init__(self, content_type: str | None) -> None:
        super().__init__(
            f"Content type {content_type} is not supported by the default handlers: define input_fn "
            "to decode the request or output_fn to encode the answer"
        )


def media_type(content_type: str | None) -> str:
    """``application/json`` from ``application/json; charset=utf-8``."""
    return (content_type or "").split(";")[0].strip().lower()


def _text(data: Any) -> str:
    return data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else str(data)


def default_input_fn(input_data: Any, content_type: str | None, context: Any = None) -> Any:
    kind = media_type(content_type)
    if kind == JSON:
        value = json.loads(_text(input_data))
        return value if isinstance(value, dict) else np.array(value)
    if kind == CSV:
        return np.genfromtxt(io.StringIO(_text(input_data)), delimiter=",")
    if kind == NPY:
        return np.load(io.BytesIO(bytes(input_data)), allow_pickle=False)
    raise UnsupportedFormatError(content_type)


def _torch_module(model: Any) -> Any:
    torch = sys.modules.get("torch")  # only a script that imported torch can have a torch model
    return torch if torch is not None and isinstance(model, torch.nn.Module) else None


def default_predict_fn(data: Any, model: Any, context: Any = None) -> Any:
    torch = _torch_module(model)
    if torch is not None:
        tensor = data if isinstance(data, torch.Tensor) else torch.as_tensor(np.asarray(data), dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            return model(tensor)
    if callable(model) and isinstance(data, dict):
        inputs = data.pop("inputs", data)
        parameters = data.pop("parameters", None)
        return model(inputs, **parameters) if parameters is not None else model(inputs)
    raise NotImplementedError(
        f"no default predict_fn for a {type(model).__name__} model and {type(data).__name__} data: define predict_fn"
    )


def _plain(value: Any) -> Any:
    """Tensors and numpy values as lists and numbers."""
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _json(value: Any) -> str:
    return json.dumps(_plain(value), default=_plain, ensure_ascii=False)


def _csv(value: Any) -> str:
    stream = io.StringIO()
    np.savetxt(stream, np.asarray(_plain(value)), delimiter=",", fmt="%s")
    return stream.getvalue()


def _npy(value: Any) -> bytes:
    stream = io.BytesIO()
    np.save(stream, np.asarray(_plain(value)))
    return stream.getvalue()


_ENCODERS = {JSON: _json, CSV: _csv, NPY: _npy}


def default_output_fn(prediction: Any, accept: str, context: Any = None) -> tuple[Any, str]:
    """``(body, content type)``: the first type of ``accept`` there is an encoder for."""
    for kind in accept.replace(" ", "").split(","):
        encoder = _ENCODERS.get(media_type(kind))
        if encoder is not None:
            return encoder(prediction), media_type(kind)
    raise UnsupportedFormatError(accept)
