"""A handler that loads once, ends its process a second later, and then cannot load again: with
OPTION_MARKER naming a file that does not exist yet, the first start creates it and exits (code 9)
1 s after loading; every later start fails reading a weights file the model directory lacks, an
error that names a local path."""

import os
import threading
import time
from pathlib import Path

from djl_python import Input, Output

_loaded = False


def _die_later() -> None:
    time.sleep(1)
    os._exit(9)


def _load(properties: dict) -> None:
    marker = Path(properties["marker"])
    if marker.exists():
        (Path(properties["model_dir"]) / "missing-weights.bin").read_bytes()
    marker.write_text("loaded once")
    threading.Thread(target=_die_later, daemon=True).start()


def handle(inputs: Input) -> Output | None:
    global _loaded
    if not _loaded:
        _load(inputs.get_properties())
        _loaded = True
    if inputs.is_empty():
        return None
    return Output().add_as_json({"echo": inputs.get_as_json()})
