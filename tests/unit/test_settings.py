import json
import subprocess
import sys

import pytest

from container.core.handler_choice import mpirun_groups
from container.core.serving_properties import parse_properties
from container.core.setting_keys import KEY_BY_FIELD, KEYS
from container.core.settings import SettingsError, describe_settings, resolve_settings
from tests.server import REPO, clean_env


def resolve(env=None, properties: str | None = None, tmp_path=None, **kwargs):
    if properties is not None:
        (tmp_path / "serving.properties").write_text(properties)
    return resolve_settings(env or {}, tmp_path, **kwargs)


# -- every alias resolves to its setting ------------------------------------------------

ALIASES = [
    ("HF_MODEL_ID", "org/model", "model_id", "org/model"),
    ("OPTION_MODEL_ID", "org/model", "model_id", "org/model"),
    ("HF_REVISION", "abc123", "revision", "abc123"),
    ("HF_TASK", "text-generation", "task", "text-generation"),
    ("TENSOR_PARALLEL_DEGREE", "4", "tensor_parallel_degree", 4),
    ("TENSOR_PARALLEL_DEGREE", "max", "tensor_parallel_degree", "max"),
    ("TENSOR_PARALLEL_DEGREE", "MAX", "tensor_parallel_degree", "max"),
    ("SM_NUM_GPUS", "2", "tensor_parallel_degree", 2),
    ("OPTION_ENTRYPOINT", "custom.py", "entry_point", "custom.py"),
    ("OPTION_ENGINE", "MPI", "engine", "MPI"),
    ("OPTION_ENGINE", "python", "engine", "Python"),
    ("OPTION_MPI_MODE", "true", "mpi_mode", True),
    ("HF_MODEL_QUANTIZE", "awq", "quantize", "awq"),
    ("HF_MODEL_TRUST_REMOTE_CODE", "true", "trust_remote_code", True),
    ("HF_TRUST_REMOTE_CODE", "TRUE", "trust_remote_code", True),
    ("MAX_CONCURRENT_REQUESTS", "64", "job_queue_size", 64),
    ("MAX_BATCH_SIZE", "32", "max_rolling_batch_size", 32),
    ("MAX_BATCH_PREFILL_TOKENS", "4096", "max_rolling_batch_prefill_tokens", 4096),
    ("SERVING_JOB_QUEUE_SIZE", "10", "job_queue_size", 10),
    ("SERVING_MIN_WORKERS", "2", "min_workers", 2),
    ("SERVING_MAX_WORKERS", "3", "max_workers", 3),
    ("SERVING_MAX_PAYLOAD_IN_MB", "12", "max_payload_in_mb", 12),
    ("SERVING_BODY_READ_TIMEOUT", "5", "body_read_timeout", 5),
    ("SERVING_MAX_ADAPTER_SIZE_IN_MB", "512", "max_adapter_size_in_mb", 512),
    ("SERVING_HEADER_READ_TIMEOUT", "2.5", "header_read_timeout", 2.5),
    ("SERVING_MAX_CONNECTIONS_PER_CLIENT", "64", "max_connections_per_client", 64),
    ("SAGEMAKER_BIND_TO_PORT", "9090", "port", 9090),
    ("SAGEMAKER_NUM_MODEL_WORKERS", "2", "min_workers", 2),
    ("SAGEMAKER_MODEL_SERVER_WORKERS", "3", "max_workers", 3),
    ("SAGEMAKER_MODEL_SERVER_TIMEOUT", "30", "predict_timeout", 30),
    ("SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS", "45", "predict_timeout", 45),
    ("SAGEMAKER_STARTUP_TIMEOUT", "900", "model_loading_timeout", 900),
    ("SAGEMAKER_MAX_PAYLOAD_IN_MB", "20", "max_payload_in_mb", 20),
    ("OPTION_ROLLING_BATCH", "vllm", "rolling_batch", "vllm"),
    ("OPTION_MAX_ROLLING_BATCH_SIZE", "8", "max_rolling_batch_size", 8),
    ("OPTION_SYNC_HANDLER_THREADS", "4", "sync_handler_threads", 4),
    ("OPTION_TASK", "fill-mask", "task", "fill-mask"),
    ("OPTION_NORMALIZE", "false", "normalize", False),
    ("OPTION_REVISION", "main", "revision", "main"),
    ("OPTION_TRUST_REMOTE_CODE", "yes", "trust_remote_code", True),
    ("OPTION_QUANTIZE", "fp8", "quantize", "fp8"),
    ("OPTION_TENSOR_PARALLEL_DEGREE", "2", "tensor_parallel_degree", 2),
    ("OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS", "512", "max_rolling_batch_prefill_tokens", 512),
    ("OPTION_PREDICT_TIMEOUT", "5.5", "predict_timeout", 5.5),
    ("OPTION_MODEL_LOADING_TIMEOUT", "60", "model_loading_timeout", 60),
    ("SERVING_PORT", "8181", "port", 8181),
    ("SERVING_SHUTDOWN_GRACE_PERIOD", "10", "shutdown_grace_period", 10),
    ("SERVING_LOG_LEVEL", "debug", "log_level", "DEBUG"),
    ("SAGELMI_LOG_FORMAT", "JSON", "log_format", "json"),
    ("PIPELINE_PARALLEL_DEGREE", "2", "pipeline_parallel_degree", 2),
    ("OPTION_PIPELINE_PARALLEL_DEGREE", "4", "pipeline_parallel_degree", 4),
    ("OPTION_MPI_HOSTFILE", "/etc/hosts.mpi", "mpi_hostfile", "/etc/hosts.mpi"),
    ("OPTION_MPI_EXTRA_ARGS", "--oversubscribe --bind-to none", "mpi_extra_args", "--oversubscribe --bind-to none"),
    ("OPTION_RAY_PORT", "6380", "ray_port", 6380),
    ("OPTION_OUTPUT_FORMATTER", "SSE", "output_formatter", "sse"),
    ("OPTION_TGI_COMPAT", "true", "tgi_compat", True),
    ("OPTION_ADAPTER_ROOTS", "/srv/adapters,/data/more", "adapter_roots", "/srv/adapters,/data/more"),
    ("OPTION_ROLLING_BATCH", "LMI-Dist", "rolling_batch", "lmi-dist"),
    ("SERVING_BATCH_SIZE", "4", "batch_size", 4),
    ("OPTION_ENABLE_STATEFUL_SESSIONS", "false", "enable_stateful_sessions", False),
    ("SAGEMAKER_ENABLE_STATEFUL_SESSIONS", "false", "enable_stateful_sessions", False),
    ("OPTION_SESSIONS_PATH", "/srv/sessions", "sessions_path", "/srv/sessions"),
    ("SAGEMAKER_SESSIONS_PATH", "/srv/s", "sessions_path", "/srv/s"),
    ("OPTION_SAGEMAKER_PROGRAM", "serve.py", "sagemaker_program", "serve.py"),
    ("SAGEMAKER_PROGRAM", "inference.py", "sagemaker_program", "inference.py"),
    ("OPTION_DEFAULT_INVOCATIONS_ACCEPT", "text/csv", "default_invocations_accept", "text/csv"),
    ("SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT", "application/x-npy", "default_invocations_accept", "application/x-npy"),
    ("OPTION_SESSIONS_EXPIRATION", "3600", "sessions_expiration", 3600),
    ("SAGEMAKER_SESSIONS_EXPIRATION", "60", "sessions_expiration", 60),
    ("OPTION_MAX_SESSIONS", "50", "max_sessions", 50),
    ("OPTION_BATCH_SIZE", "8", "batch_size", 8),
    ("SERVING_MAX_BATCH_DELAY", "250", "max_batch_delay", 250),
    ("OPTION_MAX_BATCH_DELAY", "50", "max_batch_delay", 50),
    ("SERVING_MAX_IMAGE_PIXELS", "1000000", "max_image_pixels", 1_000_000),
    ("OPTION_ALLOWED_MEDIA_NETWORKS", "10.0.0.0/8,fd00::/8", "allowed_media_networks", "10.0.0.0/8,fd00::/8"),
    ("OPTION_TRUST_REQUEST_MM_KWARGS", "true", "trust_request_mm_kwargs", True),
    ("SERVING_MAX_PROMPTS_PER_REQUEST", "16", "max_prompts_per_request", 16),
    ("SERVING_MAX_MULTIPART_PARTS", "50", "max_multipart_parts", 50),
    # AWS's vLLM container's names (container.core.sm_vllm; the rest: tests/unit/test_sm_vllm.py)
    ("SM_VLLM_MODEL", "org/model", "model_id", "org/model"),
    ("SM_VLLM_REVISION", "v2", "revision", "v2"),
    ("SM_VLLM_TRUST_REMOTE_CODE", "true", "trust_remote_code", True),
    ("SM_VLLM_QUANTIZATION", "awq", "quantize", "awq"),
    ("SM_VLLM_TENSOR_PARALLEL_SIZE", "4", "tensor_parallel_degree", 4),
    ("SM_VLLM_PIPELINE_PARALLEL_SIZE", "2", "pipeline_parallel_degree", 2),
    ("SM_VLLM_MAX_NUM_SEQS", "16", "max_rolling_batch_size", 16),
    ("SM_VLLM_MAX_NUM_BATCHED_TOKENS", "2048", "max_rolling_batch_prefill_tokens", 2048),
    ("SM_VLLM_TRUST_REQUEST_MM_KWARGS", "TRUE", "trust_request_mm_kwargs", True),
    ("SM_VLLM_PORT", "8181", "port", 8181),
]


