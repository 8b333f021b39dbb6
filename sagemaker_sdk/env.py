"""The container's environment, built and checked on the user's machine with the
container's own settings schema (``container.core.settings``) and engine-option check
(``container.core.engine_args.check_engine_option``), so that a setting the container
would refuse is refused here first, with the same message, before anything
reaches AWS. Nothing here imports vLLM, torch or gunicorn, or calls AWS.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from container.core.engine_args import check_engine_options
from container.core.handler_choice import uses_builtin_engine
from container.core.setting_keys import KEY_BY_NAME, KEYS
from container.core.settings import Settings, SettingsError, resolve_settings


@dataclass(frozen=True)
class ContainerEnv:
    """What the container will read: its environment and the settings it resolves to."""

    env: dict[str, str]
    settings: Settings
    builtin_engine: bool  # the built-in engine serves (vLLM / lmi-dist): engine options were checked


def env_name(key: str) -> str:
    """The environment variable the container reads first for a ``serving.properties``
    key: ``option.tensor_parallel_degree`` -> ``OPTION_TENSOR_PARALLEL_DEGREE``,
    ``job_queue_size`` -> ``SERVING_JOB_QUEUE_SIZE``, ``option.max_model_len`` ->
    ``OPTION_MAX_MODEL_LEN``. Raises ``SettingsError`` for a key that is neither."""
    if key in KEY_BY_NAME:
        return KEY_BY_NAME[key].env[0]
    if key.lower().startswith("option.") and len(key) > len("option."):
        return "OPTION_" + key[len("option.") :].upper()
    known = [k.key for k in KEYS if not k.key.startswith("option.")]
    raise SettingsError(f"{key} is not a sagelmi setting (settings: option.<name>, {', '.join(known)})")


def env_text(value: Any) -> str:
    """A Python value as the text the container parses: ``true``/``false``, JSON
    for dicts and lists, ``str()`` otherwise."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _spellings(key: str) -> tuple[str, ...]:
    """Every environment name the container reads for ``key``."""
    spec = KEY_BY_NAME.get(key)
    return spec.env + spec.sagemaker if spec else (env_name(key),)


def build_container_env(
    settings: Mapping[str, Any], env: Mapping[str, Any] | None = None, handler_dir: str | Path | None = None
) -> ContainerEnv:
    """The container environment for ``settings`` (``serving.properties`` key ->
    value; ``None`` values are left out) on top of the user's ``env``, checked as
    the container will check it, with ``handler_dir`` as its model directory
    (its ``serving.properties`` is read, as the container reads it).

    Raises ``SettingsError`` for a value the container refuses, a setting given
    twice (here and in ``env``) or overridden by the handler directory's
    ``serving.properties``; ``EngineOptionError`` for an ``option.*`` the built-in
    engine does not know (checked only when the built-in engine serves)."""
    out = {name: env_text(value) for name, value in (env or {}).items()}
    ours: dict[str, str] = {}
    for key, value in settings.items():
        if value is None:
            continue
        name = env_name(key)
        given = [n for n in _spellings(key) if n in out and n not in ours.values()]
        if given:
            raise SettingsError(
                f"{key} is given twice: {env_text(value)!r} here and {out[given[0]]!r} as env {given[0]}; give it once"
            )
        out[name] = env_text(value)
        ours[key] = name
    handler_dir = Path(handler_dir).absolute() if handler_dir is not None else None
    if handler_dir is not None and not handler_dir.is_dir():
        raise SettingsError(f"handler_dir {handler_dir} is not a directory")
    with tempfile.TemporaryDirectory(prefix="sagelmi-sdk-") as empty:
        resolved = resolve_settings(out, handler_dir or empty)
    for key, name in ours.items():
        source = resolved.sources.get(key, "")
        if source != f"env {name}":
            raise SettingsError(
                f"{key}={out[name]} is overridden by {source} (value "
                f"{_resolved_text(resolved, key)!r}); set it in one place"
            )
    check_engine_options(resolved, handler_dir, known_bad=False)  # this machine's vLLM is not the image's
    builtin = uses_builtin_engine(resolved, handler_dir)
    return ContainerEnv(out, resolved, builtin)


def _resolved_text(settings: Settings, key: str) -> str:
    spec = KEY_BY_NAME.get(key)
    return str(getattr(settings, spec.field)) if spec else settings.options.get(key[len("option.") :], "")
