"""sagelmi plan's arithmetic: weight bytes from safetensors headers, KV-cache bytes per token
for dense, grouped-query and sliding-window models in each dtype, and what fits where."""

import json
import struct

import pytest

from container.core.plan import (GIB, ModelShape, PlanError, hardware_of, kv_bytes_per_token, make_plan, resolved_dtype,
                            safetensors_bytes, weight_bytes)

LLAMA_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
            "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}


def write_safetensors(path, tensors: dict[str, tuple[str, list[int], int]]) -> int:
    """A safetensors file of zero-filled tensors (name -> dtype, shape, element bytes); returns their bytes."""
    header, offset = {}, 0
    for name, (dtype, shape, element) in tensors.items():
        size = element
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return offset


def test_weight_bytes_are_the_tensors_bytes_exactly(tmp_path):
    expected = write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {
        "embed": ("BF16", [512, 128], 2), "norm": ("F32", [128], 4)})
    expected += write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {
        "q_proj": ("F16", [128, 128], 2), "scale": ("F8_E4M3", [128, 64], 1), "step": ("I64", [], 8)})
    tensors, on_disk = weight_bytes(tmp_path)
    assert tensors == expected == 512 * 128 * 2 + 128 * 4 + 128 * 128 * 2 + 128 * 64 + 8
    assert on_disk > tensors  # the headers
    assert safetensors_bytes(tmp_path / "model-00001-of-00002.safetensors") == 512 * 128 * 2 + 128 * 4


def test_no_safetensors_is_said(tmp_path):
    with pytest.raises(PlanError, match="no \\*.safetensors in"):
        weight_bytes(tmp_path)


@pytest.mark.parametrize("config, kv_dtype, tp, pp, expected", [
    # dense: as many KV heads as attention heads
    ({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 128}, "float32", 1, 1, 2 * 2 * 2 * 64 * 4),
    # grouped-query (Llama 3 8B): 8 KV heads of 128, bfloat16: 128 KiB a token
    (LLAMA_8B, "bfloat16", 1, 1, 2 * 32 * 8 * 128 * 2),
    (LLAMA_8B, "bfloat16", 4, 1, 2 * 32 * 2 * 128 * 2),     # tp splits the KV heads
    (LLAMA_8B, "bfloat16", 16, 1, 2 * 32 * 1 * 128 * 2),    # more ranks than KV heads: replicated, one each
    (LLAMA_8B, "bfloat16", 1, 3, 2 * 11 * 8 * 128 * 2),     # pp splits the layers (the largest stage counts)
    (LLAMA_8B, "fp8", 1, 1, 2 * 32 * 8 * 128),              # fp8 KV cache: half of bfloat16
    (LLAMA_8B, "float16", 2, 2, 2 * 16 * 4 * 128 * 2),
    # an explicit head_dim that is not hidden / heads (Gemma style)
    ({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 512,
      "head_dim": 256}, "bfloat16", 1, 1, 2 * 4 * 4 * 256 * 2),
], ids=["dense", "gqa", "gqa-tp4", "gqa-tp16", "gqa-pp3", "fp8", "fp16-tp2-pp2", "head-dim"])
def test_kv_bytes_per_token(config, kv_dtype, tp, pp, expected):
    assert kv_bytes_per_token(ModelShape.from_config(config), kv_dtype, tp, pp) == expected


def test_sliding_window_only_when_every_layer_slides():
    mistral = {**LLAMA_8B, "sliding_window": 4096}
    assert ModelShape.from_config(mistral).sliding_window == 4096
    assert ModelShape.from_config({**mistral, "use_sliding_window": False}).sliding_window is None
    gemma = {**mistral, "layer_types": ["sliding_attention", "full_attention"] * 16}
    assert ModelShape.from_config(gemma).sliding_window is None  # full layers keep every token
    # a sequence needs at most a window (and a block) of cache: more of them fit
    common = dict(weight=0, download=0, dtype=None, kv_cache_dtype=None, max_model_len=32768, gpus=None,
                  gpu_memory_gib=None, cpu_kv_cache_gib=8)
    sliding = make_plan("m", mistral, **common).splits[0]
    full = make_plan("m", LLAMA_8B, **common).splits[0]
    assert sliding.kv_tokens == full.kv_tokens == 8 * GIB // (128 * 131072) * 128
    assert sliding.max_sequences == full.kv_tokens // (4096 + 128) > full.max_sequences == full.kv_tokens // 32768


@pytest.mark.parametrize("option, config_dtype, served", [
    (None, "float32", "bfloat16"), ("auto", "float16", "float16"), (None, "bfloat16", "bfloat16"),
    ("fp16", "bfloat16", "float16"), ("float32", "bfloat16", "float32"),
])
def test_served_dtype_follows_vllm_auto(option, config_dtype, served):
    assert resolved_dtype(option, ModelShape.from_config({**LLAMA_8B, "torch_dtype": config_dtype})) == served


def test_what_does_not_fit_is_named_with_its_numbers():
    weights = 16 * 10 ** 9  # an 8B model in bfloat16
    gpus, memory, hardware = hardware_of("ml.g5.2xlarge", None, None)
    plan = make_plan("llama-8b", LLAMA_8B, weights, weights, dtype=None, kv_cache_dtype=None, max_model_len=131072,
                     gpus=gpus, gpu_memory_gib=memory, hardware=hardware)
    (only,) = plan.splits
    assert not only.fits and plan.smallest is None
    assert only.why_not.startswith("max_model_len=131072 needs 131072 KV tokens; the cache holds ")
    big = make_plan("llama-70b", {**LLAMA_8B, "num_hidden_layers": 80}, 140 * 10 ** 9, 140 * 10 ** 9, dtype=None,
                    kv_cache_dtype=None, max_model_len=8192, gpus=8, gpu_memory_gib=22, hardware="g5.48xlarge")
    one = next(s for s in big.splits if (s.tp, s.pp) == (1, 1))
    assert one.why_not.startswith("needs 130.4 GiB per GPU for weights at tp=1, pp=1")
    assert (big.smallest.tp, big.smallest.pp) == (8, 1)


