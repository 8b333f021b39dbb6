"""``sagelmi serve`` plans the model as ``sagelmi plan`` does, logs it at start-up,
and, once the engine is up, compares the KV-cache tokens it predicted with what
vLLM reports (``vllm:cache_config_info``: blocks x block size, in the metrics the
first worker group answers over the wire protocol), warning when they
differ by more than ``TOLERANCE``. A model it cannot plan (a Hub id, no
safetensors, a custom handler, GPUs whose memory it cannot read) is skipped, said
once at DEBUG level.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path

from container.core.errors import ServingError
from container.core.plan import Plan, PlanError, plan_from_settings, read_model, render
from container.core.settings import Settings
from container.frontend.group_client import GroupClient

log = logging.getLogger("sagelmi.plan")

TOLERANCE = 0.05
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.M)


def _gpu_memory_gib() -> float | None:
    """The first visible GPU's memory, from nvidia-smi (None when there is none)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        return float(out.split()[0]) / 1024
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def startup_plan(settings: Settings, model_location: str, devices: list[str], tp: int, pp: int) -> Plan | None:
    """The plan of one worker group (``tp`` x ``pp`` ranks) for the built-in vLLM engine, logged; None if none."""
    from container.core.handler_choice import accelerate_reason

    directory = Path(model_location)
    if (
        settings.builtin_engine not in ("vllm", "lmi-dist")
        or accelerate_reason(settings) is not None
        or (directory / "model.py").is_file()
        or settings.entry_point
    ):
        return None
    memory = _gpu_memory_gib() if devices else None
    kv_space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")  # vLLM's own variable: the CPU build's KV cache size
    try:
        if devices and memory is None:
            raise PlanError("the GPUs' memory could not be read (nvidia-smi)")
        plan = plan_from_settings(
            read_model(directory, None),
            settings.options,
            gpus=len(devices) or None,
            gpu_memory_gib=memory,
            tp=tp,
            pp=pp,
            hardware=f"{len(devices)} GPU(s) x {memory:.0f} GiB" if devices else "vLLM's CPU build",
            cpu_kv_cache_gib=float(kv_space) if kv_space else None,
        )
    except (PlanError, OSError, ValueError) as exc:
        log.debug("no start-up plan: %s", exc)
        return None
    for line in render(plan).splitlines():
        if line:
            log.info("plan: %s", line)
    return plan


def reported_kv_tokens(metrics: str) -> int | None:
    """vLLM's KV-cache tokens (blocks x block size) from a /metrics text, if there."""
    match = _CACHE_INFO.search(metrics)
    if not match:
        return None
    labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
    try:
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return None


def compare_kv(plan: Plan, group: GroupClient) -> None:
    """Log vLLM's KV-cache tokens, from the metrics of the ``group`` the plan is for,
    beside the plan's; a warning beyond ``TOLERANCE``."""
    try:
        reported = reported_kv_tokens(group.fetch_metrics(timeout=5))
    except ServingError as exc:
        log.debug("cannot read worker group %s's metrics to compare the KV cache: %s", group.name, exc)
        return
    predicted = plan.splits[0].kv_tokens
    if reported is None or not reported:
        return
    off = abs(predicted - reported) / reported
    if off > TOLERANCE:
        log.warning(
            "plan: the KV cache holds %d tokens, the plan predicted %d (%.0f%% off): sagelmi plan's "
            "estimate for this model is wrong; trust vLLM's number",
            reported,
            predicted,
            100 * off,
        )
    else:
        log.info("plan: the KV cache holds %d tokens, as predicted (%d, %.1f%% off)", reported, predicted, 100 * off)
