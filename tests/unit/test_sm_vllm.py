"""AWS's vLLM-container convention: ``SM_VLLM_<ARG>`` variables become vLLM arguments, read as
sagelmi settings (container.core.sm_vllm through container.core.settings)."""

import dataclasses
import json
import logging

import pytest

from container.core.engine_args import EngineOptionError, check_engine_options
from container.core.setting_keys import KEYS
from container.core.settings import SettingsError, describe_settings, resolve_settings
from container.core.sm_vllm import CHAT_ARGUMENTS, value_text


def resolve(tmp_path, env, properties=None):
    if properties is not None:
        (tmp_path / "serving.properties").write_text(properties)
    return resolve_settings(env, tmp_path)


# -- the value rule of AWS's entrypoint -------------------------------------------------

@pytest.mark.parametrize("value, text", [
    ("300", "300"),
    ("true", "true"), ("TRUE", "true"), (" True ", "true"), ("", "true"),  # the flag alone
    ("false", None), ("FALSE", None), ("[]", None),  # the flag left out
    ('["primary", "alias"]', '["primary", "alias"]'),  # a list argument: its JSON array
    ('{"method": "ngram", "num_speculative_tokens": 3}', '{"method": "ngram", "num_speculative_tokens": 3}'),
    ('{"name": "a", "path": "/l/a"} {"name": "b", "path": "/l/b"}',
     json.dumps([{"name": "a", "path": "/l/a"}, {"name": "b", "path": "/l/b"}])),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}",
     "{% for m in messages %}{{ m['content'] }}{% endfor %}"),  # looks like JSON, is a template
    ("[1, 2", "[1, 2"),  # not JSON: vLLM judges it as given
    ("/opt/ml/model/my model", "/opt/ml/model/my model"),
])
def test_values_are_read_as_the_container_passes_them(value, text):
    assert value_text(value) == text


# -- names: a sagelmi setting's spelling, else option.<arg> ------------------------------

def test_an_engine_argument_becomes_an_option_with_the_variable_as_its_source(tmp_path):
    settings = resolve(tmp_path, {"SM_VLLM_MAX_MODEL_LEN": "300", "SM_VLLM_ENABLE_PREFIX_CACHING": "true"})
    assert settings.passthrough_options() == {"max_model_len": "300", "enable_prefix_caching": "true"}
    assert settings.sources["option.max_model_len"] == "env SM_VLLM_MAX_MODEL_LEN"
    assert ("option.max_model_len", "300", "env SM_VLLM_MAX_MODEL_LEN (passed to the handler)") in \
        describe_settings(settings)


def test_they_reach_the_engine_as_its_arguments(tmp_path):
    from handlers.engines.vllm_args import build_engine_kwargs

    settings = resolve(tmp_path, {"SM_VLLM_MAX_MODEL_LEN": "300", "SM_VLLM_ENABLE_PREFIX_CACHING": "",
                                  "SM_VLLM_TENSOR_PARALLEL_SIZE": "2", "SM_VLLM_MAX_NUM_SEQS": "8",
                                  "SM_VLLM_CUDAGRAPH_CAPTURE_SIZES": "[1, 2, 4]"})
    kwargs = build_engine_kwargs(settings, "org/model", settings.tensor_parallel_degree)
    assert kwargs["max_model_len"] == 300
    assert kwargs["enable_prefix_caching"] is True
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["max_num_seqs"] == 8
    assert kwargs["cudagraph_capture_sizes"] == [1, 2, 4]


def test_a_variable_of_a_sagelmi_setting_is_that_setting(tmp_path):
    settings = resolve(tmp_path, {"SM_VLLM_TENSOR_PARALLEL_SIZE": "2", "SM_VLLM_MODEL": "org/model"})
    assert settings.tensor_parallel_degree == 2 and settings.model_id == "org/model"
    assert settings.sources["option.tensor_parallel_degree"] == "env SM_VLLM_TENSOR_PARALLEL_SIZE"
    assert settings.passthrough_options() == {}  # not also option.tensor_parallel_size


def test_chat_options_of_vllms_server_are_lmi_options(tmp_path):
    settings = resolve(tmp_path, {"SM_VLLM_ENABLE_AUTO_TOOL_CHOICE": "true", "SM_VLLM_TOOL_CALL_PARSER": "hermes"})
    assert settings.passthrough_options() == {"enable_auto_tool_choice": "true", "tool_call_parser": "hermes"}
    check_engine_options(settings, tmp_path)


def test_the_name_after_the_prefix_may_be_in_any_case(tmp_path):
    settings = resolve(tmp_path, {"SM_VLLM_Max_Model_Len": "300", "SM_VLLM_tensor_parallel_size": "2"})
    assert settings.passthrough_options() == {"max_model_len": "300"}
    assert settings.tensor_parallel_degree == 2


def test_false_leaves_the_argument_at_its_default_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        settings = resolve(tmp_path, {"SM_VLLM_ENFORCE_EAGER": "false", "SM_VLLM_LORA_TARGET_MODULES": "[]",
                                      "SM_VLLM_TRUST_REMOTE_CODE": "False"})
    assert settings.passthrough_options() == {}
    assert settings.sources["option.trust_remote_code"] == "default"
    assert "SM_VLLM_ENFORCE_EAGER is left out" in caplog.text and "OPTION_ENFORCE_EAGER=false" in caplog.text
    assert "SM_VLLM_LORA_TARGET_MODULES is left out" in caplog.text


