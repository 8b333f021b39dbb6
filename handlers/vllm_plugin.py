"""sagelmi's vLLM plugin (entry point group ``vllm.general_plugins``): vLLM loads it
in every process it starts, engine workers included, before a model runs.

It fixes two bugs of vLLM 0.32's CPU build; GPU builds are left alone.

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
"""

from __future__ import annotations

import logging

log = logging.getLogger("sagelmi.vllm_plugin")

_PATCHED = "_sagelmi_patched"


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
        rows = np.nonzero(runner.discard_request_mask.np[:batch.num_reqs])[0]
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
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU runner's base: it inherits both

    if not getattr(lora_ops.bgmv_shrink, _PATCHED, False):
        fixed = _masking(lora_ops.bgmv_shrink)
        lora_ops.bgmv_shrink = fixed      # what sgmv_shrink (prefill) calls
        punica_cpu.bgmv_shrink = fixed    # what the CPU punica wrapper calls directly (decode, logits)
        log.debug("vLLM CPU LoRA: base-model rows of mixed batches get no adapter delta")
    if not getattr(GPUModelRunner._bookkeeping_sync, _PATCHED, False):
        _rewinding_seeded_generators(GPUModelRunner)
        log.debug("vLLM CPU: seeded generators of split prompts are rewound by their state")
