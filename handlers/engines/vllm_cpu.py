"""The classes ``SagelmiCpuPlatform`` (``handlers.engines.vllm_platform``) gives vLLM 0.32's CPU
build in place of its own: subclasses of vLLM's public classes, each fixing one bug. vLLM imports
this module by name, in the processes that run the model.

- **LoRA in mixed batches** (``BaseRowsPunicaWrapper``). The CPU LoRA kernels pick each row's
  adapter weights by indexing with the row's slot, and a base-model row's slot is -1, which
  indexing reads as the last slot: in a batch that mixes adapters and the base model, base-model
  requests were answered by an adapter. Here those rows' shrink output is zero (or, where shrink
  and expand are one call, their input is), so their LoRA delta is exactly zero.
- **Tensor parallel across machines** (``OneMachineShmCommunicator``). The CPU all-reduce goes
  through shared memory whenever a group's ranks agree on a shared-memory name, which is made of
  the rendezvous port, the same on every machine: ranks on two machines (a cluster) each mapped a
  segment of their own and never met. Here the agreement also requires one hostname, so such a
  group uses ``torch.distributed`` (gloo), as vLLM does when the names differ.
- **A seeded request whose prompt is split across steps** (``SeededCPUWorker``'s runner). When a
  step covers only part of a prompt, the token sampled for it is thrown away and vLLM rewinds the
  request's generator with ``set_offset(get_offset() - 4)``: CUDA's Philox generator has an offset,
  a CPU generator raises "CPU Generator does not use offset", which ended the engine. Here the
  runner saves those generators' states before sampling and restores them instead, which is what
  the rewind means: the answer is the one the whole prompt in one step gives.
"""

from __future__ import annotations

import socket
from typing import Any

import numpy as np
import torch
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker


def _base_rows(indices: torch.Tensor) -> torch.Tensor | None:
    """The rows of a base-model request (slot -1) among ``indices``; None if there are none."""
    base = indices < 0
    return base if bool(base.any()) else None


def _zero_rows(output: torch.Tensor, indices: torch.Tensor) -> None:
    base = _base_rows(indices)
    if base is not None:
        output[: base.shape[0]][base] = 0


def _without_base_rows(inputs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    base = _base_rows(indices)
    if base is None:
        return inputs
    masked = inputs.clone()
    masked[: base.shape[0]][base] = 0
    return masked


class BaseRowsPunicaWrapper(PunicaWrapperCPU):
    """vLLM's CPU LoRA wrapper, giving base-model rows (slot -1) no adapter delta."""

    def _shrink_prefill(self, y: torch.Tensor, x: torch.Tensor, w_t_all: torch.Tensor, scale: float) -> None:
        super()._shrink_prefill(y, x, w_t_all, scale)
        if not self.no_lora:  # the prefill kernel's slots are these, grouped into runs
            _zero_rows(y, self.token_lora_indices)

    def _shrink_decode(self, y: torch.Tensor, x: torch.Tensor, w_t_all: torch.Tensor, scale: float) -> None:
        super()._shrink_decode(y, x, w_t_all, scale)
        _zero_rows(y, self.token_lora_indices)

    def add_lora_logits(self, y: torch.Tensor, x: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        flat = x.view(-1, x.shape[-1])
        super().add_lora_logits(y, _without_base_rows(flat, self.sampler_indices), *args, **kwargs)

    def apply_lora_full_linear(self, y: torch.Tensor, x: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        super().apply_lora_full_linear(y, _without_base_rows(x, self.sampler_indices), *args, **kwargs)


class OneMachineShmCommunicator(CpuCommunicator):
    """vLLM's CPU communicator, taking the shared-memory all-reduce only between ranks of one machine."""

    def _all_group_ranks_share_shm_group_name(self) -> bool:
        hosts: list[str] = [""] * self.world_size
        torch.distributed.all_gather_object(hosts, socket.gethostname(), group=self.device_group)
        return super()._all_group_ranks_share_shm_group_name() and len(set(hosts)) == 1  # all ranks: both gathers


class SeededCPUModelRunner(CPUModelRunner):
    """vLLM's CPU model runner, rewinding a discarded sample's seeded generator by its state."""

    _rewind: dict[int, torch.Tensor] | None = None

    def _discarded_seeded(self) -> list[int]:
        batch = self.input_batch
        rows = np.nonzero(self.discard_request_mask.np[: batch.num_reqs])[0]
        return [int(i) for i in rows if int(i) in batch.generators]

    def _sample(self, *args: Any, **kwargs: Any) -> Any:
        generators = self.input_batch.generators
        self._rewind = {i: generators[i].get_state() for i in self._discarded_seeded()}
        return super()._sample(*args, **kwargs)

    def _bookkeeping_sync(self, *args: Any, **kwargs: Any) -> Any:
        states = self._rewind or {}
        generators = self.input_batch.generators
        for i, state in states.items():
            generators[i].set_state(state)
        # vLLM's rewind (by offset) skips the generators restored here
        self.input_batch.generators = {i: g for i, g in generators.items() if i not in states}
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            self.input_batch.generators = generators
            self._rewind = None


class SeededCPUWorker(CPUWorker):
    """vLLM's CPU worker, whose model runner is a ``SeededCPUModelRunner``."""

    def init_device(self) -> None:
        super().init_device()
        # CPUWorker builds its runner inside init_device; the subclass adds behaviour, no state of
        # its own, so the runner built there becomes one (vLLM's second model runner is left as is)
        if type(self.model_runner) is CPUModelRunner:
            self.model_runner.__class__ = SeededCPUModelRunner
