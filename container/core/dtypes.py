"""Dtype words, one table: LMI's (``fp16`` ...), vLLM's (``float16``, ``half`` ...),
``config.json``'s (``torch_dtype``) and the KV cache's (``fp8`` ...), with the bytes
an element of each takes. The engine options (``engine_args``) translate
``option.dtype`` with it, and ``sagelmi plan`` sizes weights and KV cache with it,
so a word one of them knows the other knows too."""

from __future__ import annotations

# LMI's dtype words -> vLLM's; any other word goes to vLLM as written
LMI_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "auto": "auto"}
# vLLM's other names of the same types
ALIASES = {"half": "float16", "float": "float32"}
# bytes per element, by the one name of each type
ELEMENT_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "int8": 1,
}
# bytes per element, by the dtype names of safetensors headers
SAFETENSORS_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


def vllm_dtype(word: str) -> str:
    """``option.dtype`` as vLLM's ``dtype`` argument: LMI's words translated (any case),
    other words as written (vLLM checks them)."""
    return LMI_DTYPES.get(word.lower(), word)


def canonical_dtype(word: str) -> str:
    """The one name of the type any of the words means (``fp16``, ``half``, ``FLOAT16`` -> ``float16``)."""
    word = vllm_dtype(word).lower()
    return ALIASES.get(word, word)


def element_bytes(word: str) -> int | None:
    """Bytes one element of the type takes; None for a word the table does not know."""
    return ELEMENT_BYTES.get(canonical_dtype(word))


def known_words() -> list[str]:
    """Every word ``element_bytes`` knows, for messages."""
    return sorted(set(ELEMENT_BYTES) | set(ALIASES) | set(LMI_DTYPES) - {"auto"})
