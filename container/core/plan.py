"""``sagelmi plan``: will this model fit, how, and with how much KV cache.

From the model's ``config.json`` and its safetensors headers (exact weight bytes;
no weights are read) and the settings (the same schema ``serve`` uses):

- KV-cache bytes per token on one rank: 2 (K and V) x layers on the rank's
  pipeline stage x KV heads on the rank (``kv_heads / tp``, at least 1: vLLM
  replicates KV heads when tp is larger) x head size x the KV dtype's bytes;
- the KV-cache budget per rank: on a GPU, ``gpu_memory_utilization`` x its memory,
  less the rank's weights and an activation reserve (vLLM measures the real one at
  start-up: this is an estimate); on vLLM's CPU build, ``VLLM_CPU_KVCACHE_SPACE``;
- tokens the cache holds (whole blocks), and so the largest ``max_model_len`` and the
  number of full-length sequences (``max_rolling_batch_size``) that fit.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from container.core.artifacts import HUB_ID
from container.core.dtypes import SAFETENSORS_BYTES, canonical_dtype, element_bytes, known_words, vllm_dtype
from container.core.instances import INSTANCES

GIB = 2**30
BLOCK_SIZE = {"gpu": 16, "cpu": 128}  # vLLM's default KV block sizes
ACTIVATION_RESERVE_GIB = 2.0  # activations, CUDA graphs, NCCL buffers: an estimate, vLLM measures it


class PlanError(ValueError):
    """The model or the hardware cannot be read; the message says which."""


@dataclass(frozen=True)
class ModelShape:
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    max_position: int | None
    sliding_window: int | None  # every layer's window, when the model uses one on all layers
    config_dtype: str

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        text = {**config, **config.get("text_config", {})}  # multimodal models nest the language model's
        try:
            heads = int(text["num_attention_heads"])
            layers = int(text["num_hidden_layers"])
            head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        except KeyError as exc:
            raise PlanError(f"config.json has no {exc.args[0]}: not a decoder model plan knows") from None
        window = text.get("sliding_window") if text.get("use_sliding_window", True) else None
        if window and "layer_types" in text and any(t != "sliding_attention" for t in text["layer_types"]):
            window = None  # some layers attend to everything: they need every token
        return cls(
            layers,
            heads,
            int(text.get("num_key_value_heads") or heads),
            head_dim,
            text.get("max_position_embeddings"),
            int(window) if window else None,
            str(text.get("torch_dtype") or text.get("dtype") or "float32"),
        )


def resolved_dtype(option: str | None, shape: ModelShape) -> str:
    """vLLM's ``dtype=auto``: the config's, except float32, which is served in bfloat16."""
    dtype = vllm_dtype(option or "auto").lower()
    if dtype == "auto":
        return "bfloat16" if canonical_dtype(shape.config_dtype) == "float32" else shape.config_dtype
    return dtype


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str, tp: int = 1, pp: int = 1) -> int:
    """KV-cache bytes one token takes on one rank of a ``tp`` x ``pp`` split."""
    element = element_bytes(kv_dtype)
    if element is None:
        raise PlanError(f"unknown KV-cache dtype {kv_dtype!r} (known: {', '.join(known_words())})")
    return 2 * math.ceil(shape.layers / pp) * max(1, shape.kv_heads // tp) * shape.head_dim * element


def safetensors_bytes(path: Path) -> int:
    """The bytes of a safetensors file's tensors, from its header alone."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(t["data_offsets"][1] - t["data_offsets"][0] for name, t in header.items() if name != "__metadata__")


