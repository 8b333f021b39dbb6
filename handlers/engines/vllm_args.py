"""Settings -> ``AsyncEngineArgs`` keyword arguments for the installed vLLM.

Option names and the kinds of their values are checked by the core's schema
(``container.core.engine_args``) when settings are resolved; here each value is
converted to the real type of the installed vLLM's engine argument.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from container.core.dtypes import vllm_dtype
from container.core.engine_arg_list import packaged_version
from container.core.engine_args import (
    RENAMED,
    SPECULATIVE,
    EngineOptionError,
    check_engine_option,
    convert_option,
    is_engine_argument,
    lmi_value,
)
from container.core.handler_choice import pooling_convert
from container.core.launch import EngineNodes
from container.core.served_names import served_names
from container.core.settings import Settings

log = logging.getLogger(__name__)


def engine_fields() -> dict[str, dataclasses.Field]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name: f for f in dataclasses.fields(AsyncEngineArgs)}


# Media items of each kind one prompt may carry when option.limit_mm_per_prompt does not name the kind
# (vLLM's default is 999 of each; LMI's guides use 1). vLLM reads the kinds the model takes and
# ignores the others, and the whole option on a text-only model. vision_chunk: the kind of models
# that count images and videos together.
MEDIA_PER_PROMPT = {"image": 1, "video": 1, "audio": 1, "vision_chunk": 1}
# On vLLM's CPU build gpu_memory_utilization is the share of CPU memory vLLM reserves;
# its 0.92 default refuses to start on a machine doing anything else.
CPU_DEFAULTS = {"gpu_memory_utilization": 0.5}


def build_engine_kwargs(
    settings: Settings, model: str, tensor_parallel_degree: int, cpu: bool = False
) -> dict[str, Any]:
    """Keyword arguments for ``AsyncEngineArgs``: ``model`` is where the model is
    (a local path or Hub id), ``tensor_parallel_degree`` the group's (what ``max``
    stands for), ``cpu`` whether vLLM runs on its CPU platform.

    Raises ``EngineOptionError`` for an unknown name or a value of the wrong type."""
    fields = engine_fields()
    kwargs: dict[str, Any] = {"model": model, **settings.engine_settings(tensor_parallel_degree)}
    speculative: dict[str, Any] = {}
    for name, raw in settings.passthrough_options().items():
        if not is_engine_argument(name):
            # LMI's names for other engines and the chat front; the settings check warned once
            log.debug("option.%s is not a vLLM engine argument: not passed to the engine", name)
            continue
        if name in SPECULATIVE:
            key, kind = SPECULATIVE[name]
            speculative[key] = convert_option(name, raw, f"speculative_config.{key}", int if kind == "int" else str)
            continue
        if name == "dtype":
            value = vllm_dtype(raw)
            kwargs["dtype"] = convert_option(name, value, "dtype", fields["dtype"].type)
            continue
        check_engine_option(name)
        target = RENAMED.get(name, name)
        if target not in fields:  # in the packaged list, but not in the vLLM that runs
            raise EngineOptionError(
                f"option.{name}: the installed vLLM has no engine argument {target} (sagelmi's list of "
                f"engine arguments is for vLLM {packaged_version()}; regenerate it: sagelmi engine-args --write)"
            )
        kwargs[target] = convert_option(name, lmi_value(name, raw), target, fields[target].type)
    if speculative:
        if "model" not in speculative:
            given = ", ".join(f"option.{n}" for n in settings.passthrough_options() if n in SPECULATIVE)
            raise EngineOptionError(f"{given} need option.speculative_draft_model (the draft model, or [ngram])")
        speculative.setdefault("num_speculative_tokens", 5)  # LMI's default speculative_length
        kwargs["speculative_config"] = {**speculative, **(kwargs.get("speculative_config") or {})}
    kwargs["limit_mm_per_prompt"] = {**MEDIA_PER_PROMPT, **(kwargs.get("limit_mm_per_prompt") or {})}
    _pooling_runner(settings, kwargs)
    if cpu:
        for name, default in CPU_DEFAULTS.items():
            if name not in kwargs:
                log.info("vLLM runs on the CPU: %s=%s (set option.%s to change)", name, default, name)
                kwargs[name] = default
    kwargs.setdefault("served_model_name", served_names(settings, model).engine)
    return kwargs


def _pooling_runner(settings: Settings, kwargs: dict[str, Any]) -> None:
    """A pooling ``option.task`` (text-embedding, classify ...) starts vLLM's pooling runner with
    the model converted as the task asks, as LMI maps its tasks; ``option.runner`` /
    ``option.convert`` given as well win, with a warning when they differ."""
    convert = pooling_convert(settings)
    if convert is None:
        return
    for name, value in (("runner", "pooling"), ("convert", convert)):
        given = kwargs.setdefault(name, value)
        if given != value:
            log.warning("option.%s=%s overrides %s from option.task=%s", name, given, value, settings.task)


def usage_context() -> Any:
    """The usage context the built-in engine's configuration is made with, on the leader
    (``AsyncLLM.from_engine_args``) and on every worker node (``vllm_node``). vLLM derives defaults
    from it (on the CPU, max_num_batched_tokens 2048 for ENGINE_CONTEXT, 4096 for
    OPENAI_API_SERVER), and nodes with other defaults warm up with collectives of other sizes (gloo:
    "Received data size doesn't match expected size")."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.ENGINE_CONTEXT


def node_kwargs(nodes: EngineNodes) -> dict[str, Any]:
    """The engine arguments of one node's part of vLLM across a cluster: its multiprocessing
    executor over ``nnodes`` nodes, this node's rank, the leader's rendezvous."""
    return {
        "distributed_executor_backend": "mp",
        "nnodes": nodes.nnodes,
        "node_rank": nodes.node_rank,
        "master_addr": nodes.master_addr,
        "master_port": nodes.master_port,
    }
