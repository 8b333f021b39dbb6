"""The served model's names: the one place that derives them.

The model has two names on purpose, both from ``option.served_model_name`` when it
is set and otherwise from where the model comes from:

- ``engine``: the name the engine serves the model under (vLLM's
  ``served_model_name``): the ids of ``GET /v1/models``, the ``model`` field of
  OpenAI answers, the ``model_name`` label of the engine's metrics. As vLLM names
  a model it loads from the Hub, a Hub id stays whole (``org/model``); any other
  source gives its last part, never a local path.
- ``management``: LMI's model name, in ``GET /models`` (``modelName``) and the
  ``/models/{name}/...`` routes: always the last part of the model's directory,
  ``s3://`` prefix or Hub id (``model`` for ``org/model``), as LMI shows it.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from container.core.artifacts import HUB_ID
from container.core.settings import Settings


class ServedNames(NamedTuple):
    engine: str  # vLLM's served_model_name: /v1/models, OpenAI "model" fields, metric labels
    management: str  # LMI's model name: GET /models and /models/{name}/...


def served_names(settings: Settings, location: str | None = None) -> ServedNames:
    """The served model's two names. The model comes from ``option.model_id``, else
    ``location`` (where the model is: a local path or Hub id), else the model directory."""
    chosen = settings.passthrough_options().get("served_model_name")
    source = settings.model_id or location or settings.model_dir
    last_part = Path(source.rstrip("/")).name or "model"
    is_hub_id = not source.startswith(("/", ".", "~", "s3://")) and HUB_ID.match(source) and not Path(source).exists()
    return ServedNames(engine=chosen or (source if is_hub_id else last_part), management=chosen or last_part)
