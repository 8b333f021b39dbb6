"""sagelmi's vLLM plugin (entry point group ``vllm.general_plugins``): vLLM loads it
in every process it starts, engine workers included, before a model runs.

It fixes one bug of vLLM 0.32's CPU build: the CPU LoRA kernels
(``vllm/lora/ops/torch_ops``, ``bgmv_shrink``) pick each row's adapter weights by
indexing with the row's slot, and a base-model row's slot is -1, which Python
indexing reads as the last slot. In a batch that mixes adapters and the base model,
base-model requests are then answered by an adapter. The fix zeroes the shrink
output of rows whose slot is -1, so their LoRA delta is exactly zero (the expand
step multiplies that zero). GPU builds use other kernels and are left alone.
"""

from __future__ import annotations

import logging

log = logging.getLogger("sagelmi.vllm_plugin")

_PATCHED = "_sagelmi_masks_base_rows"


def _masking(shrink):
    def bgmv_shrink(inputs, lora_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
        shrink(inputs, lora_weights, output_tensor, lora_indices_tensor, scaling)
        base_rows = lora_indices_tensor < 0
        if bool(base_rows.any()):
            output_tensor[: base_rows.shape[0]][base_rows] = 0

    setattr(bgmv_shrink, _PATCHED, True)
    return bgmv_shrink


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

    if getattr(lora_ops.bgmv_shrink, _PATCHED, False):
        return
    fixed = _masking(lora_ops.bgmv_shrink)
    lora_ops.bgmv_shrink = fixed      # what sgmv_shrink (prefill) calls
    punica_cpu.bgmv_shrink = fixed    # what the CPU punica wrapper calls directly (decode, logits)
    log.debug("vLLM CPU LoRA: base-model rows of mixed batches get no adapter delta")
