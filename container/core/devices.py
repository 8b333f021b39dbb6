"""Accelerator discovery and the split of devices into worker groups.

Devices come from ``CUDA_VISIBLE_DEVICES`` when it is set (so a machine without
GPUs can be told it has some), otherwise from the NVIDIA driver's
``/proc/driver/nvidia/gpus``. Each worker group gets ``tensor_parallel_degree x
pipeline_parallel_degree`` consecutive devices; with accelerators there are as
many groups as fit (capped by ``max_workers``), without them ``min_workers``
(default 1), each running its ``tp x pp`` engine processes on the CPU.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from container.core.settings import Settings, SettingsError

log = logging.getLogger(__name__)

_NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


@dataclass(frozen=True)
class GroupPlan:
    """One worker group: its index, the devices it owns (empty on CPU) and its
    parallel layout (``world_size`` = tp x pp: its MPI ranks, or vLLM's workers)."""

    index: int
    devices: tuple[str, ...]
    tensor_parallel_degree: int = 1
    pipeline_parallel_degree: int = 1

    @property
    def cuda_visible_devices(self) -> str | None:
        return ",".join(self.devices) if self.devices else None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_degree * self.pipeline_parallel_degree


def parse_visible_devices(value: str) -> list[str]:
    """``"0,1, 2"`` -> ``["0", "1", "2"]``; ``""`` or ``"-1"`` -> no devices."""
    devices = [d.strip() for d in value.split(",") if d.strip()]
    return [] if devices in ([], ["-1"]) else devices


def discover_devices(settings: Settings, proc_dir: Path = _NVIDIA_PROC) -> list[str]:
    if settings.cuda_visible_devices is not None:
        return parse_visible_devices(settings.cuda_visible_devices)
    if proc_dir.is_dir():
        return [str(i) for i in range(len(list(proc_dir.iterdir())))]
    return []


def _source(settings: Settings, key: str) -> str:
    return settings.sources.get(key, "default")


def resolve_tensor_parallel(settings: Settings, devices: int, names: str = "") -> int:
    """The tensor parallel degree a worker group runs with when ``devices`` accelerators are
    visible (0: the CPU). ``max`` stands for every device one pipeline stage can have
    (``devices // pipeline_parallel_degree``), and for 1 on the CPU. The one resolver the
    container (``plan_groups``), ``sagelmi plan`` and the SDK use.

    Raises ``SettingsError`` when ``max`` meets a device count that ``pp`` does not divide."""
    tp, pp = settings.tensor_parallel_degree, settings.pipeline_parallel_degree
    if tp != "max":
        return tp
    if not devices:
        return 1
    if devices % pp:
        raise SettingsError(
            f"option.tensor_parallel_degree=max with option.pipeline_parallel_degree={pp} "
            f"({_source(settings, 'option.pipeline_parallel_degree')}) needs a device count divisible by {pp}, "
            f"but {devices} are visible{f' ({names})' if names else ''}"
        )
    return devices // pp


def plan_groups(settings: Settings, devices: list[str]) -> list[GroupPlan]:
    """Split ``devices`` into worker groups as the settings ask.

    Raises ``SettingsError`` when a group cannot get the devices it needs."""
    pp = settings.pipeline_parallel_degree
    tp = resolve_tensor_parallel(settings, len(devices), ",".join(devices))
    if not devices:
        if tp * pp > 1:
            log.info(
                "no accelerators are visible: each worker group runs %d (tp %d x pp %d) processes on the CPU",
                tp * pp,
                tp,
                pp,
            )
        count = settings.min_workers or settings.max_workers or 1
        return [GroupPlan(i, (), tp, pp) for i in range(count)]
    per_group = tp * pp
    if per_group > len(devices):
        raise SettingsError(
            f"option.tensor_parallel_degree={tp} ({_source(settings, 'option.tensor_parallel_degree')}) x "
            f"option.pipeline_parallel_degree={pp} ({_source(settings, 'option.pipeline_parallel_degree')}) "
            f"needs {per_group} accelerators, but only {len(devices)} are visible ({','.join(devices)})"
        )
    count = len(devices) // per_group
    if settings.max_workers:
        count = min(count, settings.max_workers)
    return [GroupPlan(i, tuple(devices[i * per_group : (i + 1) * per_group]), tp, pp) for i in range(count)]


def cpu_threads(plans: list[GroupPlan], cores: list[int] | None = None) -> int:
    """The cores of one engine process's share when the usable cores are split evenly
    between the processes of ``plans`` (at least one): its OpenMP threads."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    return max(1, len(cores) // sum(p.world_size for p in plans))


def cpu_binding(plans: list[GroupPlan], cores: list[int] | None = None) -> dict[int, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for each CPU worker group, by group index:
    the usable cores split evenly, one share per engine process (``0-3|4-7``).
    vLLM's CPU build needs a share per local engine process once a group has
    several (tensor or pipeline parallel); sharing cores is better than refusing."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    per_process = cpu_threads(plans, cores)
    binding, next_core = {}, 0
    for plan in plans:
        shares = []
        for _ in range(plan.world_size):
            share = [cores[(next_core + i) % len(cores)] for i in range(per_process)]
            next_core += per_process
            shares.append(_ranges(share))
        binding[plan.index] = "|".join(shares)
    return binding


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts, start = [], None
    for i, core in enumerate(ids):
        if start is None:
            start = core
        if i + 1 == len(ids) or ids[i + 1] != core + 1:
            parts.append(str(start) if start == core else f"{start}-{core}")
            start = None
    return ",".join(parts)
