"""``python -m container.tools.tiny_adapter BASE DIR --seed N``: write a LoRA adapter for a
model (the tiny model of ``sagelmi tiny-model`` in tests) with ``peft`` (the test extra's),
without any training or download. Test tooling, not a ``sagelmi`` command.

The adapter is rank 8 on ``q_proj`` and ``v_proj``. peft starts LoRA's B
matrices at zero (an adapter that changes nothing); here every LoRA matrix is
random from ``seed`` and large enough to change greedy answers, and two seeds
give two adapters that answer differently.
"""

from __future__ import annotations

from pathlib import Path

RANK = 8
TARGETS = ["q_proj", "v_proj"]
SCALE = 0.5  # of the random LoRA weights: large enough to move the tiny model's greedy tokens


def write_tiny_adapter(base: str | Path, directory: str | Path, seed: int = 0, rank: int = RANK) -> Path:
    """Write a random LoRA adapter for ``base`` into ``directory`` (``adapter_config.json``
    and ``adapter_model.safetensors``, as ``save_pretrained`` writes them)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * SCALE)
    out = Path(directory)
    peft_model.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m container.tools.tiny_adapter",
        description="write a random LoRA adapter (peft) for a model directory",
    )
    parser.add_argument("base", help="the base model's directory (e.g. from sagelmi tiny-model)")
    parser.add_argument("directory", help="where to write the adapter")
    parser.add_argument("--seed", type=int, default=0, help="random seed: another seed, another adapter")
    parser.add_argument("--rank", type=int, default=RANK, help=f"LoRA rank (default {RANK})")
    args = parser.parse_args(argv)
    print(write_tiny_adapter(args.base, args.directory, args.seed, args.rank))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