def weight_bytes(model_dir: Path) -> tuple[int, int]:
    """(tensor bytes, bytes on disk) of a directory's safetensors files."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise PlanError(f"no *.safetensors in {model_dir}: plan reads weight sizes from safetensors headers")
    return sum(safetensors_bytes(f) for f in files), sum(f.stat().st_size for f in files)


def hub_weight_bytes(repo_id: str, revision: str | None = None, token: str | bool | None = None) -> int:
    """A Hub model's tensor bytes, from its safetensors headers (HTTP range reads);
    ``token`` as huggingface_hub takes it (None: the environment's or the login's)."""
    from huggingface_hub import HfApi

    metadata = HfApi(token=token).get_safetensors_metadata(repo_id, revision=revision)
    return sum(
        t.parameter_count[dtype] * SAFETENSORS_BYTES.get(dtype, 2)
        for t in metadata.files_metadata.values()
        for dtype in t.parameter_count
    )


@dataclass
class Split:
    tp: int
    pp: int
    weights_gib_per_rank: float
    kv_bytes_per_token: int
    kv_budget_gib: float
    kv_tokens: int
    max_model_len: int
    max_sequences: int  # sequences of max_model_len tokens the cache holds at once
    fits: bool
    why_not: str = ""


@dataclass
class Plan:
    model: str
    shape: ModelShape
    dtype: str
    kv_dtype: str
    weight_bytes: int
    download_bytes: int
    hardware: str
    gpus: int | None = None  # None: vLLM's CPU build
    splits: list[Split] = field(default_factory=list)
    startup_timeout_s: int = 0
    download_timeout_s: int = 0

    @property
    def smallest(self) -> Split | None:
        fitting = [s for s in self.splits if s.fits]
        return min(fitting, key=lambda s: (s.tp * s.pp, s.pp)) if fitting else None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["smallest_fitting_split"] = asdict(self.smallest) if self.smallest else None
        return out


# GPUs without bfloat16 (compute capability below 8.0), with theirs
PRE_AMPERE = {"T4": "Turing, compute capability 7.5", "V100": "Volta, 7.0", "V100-32GB": "Volta, 7.0"}


def _split_problem(shape: ModelShape, tp: int, pp: int, gpus: int | None) -> str:
    """Why vLLM cannot split the model ``tp`` x ``pp`` ways on ``gpus`` GPUs ("" if it can)."""
    if gpus is not None and tp * pp > gpus:
        return f"tp x pp = {tp * pp} needs {tp * pp} GPUs; there are {gpus}"
    if shape.attention_heads % tp:
        return f"tp={tp} does not divide the model's {shape.attention_heads} attention heads"
    kv = shape.kv_heads
    if (tp >= kv and tp % kv) or (tp < kv and kv % tp):
        return f"tp={tp} and the model's {kv} KV heads: one must divide the other"
    if pp > shape.layers:
        return f"pp={pp} needs at least {pp} layers; the model has {shape.layers}"
    return ""


def _splits(gpus: int) -> list[tuple[int, int]]:
    sizes = [n for n in (1, 2, 4, 8, 16) if n <= gpus]
    return [(tp, pp) for tp in sizes for pp in sizes if tp * pp <= gpus]


def make_plan(
    model: str,
    config: dict[str, Any],
    weight: int,
    download: int,
    *,
    dtype: str | None,
    kv_cache_dtype: str | None,
    max_model_len: int | None,
    gpus: int | None,
    gpu_memory_gib: float | None,
    gpu_memory_utilization: float = 0.9,
    cpu_kv_cache_gib: float | None = None,
    tp: int | None = None,
    pp: int | None = None,
    hardware: str = "",
    gpu: str | None = None,
    max_sequences: int | None = None,
    host_memory_gib: float | None = None,
) -> Plan:
    """The plan for ``model`` on ``gpus`` x ``gpu_memory_gib`` of the ``gpu`` kind (None: vLLM's
    CPU build with ``cpu_kv_cache_gib``, or without it ``gpu_memory_utilization`` of
    ``host_memory_gib``); every split up to the GPU count, or the ``tp`` x ``pp`` asked for.
    ``max_sequences`` (``max_rolling_batch_size``) caps the sequences a split serves at once."""
    from container.core.sizing import download_timeout, startup_timeout

    shape = ModelShape.from_config(config)
    served = resolved_dtype(dtype, shape)
    dtype_problem = ""
    if gpu in PRE_AMPERE and served == "bfloat16":
        if not dtype or dtype == "auto":
            served = "float16"  # vLLM's auto picks what the GPU supports
        else:
            dtype_problem = (
                f"option.dtype=bfloat16 needs an Ampere or newer GPU (compute capability 8.0); the {gpu} is "
                f"{PRE_AMPERE[gpu]}: use option.dtype=float16"
            )
    kv_dtype = served if not kv_cache_dtype or kv_cache_dtype == "auto" else kv_cache_dtype.lower()
    wanted = max_model_len or shape.max_position or 4096
    plan = Plan(
        model,
        shape,
        served,
        kv_dtype,
        weight,
        download,
        hardware,
        gpus,
        startup_timeout_s=startup_timeout(download / 1e9),
        download_timeout_s=download_timeout(download / 1e9),
    )
    choices = [(tp or 1, pp or 1)] if gpus is None or tp or pp else _splits(gpus)
    # weights as served: a float32 checkpoint served in bfloat16 takes half its file size
    served_weights = weight * (element_bytes(served) or 2) / (element_bytes(shape.config_dtype) or 2)
    for t, p in choices:
        per_rank = served_weights / (t * p)
        per_token = kv_bytes_per_token(shape, kv_dtype, t, p)
        if gpus is None:
            if cpu_kv_cache_gib is not None:
                budget = cpu_kv_cache_gib * GIB
            elif host_memory_gib is not None:  # vLLM's CPU build: utilization x the node's memory, less what it holds
                budget = gpu_memory_utilization * host_memory_gib * GIB - per_rank
            else:
                raise PlanError(
                    "on the CPU build the KV cache is VLLM_CPU_KVCACHE_SPACE GiB, or gpu_memory_utilization of "
                    "the machine's memory: set one, or give --instance / --gpus and --gpu-memory"
                )
            block = BLOCK_SIZE["cpu"]
        else:
            assert gpu_memory_gib is not None, "GPUs without their memory"  # hardware_of and plan_check give both
            budget = gpu_memory_gib * GIB * gpu_memory_utilization - per_rank - ACTIVATION_RESERVE_GIB * GIB
            block = BLOCK_SIZE["gpu"]
        tokens = max(0, int(budget // (per_token * block)) * block)
        longest = min(tokens, shape.max_position or tokens)
        need = min(wanted, shape.sliding_window + block) if shape.sliding_window else wanted
        why = _split_problem(shape, t, p, gpus) or dtype_problem
        if not why:  # a split that cannot run at all is not judged by its memory
            if budget <= 0 and gpu_memory_gib is None:
                why = (
                    f"VLLM_CPU_KVCACHE_SPACE={cpu_kv_cache_gib:g} leaves no KV cache"
                    if cpu_kv_cache_gib is not None
                    else f"gpu_memory_utilization={gpu_memory_utilization:g} of {host_memory_gib:g} GiB "
                    f"is less than the {per_rank / GIB:.1f} GiB of weights"
                )
            elif budget <= 0 and gpu_memory_gib is not None:
                why = (
                    f"needs {per_rank / GIB:.1f} GiB per GPU for weights at tp={t}, pp={p}, plus "
                    f"{ACTIVATION_RESERVE_GIB:.0f} GiB for activations; {gpu_memory_utilization:g} x "
                    f"{gpu_memory_gib:g} GiB is {gpu_memory_utilization * gpu_memory_gib:.1f} GiB"
                )
            elif tokens < wanted:
                why = (
                    f"max_model_len={wanted} needs {wanted} KV tokens; the cache holds {tokens} "
                    f"({budget / GIB:.2f} GiB / {per_token} bytes a token)"
                )
        plan.splits.append(
            Split(
                t,
                p,
                round(per_rank / GIB, 3),
                per_token,
                round(budget / GIB, 3),
                tokens,
                longest,
                min(tokens // need if need else 0, max_sequences or tokens),
                not why,
                why,
            )
        )
    return plan


def plan_from_settings(
    model: tuple[str, dict[str, Any], int, int],
    options: dict[str, str],
    *,
    gpus: int | None,
    gpu_memory_gib: float | None,
    tp: int | None,
    pp: int | None,
    hardware: str,
    cpu_kv_cache_gib: float | None = None,
    default_utilization: float = 0.9,
    gpu: str | None = None,
    host_memory_gib: float | None = None,
) -> Plan:
    """``make_plan`` for ``read_model``'s answer with the engine options as the
    settings hold them (``option.dtype``, ``kv_cache_dtype``, ``max_model_len``,
    ``gpu_memory_utilization``): what ``sagelmi plan``, ``serve`` and the SDK ask."""
    name, config, weight, download = model
    return make_plan(
        name,
        config,
        weight,
        download,
        dtype=options.get("dtype"),
        kv_cache_dtype=options.get("kv_cache_dtype"),
        max_model_len=int(options["max_model_len"]) if "max_model_len" in options else None,
        gpus=gpus,
        gpu_memory_gib=gpu_memory_gib,
        tp=tp,
        pp=pp,
        gpu_memory_utilization=float(options.get("gpu_memory_utilization", default_utilization)),
        cpu_kv_cache_gib=cpu_kv_cache_gib,
        hardware=hardware,
        gpu=gpu,
        max_sequences=int(options.get("max_rolling_batch_size") or options.get("max_num_seqs") or 256),
        host_memory_gib=host_memory_gib,
    )


def read_model(
    model_dir: Path | None, model_id: str | None, revision: str | None = None, token: str | bool | None = None
) -> tuple[str, dict[str, Any], int, int]:
    """(name, config, tensor bytes, download bytes) of a local directory or a Hub id
    (only ``config.json`` and the safetensors headers are fetched, with ``token``:
    a gated or private model needs one). A ``model_id`` that is a local directory is read
    there, as ``serve`` uses it. The Hub's errors are huggingface_hub's
    (``container.core.hub_download.hub_error`` words them)."""
    local = local_model_dir(model_dir, model_id)
    if local is not None:
        weight, disk = weight_bytes(local)
        return str(model_id or local.name), json.loads((local / "config.json").read_text()), weight, disk
    if model_id and not Path(model_id).exists() and not model_id.startswith(("/", ".", "~", "s3://")):
        if not HUB_ID.match(model_id):
            raise PlanError(f"{model_id!r} is neither a local directory nor a Hub model id (org/name)")
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import NotASafetensorsRepoError

        # As serve's download: the Hub's listing first, then the cache; an unreachable Hub fails
        # at once (hf_hub_download retries a file's HEAD for about 20 s before it gives up).
        snapshot = snapshot_download(model_id, revision=revision, allow_patterns=["config.json"], token=token)
        if not (Path(snapshot) / "config.json").is_file():
            raise PlanError(f"Hub model {model_id!r} has no config.json: plan reads the model's shape from it")
        config = json.loads((Path(snapshot) / "config.json").read_text())
        try:
            weight = hub_weight_bytes(model_id, revision, token)
        except NotASafetensorsRepoError:
            raise PlanError(
                f"Hub model {model_id!r} has no safetensors weights: plan reads weight sizes from safetensors headers"
            ) from None
        return model_id, config, weight, weight
    raise PlanError(f"no config.json in {model_dir or model_id}: give --model-dir with the model or --model-id")


def local_model_dir(model_dir: Path | None, model_id: str | None) -> Path | None:
    """The local directory ``read_model`` reads: ``model_dir``, else ``model_id`` naming a
    directory, whichever has a ``config.json``; None when neither has (a Hub id)."""
    for directory in (model_dir, Path(model_id) if model_id else None):
        if directory is not None and (directory / "config.json").is_file():
            return directory
    return None


def hardware_of(
    instance: str | None, gpus: int | None, gpu_memory: float | None
) -> tuple[int | None, float | None, str]:
    if instance:
        if instance not in INSTANCES:
            raise PlanError(f"unknown instance type {instance!r}; known GPU instances: {', '.join(sorted(INSTANCES))}")
        spec = INSTANCES[instance]
        return spec.gpus, spec.gpu_memory_gib, f"{instance} ({spec.gpus} x {spec.gpu} {spec.gpu_memory_gib:g} GiB)"
    if gpus is not None and gpu_memory is not None:
        return gpus, gpu_memory, f"{gpus} GPU(s) x {gpu_memory:g} GiB"
    if gpus is not None or gpu_memory is not None:
        raise PlanError("give both --gpus and --gpu-memory (or --instance)")
    return None, None, "vLLM's CPU build"


def gpu_kind(instance: str | None) -> str | None:
    """The GPU of a SageMaker instance type (None if unknown or not given)."""
    spec = INSTANCES.get(instance or "")
    return spec.gpu if spec else None


def host_memory_gib() -> float:
    """This machine's memory, for the CPU build's plan without ``VLLM_CPU_KVCACHE_SPACE``."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def render(plan: Plan) -> str:
    s = plan.shape
    lines = [
        f"model {plan.model}: {s.layers} layers, {s.attention_heads} attention heads, {s.kv_heads} KV heads, "
        f"head size {s.head_dim}" + (f", sliding window {s.sliding_window}" if s.sliding_window else ""),
        f"weights {plan.weight_bytes / GIB:.3f} GiB as stored ({s.config_dtype}), served in {plan.dtype}; "
        f"KV cache in {plan.kv_dtype}; download {plan.download_bytes / 1e9:.3f} GB",
        f"on {plan.hardware}",
        "",
        f"{'tp':>3} {'pp':>3} {'weights/rank':>13} {'KV bytes/token':>15} {'KV GiB':>8} {'KV tokens':>11} "
        f"{'max_model_len':>14} {'sequences':>10}  fits",
    ]
    for sp in plan.splits:
        lines.append(
            f"{sp.tp:>3} {sp.pp:>3} {sp.weights_gib_per_rank:>10.3f} GiB {sp.kv_bytes_per_token:>15} "
            f"{sp.kv_budget_gib:>8.2f} {sp.kv_tokens:>11} {sp.max_model_len:>14} {sp.max_sequences:>10}  "
            + ("yes" if sp.fits else f"no: {sp.why_not}")
        )
    best = plan.smallest
    lines += [
        "",
        f"smallest split that fits: tp={best.tp} pp={best.pp}" if best else "no split fits",
        f"suggested SageMaker timeouts: container_startup_health_check_timeout={plan.startup_timeout_s}, "
        f"model_data_download_timeout={plan.download_timeout_s}",
    ]
    return "\n".join(lines)
