"""LoRA adapters on the vLLM engine (``option.enable_lora=true``): loading, unloading and
finding the adapter a request names.

vLLM's ``OpenAIServingModels`` holds the table, so that ``/v1/models`` and an OpenAI body's
``model`` know the adapters too.
"""

from __future__ import annotations

import itertools
from typing import Any

from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.lora.request import LoRARequest

from container.core.errors import InputError, NotFound

ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"


class Adapters:
    def __init__(self, engine: Any, models: OpenAIServingModels, names: tuple[str, str], lora: bool) -> None:
        self.engine = engine
        self.models = models
        self.served_name, self.management_name = names  # container.core.served_names
        self.lora = lora  # option.enable_lora
        self._lora_ids = itertools.count(1)

    @property
    def table(self) -> dict[str, LoRARequest]:
        return self.models.lora_requests

    async def add(self, name: str, path: str) -> None:
        """Serve the adapter in ``path`` as ``name`` (loaded now, so a bad one is refused
        now). Raises ``InputError`` when LoRA is off or the engine refuses the adapter."""
        if not self.lora:
            raise InputError(
                "LoRA adapters need option.enable_lora=true (with option.max_lora_rank at least the adapters' rank)"
            )
        known = self.table.get(name)
        if known is not None and known.lora_path == path:
            return  # the same registration again (a replay): nothing to do
        request = LoRARequest(lora_name=name, lora_int_id=next(self._lora_ids), lora_path=path)
        self.table[name] = request  # before the first await: see container.worker.adapters
        try:
            await self.engine.add_lora(request)
        except Exception as exc:
            if self.table.get(name) is request:
                if known is None:
                    del self.table[name]
                else:
                    self.table[name] = known
            raise InputError(f"the engine cannot load adapter {name!r}: {exc}") from None
        if known is not None:
            await self.engine.remove_lora(known.lora_int_id)

    async def remove(self, name: str) -> None:
        request = self.table.pop(name, None)
        if request is not None:
            await self.engine.remove_lora(request.lora_int_id)

    def named(self, name: Any) -> LoRARequest | None:
        """The adapter ``name`` names (None for no name or the base model's); ``NotFound`` if unknown."""
        if name is None or name == "" or name in (self.served_name, self.management_name):
            return None  # the base model, by its served name or the name GET /models shows
        if not isinstance(name, str):
            raise InputError(f"an adapter is named by a string, not {name!r}")
        request = self.table.get(name)
        if request is None:
            known = ", ".join(sorted(self.table)) or "none"
            raise NotFound(f"adapter {name!r} is not registered (registered adapters: {known})")
        return request

    def for_openai(self, model: Any, header: str | None) -> str:
        """The ``model`` vLLM serves an OpenAI request with: the header's adapter, else the
        body's adapter, else the base model. The header replaces ``model``, as AWS's vLLM
        container does (its ``inject_adapter_id``): the OpenAI clients always send a ``model``.
        Without LoRA, whatever name the client sends is the one model; with LoRA, an unknown
        name is a 404."""
        if header:
            model = header
        if not self.lora:
            return self.served_name
        adapter = self.named(model)
        return adapter.lora_name if adapter is not None else self.served_name

    def for_lmi(self, body: dict, header: str | None, prompts: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt: LMI's ``adapters`` field (a name, or a list
        as long as a list of inputs), or the SageMaker header. Both given and naming
        different adapters: ``InputError`` (a request that asks for two adapters is not
        answered with either)."""
        names = body.get("adapters")
        if names is None:
            names = header
        elif header:
            other = next((n for n in (names if isinstance(names, list) else [names]) if n != header), header)
            if other != header:
                named = "null (the base model)" if other is None else repr(other)
                raise InputError(
                    f"the {ADAPTER_HEADER} header names adapter {header!r} and the body's 'adapters' {named}: "
                    "name the adapter in one of them (or the same one in both)"
                )
        if isinstance(names, list):
            if len(names) != prompts:
                raise InputError(f"'adapters' has {len(names)} names for {prompts} inputs; give one per input")
            return [self.named(n) for n in names]
        return [self.named(names)] * prompts