@pytest.mark.parametrize("line,field,expected", [
    ("batch_size=4", "batch_size", 4), ("max_dynamic_batch_size=3", "batch_size", 3),
    ("option.batch_size=2", "batch_size", 2), ("max_batch_delay=20", "max_batch_delay", 20),
    ("option.max_batch_delay=30", "max_batch_delay", 30)])
def test_batching_spellings_in_serving_properties(tmp_path, line, field, expected):
    (tmp_path / "serving.properties").write_text(line + "\n")
    settings = resolve({}, tmp_path=tmp_path)
    assert getattr(settings, field) == expected
    # as in LMI, the handler's initialisation call sees the serving.properties keys
    assert settings.model_properties()[KEY_BY_FIELD[field].key] == str(expected)


@pytest.mark.parametrize("name,value,field,expected", ALIASES)
def test_alias_resolves(tmp_path, name, value, field, expected):
    settings = resolve({name: value}, tmp_path=tmp_path)
    assert getattr(settings, field) == expected
    key = next(k.key for k in KEYS if k.field == field)
    assert name in settings.sources[key]


def test_every_spelling_in_the_table_is_tested():
    tested = {name for name, *_ in ALIASES}
    spelled = {name for k in KEYS for name in (*k.env, *k.sagemaker)}
    assert spelled - tested == set()


