"""SagelmiModel's settings: the env it produces is what the container reads, and
what the container would refuse is refused here first, with the container's
message. No AWS here (see test_deploy.py for moto)."""

import gzip
import io
import subprocess
import sys
import tarfile

import pytest

from container.core.settings import SettingsError, resolve_settings
from container.core.engine_args import EngineOptionError
from sagemaker_sdk import SagelmiModel
from sagemaker_sdk.env import env_name, env_text
from sagemaker_sdk.model import pack_directory
from tests.sdk.conftest import IMAGE, ROLE, TEXTGEN
from tests.server import REPO, clean_env


def model(**kwargs):
    kwargs.setdefault("image_uri", IMAGE)
    kwargs.setdefault("role", ROLE)
    return SagelmiModel(**kwargs)


def test_typed_settings_and_options_become_the_containers_variables():
    m = model(model_id="Qwen/Qwen2.5-1.5B-Instruct", tensor_parallel_degree=2, pipeline_parallel_degree=1,
              max_rolling_batch_size=32, dtype="fp16", options={"max_model_len": 4096, "enforce_eager": True,
                                                                "option.hf_overrides": {"rope_theta": 10000}},
              env={"HF_TOKEN": "hf_x", "SERVING_JOB_QUEUE_SIZE": 50})
    assert m.env == {"HF_TOKEN": "hf_x", "SERVING_JOB_QUEUE_SIZE": "50",
                     "OPTION_MODEL_ID": "Qwen/Qwen2.5-1.5B-Instruct", "OPTION_TENSOR_PARALLEL_DEGREE": "2",
                     "OPTION_PIPELINE_PARALLEL_DEGREE": "1", "OPTION_MAX_ROLLING_BATCH_SIZE": "32",
                     "OPTION_DTYPE": "fp16", "OPTION_MAX_MODEL_LEN": "4096", "OPTION_ENFORCE_EAGER": "true",
                     "OPTION_HF_OVERRIDES": '{"rope_theta":10000}'}
    settings = resolve_settings(m.env, "/nonexistent")
    assert (settings.model_id, settings.tensor_parallel_degree, settings.max_rolling_batch_size,
            settings.job_queue_size) == ("Qwen/Qwen2.5-1.5B-Instruct", 2, 32, 50)
    assert settings.passthrough_options() == {"dtype": "fp16", "max_model_len": "4096", "enforce_eager": "true",
                                              "hf_overrides": '{"rope_theta":10000}'}
    assert m.settings == settings.model_copy(update={"model_dir": m.settings.model_dir})


def test_mpi_mode_and_lmi_dist():
    m = model(model_id="org/model", rolling_batch="lmi-dist", mpi_mode=True, tensor_parallel_degree="max")
    assert m.env["OPTION_MPI_MODE"] == "true" and m.env["OPTION_ROLLING_BATCH"] == "lmi-dist"
    assert m.settings.mpi_mode_on and m.settings.builtin_engine == "lmi-dist"


