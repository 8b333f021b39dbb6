"""sagelmi's vLLM plugin (entry point group ``vllm.general_plugins``): vLLM loads it
in every process it starts, engine workers included, before a model runs.

It fixes three bugs of vLLM 0.32's CPU build; GPU builds are left alone.

- **LoRA in mixed batches.** The CPU LoRA kernels (``vllm/lora/ops/torch_ops``,
  ``bgmv_shrink``) pick each row's adapter weights by indexing with the row's slot,
  and a base-model row's slot is -1, which Python indexing reads as the last slot. In
  a batch that mixes adapters and the base model, base-model requests are then
  answered by an adapter. The fix zeroes the shrink output of rows whose slot is -1,
  so their LoRA delta is exactly zero (the expand step multiplies that zero).
- **A seeded request whose prompt is split across steps killed the engine.** When a
  step covers only part of a prompt, the token sampled for that request is thrown
  away, and ``GPUModelRunner._bookkeeping_sync`` rewinds the request's random
  generator with ``set_offset(get_offset() - 4)``: CUDA's Philox generator has an
  offset, a CPU generator (Mersenne Twister) raises "CPU Generator does not use
  offset", which ends the engine. Any sampled request with a ``seed`` and a prompt
  longer than the step's token budget (or sharing a busy step) did it. The fix saves
  the state of those generators before sampling and puts it back instead, which is
  what the rewind means: the seeded answer is the same as if the prompt had been
  taken in one step.

- **Tensor parallel across machines.** The CPU build's all-reduce goes through shared
  memory (``_CPUSHMDistributed``) whenever the group's ranks agree on a shared-memory name,
  and that name is made of the rendezvous port, the same on every machine: ranks on two
  machines (a cluster, ``container/supervisor/cluster.py``) then each map a segment of their
  own and never meet. The fix makes that agreement also require one hostname, so such a
  group falls back to ``torch.distributed`` (gloo), as vLLM does when the names differ.

The second and third fixes wait for vLLM to import its model runner (``_after_import``): only the
processes that run the model import it. Importing it in the others at plugin load cost
start-up time: 0.23 s in the process holding ``AsyncLLM``, 0.56 s in the EngineCore
(which needs about half of those modules later anyway).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType

log = logging.getLogger("sagelmi.vllm_plugin")

_PATCHED = "_sagelmi_patched"
_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"  # GPUModelRunner: the CPU runner's base, it inherits both
_CPU_COMMUNICATOR = "vllm.distributed.device_communicators.cpu_communicator"


def _masking(shrink):
    def bgmv_shrink(inputs, lora_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
        shrink(inputs, lora_weights, output_tensor, lora_indices_tensor, scaling)
        base_rows = lora_indices_tensor < 0
        if bool(base_rows.any()):
            output_tensor[: base_rows.shape[0]][base_rows] = 0

    setattr(bgmv_shrink, _PATCHED, True)
    return bgmv_shrink


def _rewinding_seeded_generators(runner_class) -> None:
    """``_sample`` remembers the state of the generators whose token will be thrown away;
    ``_bookkeeping_sync`` restores them and hides them from vLLM's offset rewind."""
    import numpy as np

    sample, bookkeeping = runner_class._sample, runner_class._bookkeeping_sync

    def _discarded(runner) -> list[int]:
        batch = runner.input_batch
        rows = np.nonzero(runner.discard_request_mask.np[: batch.num_reqs])[0]
        return [int(i) for i in rows if int(i) in batch.generators]

    def _sample(self, *args, **kwargs):
        self._sagelmi_rewind = {i: self.input_batch.generators[i].get_state() for i in _discarded(self)}
        return sample(self, *args, **kwargs)

    def _bookkeeping_sync(self, *args, **kwargs):
        states = getattr(self, "_sagelmi_rewind", None) or {}
        generators = self.input_batch.generators
        for i, state in states.items():
            generators[i].set_state(state)
        self.input_batch.generators = {i: g for i, g in generators.items() if i not in states}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators = generators
            self._sagelmi_rewind = None

    setattr(_bookkeeping_sync, _PATCHED, True)
    runner_class._sample, runner_class._bookkeeping_sync = _sample, _bookkeeping_sync


class _PatchingLoader(importlib.abc.Loader):
    """Runs the module's own loader, then ``patch`` on the module."""

    def __init__(self, loader, patch: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.patch = patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, name: str):  # get_source, get_filename ...: the module's own loader's
        return getattr(self.loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``name`` is imported, it hands the import system the
    spec the other finders give, with a loader that calls ``patch`` once the module
    has run. Used once, then removed."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.patch = patch
        self._finding = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or getattr(self._finding, "active", False):
            return None
        self._finding.active = True
        try:
            spec = importlib.util.find_spec(fullname)  # the other finders' answer
        finally:
            self._finding.active = False
        if spec is None or spec.loader is None:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec.loader = _PatchingLoader(spec.loader, self.patch)
        return spec


def _after_import(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Call ``patch(module)`` when module ``name`` is imported: now, if it already is."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, patch))


def _fix_runner(module: ModuleType) -> None:
    runner_class = module.GPUModelRunner
    if not getattr(runner_class._bookkeeping_sync, _PATCHED, False):
        _rewinding_seeded_generators(runner_class)
        log.debug("vLLM CPU: seeded generators of split prompts are rewound by their state")


def _fix_shm_check(module: ModuleType) -> None:
    communicator = module.CpuCommunicator
    check = communicator._all_group_ranks_share_shm_group_name
    if getattr(check, _PATCHED, False):
        return

    def _all_group_ranks_share_shm_group_name(self) -> bool:
        import socket

        import torch

        hosts: list[str] = [""] * self.world_size
        torch.distributed.all_gather_object(hosts, socket.gethostname(), group=self.device_group)
        return check(self) and len(set(hosts)) == 1  # every rank takes part in both gathers

    setattr(_all_group_ranks_share_shm_group_name, _PATCHED, True)
    communicator._all_group_ranks_share_shm_group_name = _all_group_ranks_share_shm_group_name
    log.debug("vLLM CPU: shared-memory collectives only between ranks of one machine")


def register() -> None:
    """Called by vLLM in each of its processes (possibly more than once)."""
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError:
        return
    if not current_platform.is_cpu() or not vllm.__version__.startswith("0.32."):
        return
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if not getattr(lora_ops.bgmv_shrink, _PATCHED, False):
        fixed = _masking(lora_ops.bgmv_shrink)
        lora_ops.bgmv_shrink = fixed  # what sgmv_shrink (prefill) calls
        punica_cpu.bgmv_shrink = fixed  # what the CPU punica wrapper calls directly (decode, logits)
        log.debug("vLLM CPU LoRA: base-model rows of mixed batches get no adapter delta")
    _after_import(_RUNNER_MODULE, _fix_runner)
    _after_import(_CPU_COMMUNICATOR, _fix_shm_check)