def test_generic_option_env_becomes_a_handler_property(tmp_path):
    settings = resolve({"OPTION_MY_SETTING": "42"}, tmp_path=tmp_path)
    assert settings.options["my_setting"] == "42"
    assert settings.model_properties()["my_setting"] == "42"
    assert settings.model_properties()["model_dir"] == str(tmp_path)


def test_aliases_land_in_handler_properties_under_the_lmi_name(tmp_path):
    props = resolve({"HF_MODEL_ID": "org/m", "SM_NUM_GPUS": "2"}, tmp_path=tmp_path).model_properties()
    assert props["model_id"] == "org/m"
    assert props["tensor_parallel_degree"] == "2"


def test_modes_and_the_built_in_engine(tmp_path):
    assert resolve(tmp_path=tmp_path).builtin_engine == "vllm"
    lmi_dist = resolve({"OPTION_ROLLING_BATCH": "lmi-dist"}, tmp_path=tmp_path)
    assert not lmi_dist.mpi_mode_on and lmi_dist.builtin_engine == "lmi-dist"  # LMI's quick start sets no mpi_mode
    mpi = resolve({"OPTION_MPI_MODE": "true"}, tmp_path=tmp_path)
    assert mpi.mpi_mode_on and mpi.builtin_engine == "lmi-dist"
    assert resolve({"OPTION_ENGINE": "MPI"}, tmp_path=tmp_path).mpi_mode_on
    # LMI's lmi-dist configurations, MPI mode's settings included, all run the built-in engine on vLLM's executor
    for env in ({"OPTION_ROLLING_BATCH": "lmi-dist", "OPTION_MPI_MODE": "false"},
                {"OPTION_ROLLING_BATCH": "lmi-dist", "OPTION_MPI_MODE": "true"},
                {"OPTION_ROLLING_BATCH": "vllm", "OPTION_ENGINE": "MPI"}, {"OPTION_ENGINE": "MPI"}):
        assert not mpirun_groups(resolve(env, tmp_path=tmp_path), tmp_path), env


