"""Request decoding and answer encoding by content type, as LMI's default
handlers do it (``decode(inputs, content_type)`` / ``encode(outputs, prediction, accept)``)."""

from __future__ import annotations

import csv
import io

import numpy as np

from handlers.api import Input, Output

_CSV_HEADERS = ("question", "context", "inputs")


def decode_csv(inputs: Input, require_headers: bool = True):
    """CSV with a header row naming ``inputs`` (or ``question``/``context``) ->
    ``{"inputs": [...]}``; without headers, numeric CSV -> a numpy array."""
    text = inputs.get_as_string()
    if require_headers:
        first_line = text.splitlines()[0].lower() if text else ""
        if not any(name in first_line for name in _CSV_HEADERS):
            raise ValueError(
                "You need to provide the correct CSV with Header columns to use it with the "
                "inference toolkit default handler."
            )
        rows = list(csv.DictReader(io.StringIO(text)))
        if not rows:
            raise ValueError("the CSV has a header row but no data rows")
        if "inputs" in rows[0]:
            return {"inputs": [row["inputs"] for row in rows]}
        return {"inputs": rows}
    values = np.genfromtxt(io.StringIO(text), delimiter=",")
    if np.isnan(values).any():
        raise ValueError("CSV contains non-numeric data. Please provide numeric data only.")
    return values


def encode_csv(content) -> str:
    """A list of dicts (rows) as CSV text with a header row."""
    rows = content if isinstance(content, list) else list(content)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0].keys()))
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def decode(inputs: Input, content_type: str | None, key: str | None = None, require_csv_headers: bool = True):
    """The request's content, decoded after ``content_type``."""
    content_type = content_type or ""
    if not content_type:
        data = inputs.get_as_bytes(key=key)
        return {"inputs": ""} if not data else inputs.get_as_json(key=key)
    if "application/json" in content_type:
        return inputs.get_as_json(key=key)
    if "text/csv" in content_type:
        return decode_csv(inputs, require_headers=require_csv_headers)
    if "text/plain" in content_type:
        return {"inputs": [inputs.get_as_string(key=key)]}
    if content_type.startswith("image/"):
        return {"inputs": inputs.get_as_image(key=key)}
    if content_type.startswith("audio/"):
        return {"inputs": inputs.get_as_bytes(key=key)}
    if "tensor/npz" in content_type:
        return {"inputs": inputs.get_as_npz(key=key)}
    if content_type in ("tensor/ndlist", "application/x-npy"):
        return {"inputs": inputs.get_as_numpy(key=key)}
    if content_type == "application/x-www-form-urlencoded":
        return {"inputs": inputs.get_as_string(key=key)}
    return {"inputs": inputs.get_as_bytes(key=key)}


def encode(outputs: Output, prediction, content_type: str | None, key: str | None = None) -> None:
    """Add ``prediction`` to ``outputs`` in the type the client accepts."""
    content_type = content_type or ""
    if not content_type or "application/json" in content_type:
        outputs.add_as_json(prediction, key=key)
        outputs.add_property("Content-Type", "application/json")
    elif "text/csv" in content_type:
        outputs.add_as_string(encode_csv(prediction), key=key)
        outputs.add_property("Content-Type", "text/csv")
    elif "tensor/npz" in content_type:
        outputs.add_as_npz(prediction, key=key)
        outputs.add_property("Content-Type", "tensor/npz")
    else:
        outputs.add_as_numpy(prediction, key=key)
        outputs.add_property("Content-Type", "tensor/ndlist")
