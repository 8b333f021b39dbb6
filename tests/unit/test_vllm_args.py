import json

import pytest

from container.core.settings import resolve_settings
from container.core.engine_args import EngineOptionError, check_engine_option
from container.core.logs import redacted_json
from handlers.engines.vllm_args import build_engine_kwargs


def build(cpu=False, tp=1, model="/opt/ml/model", **options):
    settings = resolve_settings({f"OPTION_{k.upper()}": str(v) for k, v in options.items()}, "/nonexistent")
    return build_engine_kwargs(settings, model, tp, cpu=cpu)


def test_lmi_names_are_translated_and_typed():
    kwargs = build(model="org/model", tp=2, model_id="org/model", tensor_parallel_degree=2,
                   pipeline_parallel_degree=2, max_rolling_batch_size=32,
                   max_rolling_batch_prefill_tokens=4096, quantize="awq", cpu_offload_gb_per_gpu=4,
                   dtype="fp16", enforce_eager="true", max_model_len=2048, enable_prefix_caching="false",
                   max_lora_rank=32, revision="main")
    assert kwargs == {"model": "org/model", "served_model_name": "org/model", "tensor_parallel_size": 2,
                      "pipeline_parallel_size": 2, "max_num_seqs": 32, "max_num_batched_tokens": 4096,
                      "quantization": "awq", "trust_remote_code": False,
                      "cpu_offload_gb": 4.0, "dtype": "float16", "enforce_eager": True, "max_model_len": 2048,
                      "enable_prefix_caching": False, "max_lora_rank": 32, "revision": "main",
                      "limit_mm_per_prompt": {"image": 1, "video": 1, "audio": 1, "vision_chunk": 1}}


def test_defaults_model_location_and_lmi_batch_size():
    kwargs = build()
    assert kwargs["model"] == "/opt/ml/model" and kwargs["max_num_seqs"] == 256
    assert kwargs["tensor_parallel_size"] == 1 and kwargs["pipeline_parallel_size"] == 1


def test_tensor_parallel_max_becomes_the_groups_number():
    assert build(tp=4, tensor_parallel_degree="max")["tensor_parallel_size"] == 4


def test_cpu_default_memory_share_unless_set():
    assert build(cpu=True)["gpu_memory_utilization"] == 0.5
    assert build(cpu=True, gpu_memory_utilization=0.3)["gpu_memory_utilization"] == 0.3
    assert "gpu_memory_utilization" not in build()


def test_other_vllm_arguments_pass_through():
    kwargs = build(enable_chunked_prefill="true", seed=7, hf_overrides='{"rope_theta": 10000}')
    assert kwargs["enable_chunked_prefill"] is True and kwargs["seed"] == 7
    assert kwargs["hf_overrides"] == {"rope_theta": 10000}


@pytest.mark.parametrize("raw, limits", [("image=2", {"image": 2}), ("image=16, video=2", {"image": 16, "video": 2}),
                                         ('{"image": 3}', {"image": 3})])
def test_media_limits_take_lmis_form_and_json(raw, limits):
    """LMI documents option.limit_mm_per_prompt as image=16,video=2; vLLM 0.32 parses JSON only."""
    assert build(limit_mm_per_prompt=raw)["limit_mm_per_prompt"] == {**ONE_OF_EACH, **limits}
    check_engine_option("limit_mm_per_prompt", raw)


ONE_OF_EACH = {"image": 1, "video": 1, "audio": 1, "vision_chunk": 1}


def test_media_per_prompt_is_one_of_each_kind_by_default():
    """vLLM allows 999 images (videos, audio clips) in one prompt; LMI's guides use 1."""
    assert build()["limit_mm_per_prompt"] == ONE_OF_EACH
    given = build(limit_mm_per_prompt='{"image": {"count": 4, "width": 512, "height": 512}, "video": 0}')
    assert given["limit_mm_per_prompt"] == {**ONE_OF_EACH, "image": {"count": 4, "width": 512, "height": 512},
                                            "video": 0}


@pytest.mark.parametrize("raw", ["image", "image=two", "image=2,=1", "image=-1"])
def test_media_limits_that_are_neither_form_are_refused(raw):
    for check in (lambda: build(limit_mm_per_prompt=raw), lambda: check_engine_option("limit_mm_per_prompt", raw)):
        with pytest.raises(EngineOptionError, match="or LMI's form image=2,video=1"):
            check()


def test_speculative_options_fold_into_speculative_config():
    kwargs = build(speculative_draft_model="org/draft", speculative_length=4, draft_model_tp_size=1)
    assert kwargs["speculative_config"] == {"model": "org/draft", "num_speculative_tokens": 4,
                                            "draft_tensor_parallel_size": 1}
    with pytest.raises(EngineOptionError, match="need option.speculative_draft_model"):
        build(speculative_length=4)