def test_mpi_mode_makes_mpirun_groups_for_a_model_py_only(tmp_path):
    (tmp_path / "model.py").write_text("def handle(inputs):\n    return None\n")
    assert mpirun_groups(resolve({"OPTION_MPI_MODE": "true"}, tmp_path=tmp_path), tmp_path)
    assert mpirun_groups(resolve({"OPTION_ENGINE": "MPI"}, tmp_path=tmp_path), tmp_path)
    assert not mpirun_groups(resolve({}, tmp_path=tmp_path), tmp_path)
    (tmp_path / "model.py").write_text("from djl_python.input_parser import input_formatter\n")  # formatters only
    assert not mpirun_groups(resolve({"OPTION_MPI_MODE": "true"}, tmp_path=tmp_path), tmp_path)


def test_typed_engine_settings_use_vllm_names(tmp_path):
    settings = resolve({"MAX_BATCH_SIZE": "8", "PIPELINE_PARALLEL_DEGREE": "2", "TENSOR_PARALLEL_DEGREE": "max",
                        "OPTION_QUANTIZE": "awq", "OPTION_MAX_MODEL_LEN": "64"}, tmp_path=tmp_path)
    assert settings.engine_settings(tensor_parallel_degree=4) == {
        "tensor_parallel_size": 4, "pipeline_parallel_size": 2, "max_num_seqs": 8, "quantization": "awq",
        "trust_remote_code": False}
    assert settings.passthrough_options() == {"max_model_len": "64"}


def test_defaults(tmp_path):
    settings = resolve(tmp_path=tmp_path)
    assert settings.port == 8080
    assert settings.job_queue_size == 1000
    assert settings.max_payload_bytes == 6 * 1024 * 1024
    assert settings.shutdown_grace_period == 25
    assert settings.engine == "Python" and not settings.mpi_mode_on
    assert settings.sources["job_queue_size"] == "default"
    assert settings.header_read_timeout == 10


def test_connections_per_client_are_the_queue_bound_unless_set(tmp_path):
    assert resolve({"SERVING_JOB_QUEUE_SIZE": "300"}, tmp_path=tmp_path).connections_per_client == 300
    settings = resolve({"SERVING_MAX_CONNECTIONS_PER_CLIENT": "20"}, tmp_path=tmp_path)
    assert settings.connections_per_client == 20


# -- precedence ------------------------------------------------------------------------

def test_lmi_name_beats_tgi_alias(tmp_path):
    settings = resolve({"SM_NUM_GPUS": "8", "TENSOR_PARALLEL_DEGREE": "2"}, tmp_path=tmp_path)
    assert settings.tensor_parallel_degree == 2
    assert settings.sources["option.tensor_parallel_degree"] == "env TENSOR_PARALLEL_DEGREE"
    settings = resolve({"HF_MODEL_QUANTIZE": "gptq", "OPTION_QUANTIZE": "awq"}, tmp_path=tmp_path)
    assert settings.quantize == "awq"
    settings = resolve({"MAX_CONCURRENT_REQUESTS": "5", "SERVING_JOB_QUEUE_SIZE": "7"}, tmp_path=tmp_path)
    assert settings.job_queue_size == 7


def test_option_env_beats_hf_model_id(tmp_path):
    settings = resolve({"HF_MODEL_ID": "a", "OPTION_MODEL_ID": "b"}, tmp_path=tmp_path)
    assert settings.model_id == "b"


