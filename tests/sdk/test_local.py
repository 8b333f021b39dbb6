"""The SDK's predictor against real servers on this machine: through the
sagemaker SDK's own LocalSession, and through sagemaker_sdk.local.LocalEndpoint
(process mode; the container modes' command is checked here, their runs belong
to the image tests)."""

import signal

import boto3
import pytest
from sagemaker_sdk import SagelmiModel, SagelmiPredictor, StreamError
from sagemaker_sdk.local import InvocationError, LocalEndpoint, container_command, endpoint_env
from sagemaker_sdk.sdk_major import LocalSession
from tests.sdk.conftest import IMAGE, REGION, TEXTGEN
from tests.server import MODEL_DIRS

MESSAGES = [{"role": "user", "content": "hi there"}]


@pytest.fixture
def local_session(monkeypatch, textgen_server):
    """sagemaker's LocalSession, its runtime client pointed at the test server's port."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    session = LocalSession(boto_session=boto3.Session(region_name=REGION))
    session.sagemaker_runtime_client.config = {"local": {"serving_port": textgen_server.port}}
    return session


def test_predictor_on_a_sagemaker_local_session(local_session):
    predictor = SagelmiPredictor("local-endpoint", local_session)
    assert predictor.predict("hello world", max_new_tokens=4) == {"generated_text": "hello world größer ☃"}
    assert predictor.predict(["a", "b c"], parameters={"max_new_tokens": 2}) == [{"generated_text": "a größer"},
                                                                                {"generated_text": "b c"}]
    assert predictor.predict({"inputs": "x", "parameters": {"max_new_tokens": 1}}, max_new_tokens=3) == \
        {"generated_text": "x größer ☃"}
    reply = predictor.chat(MESSAGES, max_tokens=3)
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "hi there größer"}


def request_options_reach_the_handler(predictor):
    """predict(body, initial_args, ...) in the sagemaker Predictor's order: the request options
    reach the endpoint as SageMaker passes them (headers the handler reads), not as parameters."""
    body = {"inputs": "x", "echo_request": True}
    seen = predictor.predict(body, {"ContentType": "application/json; charset=utf-8", "Accept": "application/json"},
                             None, None, "inference-7", "trace=abc")
    assert seen["content-type"] == "application/json; charset=utf-8"
    assert seen["trace"] == "abc"  # custom attributes: k=v pairs become properties, as DJL Serving does
    assert seen["x-amzn-sagemaker-inference-id"] == "inference-7"
    assert "parameters" not in seen and "echo_request" not in seen
    default = predictor.predict(body)
    assert default["content-type"] == "application/json" and "trace" not in default
    assert predictor.predict(body, custom_attributes="a=1")["a"] == "1"


def test_request_options_reach_the_endpoint_through_a_sagemaker_local_session(local_session):
    request_options_reach_the_handler(SagelmiPredictor("local-endpoint", local_session))


def test_local_endpoint_in_process_mode():
    model = SagelmiModel(handler_dir=TEXTGEN, options={"output_formatter": "sse"}, image_uri=IMAGE)
    endpoint = LocalEndpoint(model, mode="process", ready_timeout=60)
    with endpoint as predictor:
        assert endpoint.ping() == 200
        assert predictor.predict("hello world", max_new_tokens=3) == {"generated_text": "hello world größer"}
        assert list(predictor.predict_stream("hello world", max_new_tokens=6)) == \
            ["hello", " world", " größer", " ☃", " 日本語", " 🙂"]  # server-sent events, as the model asked
        assert "".join(predictor.chat_stream(MESSAGES, max_tokens=4)) == "hi there größer ☃"
        request_options_reach_the_handler(predictor)  # through LocalEndpoint's own runtime client
        with pytest.raises(StreamError, match="generation failed on purpose"):
            list(predictor.predict_stream({"inputs": "hello", "fail_after": 1}))
        with pytest.raises(InvocationError) as refused:
            predictor.predict({"neither": "inputs nor messages"})
        assert refused.value.status == 424
        process = endpoint.process
    assert process.returncode == 0 and endpoint.ping() is None  # SIGTERM: a clean exit


def test_local_endpoint_that_cannot_start_says_why():
    model = SagelmiModel(handler_dir=MODEL_DIRS / "broken_import")
    with pytest.raises(RuntimeError, match="exited with 1 before it was ready; its log .* ends:\n(.|\n)*broken"):
        LocalEndpoint(model, ready_timeout=60).start()


def test_local_endpoint_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="does not fetch model_data"):
        LocalEndpoint(SagelmiModel(model_data="s3://bucket/model.tar.gz"))
    with pytest.raises(ValueError, match="needs an image"):
        LocalEndpoint(SagelmiModel(model_id="org/model"), mode="podman")
    with pytest.raises(ValueError, match="mode must be one of"):
        LocalEndpoint(SagelmiModel(model_id="org/model"), mode="kubernetes")


def test_container_command(tmp_path):
    model = SagelmiModel(handler_dir=tmp_path, options={"max_model_len": 2048}, env={"HF_TOKEN": "hf_secret"}, image_uri=IMAGE)
    endpoint = LocalEndpoint(model, mode="podman", port=18080, run_args=["--device", "nvidia.com/gpu=all"])
    assert endpoint.command() == [
        "podman", "run", "--rm", "--ulimit", "nofile=20000:20000",
        "--ulimit", "nproc=32768:32768", "--shm-size=1g", "-p", "127.0.0.1:18080:8080",
        "--name", "sagelmi-local-18080", "-v", f"{tmp_path}:/opt/ml/model:ro",
        "-e", "HF_TOKEN", "-e", "OPTION_MAX_MODEL_LEN", "--device", "nvidia.com/gpu=all", IMAGE, "serve"]
    assert "hf_secret" not in " ".join(endpoint.command())  # values reach the container through the environment
    assert endpoint.env["HF_TOKEN"] == "hf_secret" and endpoint.env["OPTION_MAX_MODEL_LEN"] == "2048"
    assert container_command("docker", "img", 1, [])[:2] == ["docker", "run"]
    assert "-v" not in container_command("docker", "img", 1, [])  # no model directory: nothing mounted


def test_the_endpoint_sees_only_the_models_settings():
    env = endpoint_env({"OPTION_MODEL_ID": "org/model"},
                       {"PATH": "/bin", "HF_TOKEN": "t", "OPTION_DTYPE": "fp16", "SERVING_PORT": "1",
                        "TENSOR_PARALLEL_DEGREE": "8", "SAGEMAKER_BIND_TO_PORT": "9", "HF_MODEL_ID": "other",
                        "SM_VLLM_MAX_MODEL_LEN": "64"})
    assert env == {"PATH": "/bin", "HF_TOKEN": "t", "OPTION_MODEL_ID": "org/model"}


def test_stop_sends_sigterm(monkeypatch):
    sent = []
    endpoint = LocalEndpoint(SagelmiModel(handler_dir=TEXTGEN), ready_timeout=60)
    predictor = endpoint.start()
    assert predictor.predict("a", max_new_tokens=1) == {"generated_text": "a"}
    real_send = endpoint.process.send_signal
    monkeypatch.setattr(endpoint.process, "send_signal", lambda sig: (sent.append(sig), real_send(sig)))
    assert endpoint.stop() == 0 and sent == [signal.SIGTERM]


def test_a_local_endpoint_prints_the_users_lines_without_the_sdks_chatter(tmp_path):
    """A user's script in a fresh Python (no SAGEMAKER_* variable set): what it prints is its own
    answer, without the sagemaker SDK's config lines or its 2.x retirement notices."""
    import subprocess
    import sys
    import textwrap

    from tests.server import clean_env

    script = textwrap.dedent(f"""
        from sagemaker_sdk import SagelmiModel
        from sagemaker_sdk.local import LocalEndpoint

        model = SagelmiModel(handler_dir={str(TEXTGEN)!r})
        with LocalEndpoint(model, mode="process") as predictor:
            print(predictor.predict("Hello", max_new_tokens=2)["generated_text"])
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                         env=clean_env(), timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["Hello größer"] and run.stderr == "", run.stdout + run.stderr