def test_several_json_objects_are_one_list(tmp_path):
    settings = resolve(tmp_path, {"SM_VLLM_SPECULATIVE_CONFIG": '{"method": "ngram"}',
                                  "SM_VLLM_DEFAULT_MM_LORAS": '{"image": "/a"} {"audio": "/b"}'})
    assert settings.options["speculative_config"] == '{"method": "ngram"}'
    assert json.loads(settings.options["default_mm_loras"]) == [{"image": "/a"}, {"audio": "/b"}]


# -- precedence ------------------------------------------------------------------------

def test_lmis_option_beats_the_same_sm_vllm_argument_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        settings = resolve(tmp_path, {"SM_VLLM_MAX_MODEL_LEN": "300", "OPTION_MAX_MODEL_LEN": "400",
                                      "SM_VLLM_TENSOR_PARALLEL_SIZE": "2", "OPTION_TENSOR_PARALLEL_DEGREE": "1"})
    assert settings.options["max_model_len"] == "400"
    assert settings.sources["option.max_model_len"] == "env OPTION_MAX_MODEL_LEN"
    assert "SM_VLLM_MAX_MODEL_LEN=300 is ignored: OPTION_MAX_MODEL_LEN=400 sets option.max_model_len" in caplog.text
    assert settings.tensor_parallel_degree == 1
    assert "SM_VLLM_TENSOR_PARALLEL_SIZE=2 is ignored" in caplog.text


def test_sm_vllm_beats_hugging_face_and_tgi_names(tmp_path):
    settings = resolve(tmp_path, {"SM_VLLM_MODEL": "org/a", "HF_MODEL_ID": "org/b",
                                  "SM_VLLM_TENSOR_PARALLEL_SIZE": "2", "SM_NUM_GPUS": "8"})
    assert settings.model_id == "org/a" and settings.tensor_parallel_degree == 2


def test_serving_properties_and_sagemaker_beat_sm_vllm(tmp_path):
    settings = resolve(tmp_path, {"SM_VLLM_MAX_MODEL_LEN": "300", "SM_VLLM_PORT": "7000",
                                  "SAGEMAKER_BIND_TO_PORT": "9000"}, "option.max_model_len=512\n")
    assert settings.options["max_model_len"] == "512"
    assert settings.sources["option.max_model_len"] == "serving.properties line 1"
    assert settings.port == 9000


# -- refusals ------------------------------------------------------------------------

@pytest.mark.parametrize("env, fragments", [
    ({"SM_VLLM_MAX_MODEL_LENN": "300"},
     ["SM_VLLM_MAX_MODEL_LENN names --max-model-lenn", "did you mean SM_VLLM_MAX_MODEL_LEN"]),
    ({"SM_VLLM_MAX_NUM_SEQ": "8"}, ["SM_VLLM_MAX_NUM_SEQ names", "did you mean SM_VLLM_MAX_NUM_SEQS"]),
    ({"SM_VLLM_NOT_AN_ARGUMENT": "false"}, ["SM_VLLM_NOT_AN_ARGUMENT names"]),  # refused whatever its value
    ({"SM_VLLM_API_KEY": "sk-very-secret"}, ["SM_VLLM_API_KEY names --api-key", "its own server stands in"]),
    ({"SM_VLLM_MAX_MODEL_LEN": ""}, ["SM_VLLM_MAX_MODEL_LEN is true or empty", "takes a value (int)"]),
])
def test_a_name_vllm_has_no_argument_for_is_refused_in_one_line(tmp_path, env, fragments):
    with pytest.raises(SettingsError) as refused:
        resolve(tmp_path, env)
    message = str(refused.value)
    assert "\n" not in message and "sk-very-secret" not in message
    for fragment in fragments:
        assert fragment in message


def test_a_value_vllm_refuses_is_refused_naming_the_variable(tmp_path):
    settings = resolve(tmp_path, {"SM_VLLM_MAX_MODEL_LEN": "long"})
    with pytest.raises(EngineOptionError, match=r"^SM_VLLM_MAX_MODEL_LEN: option.max_model_len='long' is not a valid"):
        check_engine_options(settings, tmp_path)


def test_secrets_are_never_shown(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG):
        settings = resolve(tmp_path, {"SM_VLLM_HF_TOKEN": "hf_first_secret", "OPTION_HF_TOKEN": "hf_second_secret"})
    assert settings.options["hf_token"] == "hf_second_secret"
    assert "SM_VLLM_HF_TOKEN=*** is ignored: OPTION_HF_TOKEN=*** sets option.hf_token" in caplog.text
    shown = repr(describe_settings(resolve(tmp_path, {"SM_VLLM_HF_TOKEN": "hf_first_secret"})))
    assert "hf_first_secret" not in caplog.text + shown and "***" in shown


# -- the table names vLLM's own arguments ------------------------------------------------

def test_every_sm_vllm_spelling_names_an_argument_of_the_installed_vllm():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    engine = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    server = {f.name for f in dataclasses.fields(FrontendArgs)}
    for k in KEYS:
        names = [n.removeprefix("SM_VLLM_").lower() for n in k.env if n.startswith("SM_VLLM_")]
        if k.engine_arg:  # a setting that is an engine argument is spelled by it
            assert names == [k.engine_arg] and k.engine_arg in engine, k.key
        else:
            assert set(names) <= server, k.key
    assert CHAT_ARGUMENTS <= server