def test_serving_properties_beats_environment(tmp_path):
    settings = resolve({"HF_MODEL_ID": "env/model", "OPTION_ROLLING_BATCH": "vllm", "SERVING_JOB_QUEUE_SIZE": "5"},
                       "option.model_id=file/model\noption.rolling_batch = disable\njob_queue_size: 9\n",
                       tmp_path)
    assert settings.model_id == "file/model"
    assert settings.rolling_batch == "disable"
    assert settings.job_queue_size == 9
    assert settings.sources["option.model_id"] == "serving.properties line 1"
    assert settings.sources["job_queue_size"] == "serving.properties line 3"


def test_sagemaker_values_beat_file_and_environment(tmp_path):
    settings = resolve({"SAGEMAKER_BIND_TO_PORT": "9000", "SERVING_PORT": "7000",
                        "SAGEMAKER_MODEL_SERVER_TIMEOUT": "33", "OPTION_PREDICT_TIMEOUT": "10",
                        "SAGEMAKER_MAX_PAYLOAD_IN_MB": "2", "SAGEMAKER_STARTUP_TIMEOUT": "100",
                        "SAGEMAKER_MODEL_SERVER_WORKERS": "3"},
                       "port=7500\noption.predict_timeout=20\nmax_payload_in_mb=50\n"
                       "option.model_loading_timeout=60\nmin_workers=1\nmax_workers=1\n", tmp_path)
    assert settings.port == 9000
    assert settings.predict_timeout == 33
    assert settings.max_payload_in_mb == 2
    assert settings.model_loading_timeout == 100
    assert settings.min_workers == settings.max_workers == 3
    assert settings.sources["port"] == "SageMaker SAGEMAKER_BIND_TO_PORT"


def test_command_line_port_beats_everything(tmp_path):
    settings = resolve({"SAGEMAKER_BIND_TO_PORT": "9000"}, "port=7000\n", tmp_path, port=8123)
    assert settings.port == 8123
    assert settings.sources["port"] == "command line --port"


def test_serving_properties_option_names_are_normalised(tmp_path):
    settings = resolve(properties="option.entrypoint=handler.py\noption.Custom_Thing=1\n", tmp_path=tmp_path)
    assert settings.entry_point == "handler.py"
    assert settings.options["custom_thing"] == "1"


def test_unknown_server_keys_are_ignored_with_a_warning(tmp_path, caplog):
    settings = resolve({"SERVING_JOB_QUEUE_SIZ": "3"}, "job_queu_size=4\n", tmp_path)
    assert settings.job_queue_size == 1000
    assert "did you mean SERVING_JOB_QUEUE_SIZE" in caplog.text
    assert "did you mean job_queue_size" in caplog.text


def test_empty_variables_count_as_unset(tmp_path):
    settings = resolve({"TENSOR_PARALLEL_DEGREE": "", "SM_NUM_GPUS": "2"}, tmp_path=tmp_path)
    assert settings.tensor_parallel_degree == 2


# -- bad values ------------------------------------------------------------------------