def _container_error(env: dict) -> str:
    """What `sagelmi config` (the container's settings step) prints for ``env``."""
    result = subprocess.run([sys.executable, "-m", "container", "config", "--model-dir", "/nonexistent"],
                            env=clean_env(env), capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 2, result.stdout
    return result.stderr


@pytest.mark.parametrize("kwargs", [
    {"tensor_parallel_degree": 0},
    {"max_rolling_batch_size": "lots"},
    {"rolling_batch": "vlm"},
    {"options": {"predict_timeout": -1}},
])
def test_an_invalid_setting_is_refused_with_the_containers_message(kwargs):
    with pytest.raises(SettingsError) as refused:
        model(model_id="org/model", **kwargs)
    message = str(refused.value)
    assert "\n" not in message
    sent = {env_name(f"option.{k}"): env_text(v) for k, v in kwargs.items() if k != "options"}
    sent.update({env_name(f"option.{k}"): env_text(v) for k, v in kwargs.get("options", {}).items()})
    assert message in _container_error({"OPTION_MODEL_ID": "org/model", **sent})


def test_an_unknown_engine_option_is_refused_naming_the_nearest():
    assert model(model_id="org/model", options={"max_model_len": 4096}).env["OPTION_MAX_MODEL_LEN"] == "4096"
    with pytest.raises(EngineOptionError, match=r"^option.max_num_seq is neither an LMI option nor a vLLM engine "
                                                r"argument; did you mean option.max_num_seqs"):
        model(model_id="org/model", options={"max_num_seq": 8})
    with pytest.raises(EngineOptionError, match="option.max_model_len='long' is not a valid value"):
        model(model_id="org/model", options={"max_model_len": "long"})
    with pytest.raises(EngineOptionError, match="option.dtype='fp9'"):
        model(model_id="org/model", dtype="fp9")


def test_the_sdk_and_the_container_refuse_an_engine_option_in_the_same_words():
    from handlers.engines.vllm_args import build_engine_kwargs  # imports vLLM: the container's side

    with pytest.raises(EngineOptionError) as sdk:
        model(model_id="org/model", options={"max_num_seq": 8})
    with pytest.raises(EngineOptionError) as container:
        build_engine_kwargs(resolve_settings({"OPTION_MAX_NUM_SEQ": "8"}, "/nonexistent"), "org/model", 1)
    assert str(sdk.value) == str(container.value)


def test_engine_options_are_not_checked_for_a_custom_handler(tmp_path):
    m = model(handler_dir=TEXTGEN, options={"my_handler_knob": 3})
    assert not m.container.builtin_engine and m.env == {"OPTION_MY_HANDLER_KNOB": "3"}
    m = model(model_data="s3://bucket/model.tar.gz", options={"entryPoint": "model.py", "knob": 1})
    assert not m.container.builtin_engine
    # A model.py with only formatters runs on the built-in engine: its options are checked.
    (tmp_path / "model.py").write_text("from djl_python import output_formatter\n\n"
                                       "@output_formatter\ndef upper(output):\n    return output\n")
    with pytest.raises(EngineOptionError, match="option.knob is neither"):
        model(handler_dir=tmp_path, model_id="org/model", options={"knob": 1})
    with pytest.raises(EngineOptionError, match="option.knob is neither"):
        model(model_id="org/model", options={"entryPoint": "djl_python.huggingface", "knob": 1})


def test_a_setting_given_twice_is_refused():
    with pytest.raises(SettingsError, match="option.tensor_parallel_degree is given twice: '2' here and '4' as "
                                            "env TENSOR_PARALLEL_DEGREE"):
        model(model_id="org/model", tensor_parallel_degree=2, env={"TENSOR_PARALLEL_DEGREE": "4"})
    with pytest.raises(SettingsError, match="option.dtype is given twice: dtype='fp16' and options.'dtype'.='bf16'"):
        model(model_id="org/model", dtype="fp16", options={"dtype": "bf16"})
    with pytest.raises(SettingsError, match="option.max_model_len is given twice"):
        model(model_id="org/model", options={"max_model_len": 1, "option.MAX_MODEL_LEN": 2})
    assert model(model_id="org/model", options={"Max_Model_Len": 8, "entrypoint": "djl_python.huggingface"}).env == {
        "OPTION_MODEL_ID": "org/model", "OPTION_MAX_MODEL_LEN": "8", "OPTION_ENTRYPOINT": "djl_python.huggingface"}


def test_serving_properties_in_the_handler_dir_count(tmp_path):
    (tmp_path / "model.py").write_text("def handle(inputs):\n    return None\n")
    (tmp_path / "serving.properties").write_text("option.tensor_parallel_degree=2\nbatch_size=zero\n")
    with pytest.raises(SettingsError, match=r"invalid setting batch_size='zero' \(from serving.properties line 2\)"):
        model(handler_dir=tmp_path)
    (tmp_path / "serving.properties").write_text("option.tensor_parallel_degree=2\n")
    assert model(handler_dir=tmp_path).settings.tensor_parallel_degree == 2
    with pytest.raises(SettingsError, match="option.tensor_parallel_degree=4 is overridden by serving.properties "
                                            "line 1 .value '2'."):
        model(handler_dir=tmp_path, tensor_parallel_degree=4)


def test_arguments_that_cannot_work_are_refused(tmp_path):
    with pytest.raises(TypeError, match="handler_dir"):
        model(model_id="org/model", entry_point="inference.py", source_dir=str(tmp_path))
    with pytest.raises(ValueError, match="model_id or model_data, not both"):
        model(model_id="org/model", model_data="s3://bucket/model.tar.gz")
    with pytest.raises(ValueError, match="handler_dir or model_data, not both"):
        model(handler_dir=tmp_path, model_data="s3://bucket/model.tar.gz")
    with pytest.raises(ValueError, match="nothing to serve"):
        model()
    with pytest.raises(SettingsError, match="is not a directory"):
        model(handler_dir=tmp_path / "missing")
    assert model(env={"HF_MODEL_ID": "org/model"}).settings.model_id == "org/model"


def test_model_data_forms():
    assert model(model_data="s3://bucket/llama/").model_data == {
        "S3DataSource": {"S3Uri": "s3://bucket/llama/", "S3DataType": "S3Prefix", "CompressionType": "None"}}
    assert model(model_data="s3://bucket/model.tar.gz").model_data == "s3://bucket/model.tar.gz"


def test_a_handler_dir_is_packed_with_its_files_at_the_root(tmp_path):
    (tmp_path / "model.py").write_text("def handle(inputs):\n    return None\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "util.py").write_text("X = 1\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    packed = pack_directory(tmp_path)
    assert packed == pack_directory(tmp_path)  # the same files, the same bytes (and the same S3 key)
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(packed))) as tar:
        assert sorted(tar.getnames()) == ["lib", "lib/util.py", "model.py"]
        assert tar.extractfile("model.py").read() == (tmp_path / "model.py").read_bytes()


@pytest.mark.parametrize("kwargs", [{"rolling_batch": "disable"}, {"options": {"task": "fill-mask"}}],
                         ids=["rolling_batch=disable", "task"])
def test_the_accelerate_engines_options_are_not_vllms(kwargs, caplog):
    """On the Accelerate engine option.device_map is a transformers argument; when vLLM serves, it is
    accepted with one warning saying vLLM does not use it (container/core/lmi_options.json)."""
    options = {**kwargs.pop("options", {}), "device_map": "auto"}
    with caplog.at_level("WARNING"):
        made = model(model_id="org/model", options=options, **kwargs)
    assert made.env["OPTION_DEVICE_MAP"] == "auto" and not caplog.records
    with caplog.at_level("WARNING"):
        made = model(model_id="org/model", options={"device_map": "auto"})  # vLLM serves: ignored, said once
    assert made.env["OPTION_DEVICE_MAP"] == "auto"
    assert [r.getMessage() for r in caplog.records] == [
        "option.device_map is ignored: it applies to the Hugging Face Accelerate engine (option.rolling_batch="
        "disable), not to the vLLM engine serving this model"]
