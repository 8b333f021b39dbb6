"""The packaged list of vLLM's engine arguments (``vllm_engine_args.json`` next to this
module): each public ``AsyncEngineArgs`` field's name and a simple kind of value, generated
from the installed vLLM by ``sagelmi engine-args --write``. The core checks names against it
without importing vLLM: ``container.core.engine_args`` for ``option.*`` names,
``container.core.sm_vllm`` for ``SM_VLLM_*`` variables."""

from __future__ import annotations

import functools
import json
from pathlib import Path

ENGINE_ARGS_FILE = Path(__file__).with_name("vllm_engine_args.json")


def packaged_version() -> str:
    """The vLLM version the list was generated from."""
    return json.loads(ENGINE_ARGS_FILE.read_text())["vllm_version"]


@functools.cache
def packaged_engine_args() -> dict[str, str | list]:
    """vLLM's engine arguments by name, with their kinds, from the packaged list."""
    return json.loads(ENGINE_ARGS_FILE.read_text())["engine_args"]