@pytest.mark.parametrize("env,properties,fragments", [
    ({"SERVING_JOB_QUEUE_SIZE": "lots"}, None, ["job_queue_size='lots'", "env SERVING_JOB_QUEUE_SIZE", "whole number"]),
    ({"OPTION_ENGINE": "Rust"}, None, ["engine='Rust'", "env OPTION_ENGINE", "Python or MPI"]),
    (None, "job_queue_size=-4\n", ["job_queue_size='-4'", "serving.properties line 1", ">= 1"]),
    ({"TENSOR_PARALLEL_DEGREE": "two"}, None, ["option.tensor_parallel_degree='two'", "or max"]),
    ({"SAGEMAKER_BIND_TO_PORT": "99999"}, None, ["port='99999'", "SageMaker SAGEMAKER_BIND_TO_PORT", "1-65535"]),
    ({"SAGEMAKER_MAX_PAYLOAD_IN_MB": "0"}, None, ["max_payload_in_mb='0'", "MiB > 0"]),
    ({"SERVING_MAX_ADAPTER_SIZE_IN_MB": "0"}, None, ["max_adapter_size_in_mb='0'", "MiB > 0"]),
    ({"SERVING_MAX_PROMPTS_PER_REQUEST": "0"}, None, ["max_prompts_per_request='0'", "whole number >= 1"]),
    (None, "max_multipart_parts=-1\n", ["max_multipart_parts='-1'", "serving.properties line 1", ">= 1"]),
    ({"SERVING_HEADER_READ_TIMEOUT": "0"}, None, ["header_read_timeout='0'", "seconds > 0"]),
    ({"SERVING_MAX_CONNECTIONS_PER_CLIENT": "0"}, None, ["max_connections_per_client='0'", ">= 1"]),
    ({"OPTION_MPI_MODE": "perhaps"}, None, ["option.mpi_mode='perhaps'", "true or false"]),
    ({"SERVING_MIN_WORKERS": "4", "SERVING_MAX_WORKERS": "2"}, None, ["min_workers=4", "max_workers=2"]),
    ({"OPTION_ROLLING_BATCH": "vlm"}, None, ["option.rolling_batch='vlm'", "auto, vllm, lmi-dist or disable"]),
    ({"OPTION_OUTPUT_FORMATTER": "xml"}, None, ["option.output_formatter='xml'", "json, jsonlines or sse"]),
    ({"OPTION_MPI_EXTRA_ARGS": "--mca 'unclosed"}, None, ["option.mpi_extra_args", "cannot split"]),
    ({"OPTION_RAY_PORT": "80"}, None, ["option.ray_port", "80"]),
])
def test_bad_values_name_key_value_source_and_allowed(tmp_path, env, properties, fragments):
    with pytest.raises(SettingsError) as err:
        resolve(env, properties, tmp_path)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_properties_syntax():
    parsed = parse_properties(
        "# comment\n! also comment\n\nengine=Python\noption.a : b\noption.c d\n"
        "option.long=one \\\n   two\noption.empty=\nengine=MPI\n")
    assert parsed["option.a"] == ("b", 5)
    assert parsed["option.c"] == ("d", 6)
    assert parsed["option.long"] == ("one two", 7)
    assert parsed["option.empty"] == ("", 9)
    assert parsed["engine"] == ("MPI", 10)


def test_describe_lists_every_setting_and_passthrough(tmp_path):
    rows = describe_settings(resolve({"OPTION_FOO": "bar"}, tmp_path=tmp_path))
    keys = [key for key, _, _ in rows]
    assert keys[:len(KEYS)] == [k.key for k in KEYS]
    assert ("option.foo", "bar", "env OPTION_FOO (passed to the handler)") in rows


# -- the command line ------------------------------------------------------------------

def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "container", *args], capture_output=True, text=True,
                          env=clean_env(env), cwd=REPO, timeout=60)


def test_config_command_prints_values_and_sources(tmp_path):
    (tmp_path / "serving.properties").write_text("option.rolling_batch=disable\n")
    result = _cli("config", "--model-dir", str(tmp_path),
                  env={"HF_MODEL_ID": "org/m", "SM_NUM_GPUS": "2", "SAGEMAKER_BIND_TO_PORT": "9001"})
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:] if line.strip()}
    assert "org/m" in lines["option.model_id"] and "env HF_MODEL_ID" in lines["option.model_id"]
    assert "env SM_NUM_GPUS" in lines["option.tensor_parallel_degree"]
    assert "serving.properties line 1" in lines["option.rolling_batch"]
    assert "SageMaker SAGEMAKER_BIND_TO_PORT" in lines["port"]
    assert "default" in lines["job_queue_size"]

    as_json = json.loads(_cli("config", "--model-dir", str(tmp_path), "--json",
                              env={"HF_MODEL_ID": "org/m"}).stdout)
    assert as_json["option.model_id"] == {"value": "org/m", "source": "env HF_MODEL_ID"}


