"""``sagelmi plan``: the command line of ``container.core.plan``.

    sagelmi plan [--model-dir DIR | --model-id ID] [--instance TYPE | --gpus N --gpu-memory GIB]
                 [--json] [NAME=VALUE ...]

``NAME=VALUE`` are settings as the container reads them (``OPTION_MAX_MODEL_LEN=8192``,
``TENSOR_PARALLEL_DEGREE=2``, ``VLLM_CPU_KVCACHE_SPACE=4`` ...), on top of this
environment and the model directory's ``serving.properties``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from container.core.devices import resolve_tensor_parallel
from container.core.hub_download import hub_error, hub_failures
from container.core.plan import (
    PlanError,
    gpu_kind,
    hardware_of,
    host_memory_gib,
    local_model_dir,
    plan_from_settings,
    read_model,
    render,
)
from container.core.settings import resolve_settings


def add_parser(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="size a deployment: weights and KV cache per GPU for each tensor/pipeline "
        "split, what fits, suggested SageMaker timeouts",
    )
    plan.add_argument("--model-dir", type=Path, help="a local model (config.json, *.safetensors)")
    plan.add_argument("--model-id", help="a Hub id (only config.json and the safetensors headers are read)")
    plan.add_argument("--instance", help="a SageMaker instance type, e.g. ml.g5.12xlarge")
    plan.add_argument("--gpus", type=int, help="GPUs (with --gpu-memory), instead of --instance")
    plan.add_argument("--gpu-memory", type=float, help="memory per GPU in GiB")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.add_argument("settings", nargs="*", metavar="NAME=VALUE", help="settings as environment variables")


def run(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    for item in args.settings:
        name, sep, value = item.partition("=")
        if not sep:
            raise PlanError(f"{item!r} is not NAME=VALUE")
        env[name] = value
    if args.model_id:
        env["OPTION_MODEL_ID"] = args.model_id
    with tempfile.TemporaryDirectory() as empty:
        settings = resolve_settings(env, args.model_dir or empty)
    gpus, memory, hardware = hardware_of(args.instance, args.gpus, args.gpu_memory)
    if gpus is None and not env.get("VLLM_CPU_KVCACHE_SPACE"):
        hardware += (
            f" ({host_memory_gib():.0f} GiB of memory; the KV cache: gpu_memory_utilization of it, less the weights)"
        )
    try:
        model = read_model(args.model_dir, settings.model_id, settings.revision)
    except hub_failures() as exc:
        if local_model_dir(args.model_dir, settings.model_id) is not None:
            raise
        raise hub_error(settings.model_id or "", settings.revision, exc) from None
    given = {key for key, source in settings.sources.items() if source != "default"}
    tp = settings.tensor_parallel_degree if "option.tensor_parallel_degree" in given else None
    pp = settings.pipeline_parallel_degree if "option.pipeline_parallel_degree" in given else None
    plan = plan_from_settings(
        model,
        settings.options,
        gpus=gpus,
        gpu_memory_gib=memory,
        tp=None if tp is None else resolve_tensor_parallel(settings, gpus or 0),
        pp=pp,
        hardware=hardware,
        cpu_kv_cache_gib=float(env["VLLM_CPU_KVCACHE_SPACE"]) if env.get("VLLM_CPU_KVCACHE_SPACE") else None,
        gpu=gpu_kind(args.instance),
        host_memory_gib=host_memory_gib() if gpus is None else None,
    )
    print(json.dumps(plan.as_dict(), indent=2) if args.json else render(plan))
    return 0 if plan.smallest else 1