def test_lmi_older_speculative_names_fold_into_speculative_config():
    kwargs = build(speculative_model="org/draft", num_speculative_tokens=3, speculative_model_quantization="fp8",
                   speculative_draft_tensor_parallel_size=1, speculative_max_model_len=2048)
    assert kwargs["speculative_config"] == {"model": "org/draft", "num_speculative_tokens": 3, "quantization": "fp8",
                                            "draft_tensor_parallel_size": 1, "max_model_len": 2048}
    kwargs = build(speculative_model="[ngram]", ngram_prompt_lookup_max=4, ngram_prompt_lookup_min=1)
    assert kwargs["speculative_config"] == {"model": "[ngram]", "prompt_lookup_max": 4, "prompt_lookup_min": 1,
                                            "num_speculative_tokens": 5}
    kwargs = build(draft_model_id="org/draft", spec_length=2)  # LMI's Properties spelling
    assert kwargs["speculative_config"] == {"model": "org/draft", "num_speculative_tokens": 2}
    with pytest.raises(EngineOptionError, match="option.ngram_prompt_lookup_max need option.speculative_draft_model"):
        build(ngram_prompt_lookup_max=4)


def test_lmi_names_vllm_does_not_take_are_skipped_without_a_second_warning(caplog):
    """The settings check warned once (tests/unit/test_lmi_options.py); the worker says nothing more."""
    with caplog.at_level("INFO"):
        kwargs = build(async_mode="false", max_input_len=1024, enable_stateful_sessions="true", device_map="auto",
                       enable_auto_tool_choice="true", tool_call_parser="hermes", chat_template="t.jinja",
                       chat_template_content_format="openai", enable_reasoning="true", tool_parser_plugin="p.py",
                       reasoning_parser="deepseek_r1", lmcache_config_file="lmcache.yaml", mapLocation="cpu")
    assert not [r for r in caplog.records if r.levelno >= 30]
    assert kwargs["reasoning_parser"] == "deepseek_r1"  # a vLLM engine argument too
    assert not {"async_mode", "max_input_len", "enable_stateful_sessions", "device_map", "enable_auto_tool_choice",
                "tool_call_parser", "chat_template", "chat_template_content_format", "enable_reasoning",
                "tool_parser_plugin", "lmcache_config_file", "maplocation", "mapLocation"} & set(kwargs)


def test_server_options_and_obsolete_ones_are_not_engine_arguments():
    kwargs = build(entryPoint="x", rolling_batch="vllm", output_formatter="sse", lora_extra_vocab_size=256,
                   predict_timeout=5, tgi_compat="true", mpi_extra_args="--oversubscribe", enable_streaming="true")
    assert not {"entryPoint", "entry_point", "rolling_batch", "output_formatter", "lora_extra_vocab_size",
                "predict_timeout", "tgi_compat", "mpi_extra_args", "enable_streaming"} & set(kwargs)


def test_unknown_names_are_refused_with_suggestions():
    with pytest.raises(EngineOptionError, match=r"option.max_num_seq is neither.*did you mean option.max_num_seqs"):
        build(max_num_seq=8)
    with pytest.raises(EngineOptionError, match="option.flux_capacitor is neither"):
        build(flux_capacitor=1)


def test_bad_values_are_refused():
    with pytest.raises(EngineOptionError, match="option.max_model_len='long'"):
        build(max_model_len="long")
    with pytest.raises(EngineOptionError, match="option.dtype='fp8'"):
        build(dtype="fp8")
    with pytest.raises(EngineOptionError, match="max_lora_rank"):
        build(max_lora_rank=7)


def test_packaged_engine_argument_list_matches_the_installed_vllm():
    from container.cli.engine_args import engine_arg_list
    from container.core.engine_arg_list import ENGINE_ARGS_FILE

    packaged = json.loads(ENGINE_ARGS_FILE.read_text())
    assert packaged == engine_arg_list(), "regenerate it: python -m container engine-args --write"
    assert {"max_model_len", "max_num_seqs", "enable_prefix_caching"} <= set(packaged["engine_args"])


def test_engine_args_command_prints_the_list(capsys):
    from container.cli import main
    from container.core.engine_arg_list import ENGINE_ARGS_FILE

    assert main(["engine-args"]) == 0
    assert capsys.readouterr().out == ENGINE_ARGS_FILE.read_text()


@pytest.mark.parametrize("name, raw", [("max_model_len", "4096"), ("enforce_eager", "true"), ("dtype", "fp16"),
                                       ("max_lora_rank", "16"), ("hf_overrides", '{"rope_theta": 1}'),
                                       ("cpu_offload_gb_per_gpu", "2"), ("speculative_length", "4"),
                                       ("enable_streaming", "anything"), ("cpu_offload_params", '["a"]')])
def test_the_shared_check_accepts_engine_arguments_and_lmi_names(name, raw):
    check_engine_option(name, raw)
    check_engine_option(name)