def test_serve_with_a_bad_value_stops_with_the_message(tmp_path):
    result = _cli("serve", "--model-dir", str(tmp_path), env={"SERVING_JOB_QUEUE_SIZE": "many"})
    assert result.returncode == 2
    assert "invalid setting job_queue_size='many' (from env SERVING_JOB_QUEUE_SIZE)" in result.stderr
    assert "Traceback" not in result.stderr


def test_version_is_printed():
    out = subprocess.run([sys.executable, "-m", "container", "--version"], capture_output=True, text=True,
                         cwd=REPO, env=clean_env(), timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("sagelmi ")


@pytest.mark.parametrize("command", [["config", "--reference"], ["lmi-options"]])
def test_output_cut_short_by_a_closed_pipe_ends_without_a_traceback(command):
    """``sagelmi config | head -1``: the reader closes the pipe before the command is done
    writing (here before it starts)."""
    process = subprocess.Popen([sys.executable, "-m", "container", *command], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=REPO, env=clean_env())
    process.stdout.close()
    code = process.wait(timeout=60)
    stderr = process.stderr.read().decode()
    assert code == 0, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr



def test_serve_without_a_model_says_what_to_set_before_anything_starts(tmp_path):
    """No HF_MODEL_ID and no model directory (serve outside the image): one line naming the ways
    to give a model, a non-zero exit, and no server, download or worker started."""
    missing = tmp_path / "no-such-model"
    result = _cli("serve", "--model-dir", str(missing), "--port", "1")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "listening" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.endswith(
        f"ERROR serve [-] sagelmi: nothing to serve: there is no model directory {missing} and option.model_id "
        "(HF_MODEL_ID) is not set; set HF_MODEL_ID (a Hub id, a local directory or an s3:// prefix), give "
        "--model-dir DIR (a model, or a model.py), or mount the model at /opt/ml/model"), line
    shown = _cli("config", "--model-dir", str(missing))
    assert "handler: none: serve stops: nothing to serve: there is no model directory" in shown.stdout

@pytest.mark.parametrize("env, model_dir, handler, groups", [
    ({}, "lmi_echo", "model.py in the model directory (its handle function)", "1 on the CPU, 1 process each"),
    ({}, None, "the built-in vllm handler (option.rolling_batch=auto)", "1 on the CPU, 1 process each"),
    ({"OPTION_ROLLING_BATCH": "lmi-dist", "TENSOR_PARALLEL_DEGREE": "2"}, None,
     "the built-in lmi-dist handler (option.rolling_batch=lmi-dist)", "1 on the CPU, 2 processes each (tp 2 x pp 1)"),
    ({"OPTION_MPI_MODE": "true", "TENSOR_PARALLEL_DEGREE": "2"}, "lmi_echo",
     "model.py in the model directory (its handle function) in MPI mode (mpirun)",
     "1 on the CPU, 2 MPI ranks each (tp 2 x pp 1)"),
    ({"OPTION_TASK": "fill-mask"}, None,
     "the built-in Hugging Face Accelerate handler, because option.task=fill-mask", "1 on the CPU"),
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3", "TENSOR_PARALLEL_DEGREE": "2"}, None, "the built-in vllm handler",
     "2 on 4 visible device(s) (0,1,2,3), 2 processes each (tp 2 x pp 1): 0: 0,1; 1: 2,3"),
])
def test_config_shows_the_handler_and_the_worker_groups(env, model_dir, handler, groups, tmp_path):
    from tests.server import MODEL_DIRS

    directory = MODEL_DIRS / model_dir if model_dir else tmp_path
    out = _cli("config", "--model-dir", str(directory), env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-2].startswith(f"handler: {handler}")
    assert lines[-1].startswith(f"worker groups: {groups}")


def test_config_warns_when_the_groups_need_more_devices_than_are_visible(tmp_path):
    out = _cli("config", "--model-dir", str(tmp_path), env={"CUDA_VISIBLE_DEVICES": "0,1", "TENSOR_PARALLEL_DEGREE": "4"})
    assert out.returncode == 0
    assert "WARNING" in out.stderr and "needs 4 accelerators, but only 2 are visible" in out.stderr
    assert out.stdout.splitlines()[-1].startswith("worker groups: none (")