def test_hardware_is_an_instance_or_both_numbers():
    assert hardware_of("ml.g5.12xlarge", None, None)[:2] == (4, 22)
    with pytest.raises(PlanError, match="unknown instance type 'ml.x9.huge'; known GPU instances: "):
        hardware_of("ml.x9.huge", None, None)
    with pytest.raises(PlanError, match="give both --gpus and --gpu-memory"):
        hardware_of(None, 2, None)


def test_vllms_kv_tokens_are_read_from_its_cache_config_metric():
    from container.supervisor.plan_check import reported_kv_tokens

    metrics = ('# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
               'vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="8192"} 1.0\n')
    assert reported_kv_tokens(metrics) == 8192 * 128
    assert reported_kv_tokens("vllm:num_requests_running 0\n") is None


def test_every_dtype_word_the_engine_options_take_is_one_plan_sizes():
    from container.core.dtypes import element_bytes, vllm_dtype
    from container.core.dtypes import LMI_DTYPES as DTYPES
    from container.core.engine_args import packaged_engine_args

    words = set(DTYPES) - {"auto"} | set(packaged_engine_args()["dtype"]) - {"auto"}
    shape = ModelShape.from_config(LLAMA_8B)
    for word in words | {w.upper() for w in words}:
        assert element_bytes(vllm_dtype(word)) in (2, 4), word
        assert kv_bytes_per_token(shape, word) == kv_bytes_per_token(shape, vllm_dtype(word).lower())
    assert kv_bytes_per_token(shape, "half") == kv_bytes_per_token(shape, "bf16") == kv_bytes_per_token(shape, "fp8") * 2
    with pytest.raises(PlanError, match="unknown KV-cache dtype 'fp4'.*fp16"):
        kv_bytes_per_token(shape, "fp4")


TINY = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 128,
        "max_position_embeddings": 1024, "torch_dtype": "bfloat16"}
GPU = dict(weight=10**9, download=10**9, dtype=None, kv_cache_dtype=None, max_model_len=None, gpus=4,
           gpu_memory_gib=22.0)


@pytest.mark.parametrize("tp, pp, gpus, why", [
    (8, 1, 4, "tp x pp = 8 needs 8 GPUs; there are 4"),
    (4, 2, 4, "tp x pp = 8 needs 8 GPUs; there are 4"),
    (8, 1, 8, "tp=8 does not divide the model's 2 attention heads"),
    (1, 8, 8, "pp=8 needs at least 8 layers; the model has 2"),
])
def test_a_split_vllm_cannot_run_does_not_fit(tp, pp, gpus, why):
    (split,) = make_plan("m", TINY, **{**GPU, "gpus": gpus}, tp=tp, pp=pp).splits
    assert not split.fits and split.why_not == why


def test_kv_heads_and_tp_must_divide_one_another():
    config = {**TINY, "num_attention_heads": 12, "num_key_value_heads": 6}
    assert make_plan("m", config, **GPU, tp=4, pp=1).splits[0].why_not == (
        "tp=4 and the model's 6 KV heads: one must divide the other")
    assert make_plan("m", config, **GPU, tp=2, pp=1).splits[0].fits
    assert make_plan("m", {**config, "num_key_value_heads": 2}, **GPU, tp=4, pp=1).splits[0].fits  # replicated


def test_every_split_of_the_gpus_is_checked():
    plan = make_plan("m", TINY, **{**GPU, "gpus": 8})
    fits = {(s.tp, s.pp): s.fits for s in plan.splits}
    assert fits[(2, 2)] and not fits[(4, 1)] and not fits[(1, 4)]


def test_sequences_are_capped_by_max_rolling_batch_size():
    uncapped = make_plan("m", TINY, **GPU, tp=1, pp=1).splits[0]
    capped = make_plan("m", TINY, **GPU, tp=1, pp=1, max_sequences=8).splits[0]
    assert uncapped.max_sequences > 8 and capped.max_sequences == 8


def test_no_bfloat16_before_ampere():
    t4 = dict(GPU, gpus=1, gpu_memory_gib=15.0, gpu="T4")
    assert make_plan("m", TINY, **t4).dtype == "float16"  # auto: what the GPU supports
    asked = make_plan("m", TINY, **{**t4, "dtype": "bfloat16"})
    assert not asked.splits[0].fits and "use option.dtype=float16" in asked.splits[0].why_not
    assert make_plan("m", TINY, **dict(t4, gpu="A10G")).dtype == "bfloat16"


def test_the_cpu_plan_needs_no_variable():
    common = dict(weight=2 * GIB, download=2 * GIB, dtype=None, kv_cache_dtype=None, max_model_len=None, gpus=None,
                  gpu_memory_gib=None, gpu_memory_utilization=0.5)
    (split,) = make_plan("m", TINY, **common, host_memory_gib=24.0).splits
    assert split.fits and split.kv_budget_gib == pytest.approx(0.5 * 24 - 2)
    (starved,) = make_plan("m", TINY, **common, host_memory_gib=3.0).splits
    assert not starved.fits and "is less than the 2.0 GiB of weights" in starved.why_not
    (none,) = make_plan("m", TINY, **common, cpu_kv_cache_gib=0).splits
    assert not none.fits and none.why_not == "VLLM_CPU_KVCACHE_SPACE=0 leaves no KV cache"
