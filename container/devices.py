"""Accelerator discovery and the split of devices into worker groups.

Devices come from ``CUDA_VISIBLE_DEVICES`` when it is set (so a machine without
GPUs can be told it has some), otherwise from the NVIDIA driver's
``/proc/driver/nvidia/gpus``. Each worker group gets ``tensor_parallel_degree``
consecutive devices; with accelerators there are as many groups as fit
(capped by ``max_workers``), without them ``min_workers`` (default 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from container.settings import Settings, SettingsError

_NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


@dataclass(frozen=True)
class GroupPlan:
    """One worker group: its index and the devices it owns (empty on CPU)."""

    index: int
    devices: tuple[str, ...]

    @property
    def cuda_visible_devices(self) -> str | None:
        return ",".join(self.devices) if self.devices else None


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


def plan_groups(settings: Settings, devices: list[str]) -> list[GroupPlan]:
    """Split ``devices`` into worker groups as the settings ask.

    Raises ``SettingsError`` when a group cannot get the devices it needs."""
    tp = settings.tensor_parallel_degree
    if not devices:
        if tp not in ("max", 1):
            raise SettingsError(
                f"option.tensor_parallel_degree={tp} ({settings.sources.get('option.tensor_parallel_degree')}) "
                f"needs {tp} accelerators, but none are visible (CUDA_VISIBLE_DEVICES "
                f"{'unset' if settings.cuda_visible_devices is None else repr(settings.cuda_visible_devices)})")
        count = settings.min_workers or settings.max_workers or 1
        return [GroupPlan(i, ()) for i in range(count)]
    per_group = len(devices) if tp == "max" else tp
    if per_group > len(devices):
        raise SettingsError(
            f"option.tensor_parallel_degree={tp} ({settings.sources.get('option.tensor_parallel_degree')}) "
            f"needs {per_group} accelerators, but only {len(devices)} are visible ({','.join(devices)})")
    count = len(devices) // per_group
    if settings.max_workers:
        count = min(count, settings.max_workers)
    return [GroupPlan(i, tuple(devices[i * per_group:(i + 1) * per_group])) for i in range(count)]