@pytest.mark.parametrize("name, raw, message", [
    ("max_num_seq", "8", "option.max_num_seq is neither an LMI option nor a vLLM engine argument; "
                         "did you mean option.max_num_seqs"),
    ("max_model_len", "long", "option.max_model_len='long' is not a valid value for vLLM's max_model_len: "
                              "Input should be a valid integer"),
    ("max_lora_rank", "7", "option.max_lora_rank='7' is not a valid value for vLLM's max_lora_rank"),
    ("dtype", "fp8", "option.dtype='fp8' is not a valid value for vLLM's dtype"),
    ("enforce_eager", "maybe", "option.enforce_eager='maybe' is not a valid value for vLLM's enforce_eager"),
    ("speculative_length", "x", "option.speculative_length='x' is not a valid value for vLLM's "
                                "speculative_config.num_speculative_tokens"),
    ("cpu_offload_params", "a,b", "expected JSON"),
])
def test_the_shared_check_refuses_unknown_names_and_values_of_the_wrong_kind(name, raw, message):
    with pytest.raises(EngineOptionError) as refused:
        check_engine_option(name, raw)
    assert message in str(refused.value)


def test_the_container_and_the_shared_check_say_the_same():
    with pytest.raises(EngineOptionError) as container:
        build(max_num_seq=8)
    with pytest.raises(EngineOptionError) as shared:
        check_engine_option("max_num_seq")
    assert str(container.value) == str(shared.value)
    with pytest.raises(EngineOptionError) as container:
        build(max_model_len="long")
    with pytest.raises(EngineOptionError) as shared:
        check_engine_option("max_model_len", "long")
    assert str(container.value) == str(shared.value)


@pytest.mark.parametrize("model,options,served", [
    ("/opt/ml/model", {}, "model"),
    ("/tmp/pytest/tiny-model0/", {}, "tiny-model0"),
    ("/root/.cache/sagelmi/s3/abc", {"model_id": "s3://bucket/models/llama-3/"}, "llama-3"),
    ("org/model", {"model_id": "org/model"}, "org/model"),
    ("/opt/ml/model", {"served_model_name": "my-llm"}, "my-llm"),
])
def test_the_served_name_is_never_a_local_path(model, options, served):
    assert build(model=model, **options)["served_model_name"] == served


@pytest.mark.parametrize("task, convert", [("text-embedding", "embed"), ("feature-extraction", "embed"),
                                           ("embed", "embed"), ("classify", "classify"), ("score", "classify")])
def test_a_pooling_task_starts_vllms_pooling_runner(task, convert):
    kwargs = build(task=task)
    assert (kwargs["runner"], kwargs["convert"]) == ("pooling", convert)


def test_text_generation_leaves_the_runner_to_vllm():
    for options in ({}, {"task": "text-generation"}):
        kwargs = build(**options)
        assert "runner" not in kwargs and "convert" not in kwargs


def test_runner_and_convert_given_win_over_the_task_with_a_warning(caplog):
    with caplog.at_level("WARNING"):
        kwargs = build(task="text-embedding", convert="classify")
    assert (kwargs["runner"], kwargs["convert"]) == ("pooling", "classify")
    assert "option.convert=classify overrides embed from option.task=text-embedding" in caplog.text
    assert build(runner="pooling", convert="embed")["runner"] == "pooling"  # without a task: as given


@pytest.mark.parametrize("options, reason", [
    ({"OPTION_TASK": "text-embedding"}, None),
    ({"OPTION_TASK": "classify"}, None),
    ({"OPTION_TASK": "text-embedding", "OPTION_ROLLING_BATCH": "disable"}, "option.rolling_batch=disable"),
    ({"OPTION_TASK": "text-classification"}, "option.task=text-classification, which vLLM does not serve"),
])
def test_pooling_tasks_go_to_vllm_unless_rolling_batch_is_disabled(options, reason):
    from container.core.handler_choice import accelerate_reason
    assert accelerate_reason(resolve_settings(options, "/nonexistent")) == reason


HUB_TOKEN = "hf_aVeryPrivateTokenValue1234"


def test_the_starting_vllm_line_shows_the_hub_token_as_stars():
    """The built-in engine logs its engine arguments ("starting vLLM with ..."); option.hf_token is one."""
    settings = resolve_settings({"OPTION_HF_TOKEN": HUB_TOKEN, "OPTION_MAX_MODEL_LEN": "512"}, "/nonexistent")
    kwargs = build_engine_kwargs(settings, "/opt/ml/model", 1, cpu=True)
    assert kwargs["hf_token"] == HUB_TOKEN  # vLLM gets it
    line = redacted_json(kwargs)
    assert HUB_TOKEN not in line and '"hf_token": "***"' in line and '"max_model_len": 512' in line
