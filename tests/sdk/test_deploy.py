"""SagelmiModel.deploy() under moto's mock of AWS, with the real sagemaker SDK (the installed
major; test_sdk_majors.py runs on both):
model, endpoint config and endpoint are created; the environment SageMaker
records is what the container resolves to the settings asked for; a bad setting
never reaches AWS."""

import gzip
import io
import tarfile

import pytest

from container.core.settings import SettingsError, resolve_settings
from container.core.engine_args import EngineOptionError
from sagemaker_sdk import SagelmiModel, SagelmiPredictor
from sagemaker_sdk import sizing
from sagemaker_sdk.sdk_major import Session
from tests.fake_hub import Repo
from tests.sdk.conftest import IMAGE, INSTANCE_TYPE, ROLE, TEXTGEN


class CallCounter:
    """Counts the AWS API calls a boto3 session makes (botocore's before-call event)."""

    def __init__(self, boto_session) -> None:
        self.calls: list[str] = []
        boto_session.events.register("before-call.*.*", self._count)

    def _count(self, model, **_):
        self.calls.append(f"{model.service_model.service_name}.{model.name}")


@pytest.fixture
def session(aws):
    counter = CallCounter(aws)
    sagemaker_session = Session(boto_session=aws)
    counter.calls.clear()
    sagemaker_session.counter = counter
    return sagemaker_session


def described(session, model):
    client = session.sagemaker_client
    description = client.describe_model(ModelName=model.name)
    config = client.describe_endpoint_config(EndpointConfigName=model.endpoint_name)
    endpoint = client.describe_endpoint(EndpointName=model.endpoint_name)
    return description["PrimaryContainer"], config["ProductionVariants"][0], endpoint


def test_deploy_creates_model_config_and_endpoint_with_the_settings_asked_for(session, tmp_path):
    model = SagelmiModel(handler_dir=TEXTGEN, tensor_parallel_degree=2, max_rolling_batch_size=16,
                         options={"output_formatter": "sse", "knob": "on"}, env={"SERVING_JOB_QUEUE_SIZE": "64"},
                         image_uri=IMAGE, role=ROLE, sagemaker_session=session)
    predictor = model.deploy(instance_type=INSTANCE_TYPE, wait=False)
    assert isinstance(predictor, SagelmiPredictor) and predictor.endpoint_name == model.endpoint_name

    container, variant, endpoint = described(session, model)
    assert container["Image"] == IMAGE and endpoint["EndpointName"] == model.endpoint_name
    assert variant["InstanceType"] == INSTANCE_TYPE and variant["InitialInstanceCount"] == 1
    # What the container reads: the recorded environment and the unpacked model data.
    uri = container["ModelDataUrl"]
    assert uri.startswith(f"s3://{session.default_bucket()}/sagelmi/handler-") and uri.endswith("/model.tar.gz")
    bucket, key = uri[len("s3://"):].split("/", 1)
    packed = session.boto_session.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(packed))) as tar:
        tar.extractall(tmp_path / "opt-ml-model")
    assert (tmp_path / "opt-ml-model" / "model.py").read_bytes() == (TEXTGEN / "model.py").read_bytes()
    settings = resolve_settings(container["Environment"], tmp_path / "opt-ml-model")
    assert (settings.tensor_parallel_degree, settings.max_rolling_batch_size, settings.output_formatter,
            settings.job_queue_size, settings.options["knob"]) == (2, 16, "sse", 64, "on")
    # A tiny model data directory: the timeouts for a small model.
    assert variant["ModelDataDownloadTimeoutInSeconds"] == sizing.download_timeout(0) == 600
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == sizing.startup_timeout(0) == 600


def test_timeouts_follow_the_models_size(session):
    model = SagelmiModel(model_id="org/big", model_size_gb=100, image_uri=IMAGE, role=ROLE,
                         sagemaker_session=session)
    model.deploy(instance_type=INSTANCE_TYPE, wait=False)
    container, variant, _ = described(session, model)
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 600 + 20 * 100
    assert "ModelDataDownloadTimeoutInSeconds" not in variant  # no model data: nothing for SageMaker to copy
    # The container waits for its model as long as SageMaker does.
    assert resolve_settings(container["Environment"], "/nonexistent").model_loading_timeout == 2600

    huge = SagelmiModel(model_id="org/huge", model_size_gb=1000, image_uri=IMAGE, role=ROLE,
                        sagemaker_session=session)
    huge.deploy(instance_type=INSTANCE_TYPE, wait=False, container_startup_health_check_timeout=1200)
    _, variant, _ = described(session, huge)
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 1200  # given: kept

    hub = SagelmiModel(model_id="org/unknown-size", image_uri=IMAGE, role=ROLE, sagemaker_session=session)
    hub.deploy(instance_type=INSTANCE_TYPE, wait=False)
    _, variant, _ = described(session, hub)
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == sizing.UNKNOWN_SIZE_TIMEOUT


def test_a_hub_model_is_sized_from_the_files_the_container_downloads(session, monkeypatch):
    monkeypatch.setattr("container.core.sizing.STARTUP_PER_GB", 20_000)  # the fake Hub's 2 MB model is then 40 s a MB
    model = SagelmiModel(model_id="org/two-gb", image_uri=IMAGE, role=ROLE, sagemaker_session=session)
    assert model.model_size() == pytest.approx(0.002)  # the safetensors only: the .bin is not downloaded
    model.deploy(instance_type=INSTANCE_TYPE, wait=False)
    _, variant, _ = described(session, model)
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == sizing.STARTUP_BASE + 40


def test_s3_model_data_is_sized_from_its_objects(session):
    s3 = session.boto_session.client("s3")
    s3.create_bucket(Bucket="weights")
    for index in range(3):
        s3.put_object(Bucket="weights", Key=f"llama/model-{index}.safetensors", Body=b"\0" * 2_000_000)
    s3.put_object(Bucket="weights", Key="other/model.safetensors", Body=b"\0" * 5_000_000)
    model = SagelmiModel(model_data="s3://weights/llama/", image_uri=IMAGE, role=ROLE, sagemaker_session=session)
    assert model.model_data_size() == model.model_size() == pytest.approx(0.006)
    assert SagelmiModel(model_id="s3://weights/other", image_uri=IMAGE, role=ROLE,
                        sagemaker_session=session).model_size() == pytest.approx(0.005)
    model.deploy(instance_type=INSTANCE_TYPE, wait=False)
    container, variant, _ = described(session, model)
    assert container["ModelDataSource"]["S3DataSource"] == {
        "S3Uri": "s3://weights/llama/", "S3DataType": "S3Prefix", "CompressionType": "None"}
    assert variant["ModelDataDownloadTimeoutInSeconds"] == 600
    # Objects that cannot be listed leave the size unknown, said in the log.
    assert SagelmiModel(model_data="s3://no-such-bucket/x/", image_uri=IMAGE, role=ROLE,
                        sagemaker_session=session).model_data_size() is None


@pytest.mark.parametrize("kwargs, error", [
    ({"tensor_parallel_degree": 0}, SettingsError),
    ({"options": {"max_num_seq": 8}}, EngineOptionError),
    ({"rolling_batch": "vlm"}, SettingsError),
])
def test_an_invalid_setting_never_reaches_aws(session, kwargs, error):
    with pytest.raises(error):
        SagelmiModel(model_id="org/model", image_uri=IMAGE, role=ROLE, sagemaker_session=session,
                     **kwargs).deploy(instance_type=INSTANCE_TYPE, wait=False)
    assert session.counter.calls == []
    assert session.sagemaker_client.list_models()["Models"] == []
    # The counter does see calls: a valid model makes them.
    SagelmiModel(model_id="org/model", image_uri=IMAGE, role=ROLE,
                 sagemaker_session=session).deploy(instance_type=INSTANCE_TYPE, wait=False)
    assert "sagemaker.CreateModel" in session.counter.calls and "sagemaker.CreateEndpoint" in session.counter.calls


def test_deploy_without_an_image_is_refused_before_aws(session):
    with pytest.raises(ValueError, match="image_uri is required"):
        SagelmiModel(model_id="org/model", role=ROLE, sagemaker_session=session).deploy(instance_type=INSTANCE_TYPE)
    assert session.counter.calls == []


def _model_files(layers: int, weight_bytes: int) -> dict[str, bytes]:
    """A Llama-like config.json and a safetensors file whose header says ``weight_bytes``
    (the data itself is not there: plan reads headers only)."""
    import json
    import struct

    config = json.dumps({
        "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
        "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}).encode()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [weight_bytes // 2], "data_offsets": [0, weight_bytes]}})
    return {"config.json": config, "model.safetensors": struct.pack("<Q", len(header)) + header.encode()}


def _model_dir(path, layers: int, weight_bytes: int):
    """A model directory with ``_model_files``."""
    path.mkdir()
    for name, body in _model_files(layers, weight_bytes).items():
        (path / name).write_bytes(body)
    return path


def test_a_model_that_cannot_fit_is_refused_before_aws(session, tmp_path):
    from sagemaker_sdk import DoesNotFit

    big = SagelmiModel(handler_dir=_model_dir(tmp_path / "70b", 80, 140 * 10 ** 9), image_uri=IMAGE, role=ROLE,
                       sagemaker_session=session)
    with pytest.raises(DoesNotFit, match=r"does not fit on ml.g4dn.12xlarge \(4 x T4 15 GiB\): needs 130.4 GiB per "
                                         r"GPU for weights at tp=1, pp=1"):
        big.deploy(instance_type="ml.g4dn.12xlarge", wait=False)
    spread = SagelmiModel(handler_dir=tmp_path / "70b", tensor_parallel_degree=8, image_uri=IMAGE, role=ROLE,
                          sagemaker_session=session)
    with pytest.raises(DoesNotFit, match="tensor x pipeline parallel degree 8 x 1 needs 8 GPUs; .* has 4"):
        spread.deploy(instance_type="ml.g4dn.12xlarge", wait=False)
    assert not [c for c in session.counter.calls if c.startswith("sagemaker.Create")]
    # told to go ahead, it does
    big.deploy(instance_type="ml.g4dn.12xlarge", wait=False, check_fit=False)
    assert session.sagemaker_client.describe_endpoint(EndpointName=big.endpoint_name)


def test_a_model_that_fits_is_deployed(session, tmp_path):
    small = SagelmiModel(handler_dir=_model_dir(tmp_path / "1b", 16, 2 * 10 ** 9), image_uri=IMAGE, role=ROLE,
                         sagemaker_session=session)
    assert small.plan(INSTANCE_TYPE).splits[0].fits
    small.deploy(instance_type=INSTANCE_TYPE, wait=False)
    assert session.sagemaker_client.describe_endpoint(EndpointName=small.endpoint_name)


def test_an_inference_component_is_planned_on_its_accelerators(session, components, tmp_path):
    """The fit check of an inference component plans one copy: on its accelerators, not the instance's."""
    from sagemaker_sdk import DoesNotFit, InferenceComponentConfig

    model_dir = _model_dir(tmp_path / "8b", 32, 16 * 10 ** 9)  # 16 GB of weights: more than one T4 holds
    spread = SagelmiModel(handler_dir=model_dir, tensor_parallel_degree=2, image_uri=IMAGE, role=ROLE,
                          sagemaker_session=session)
    with pytest.raises(DoesNotFit, match=r"tensor x pipeline parallel degree 2 x 1 needs 2 GPUs; 1 GPU\(s\) of "
                                         r"ml.g4dn.12xlarge \(4 x T4 15 GiB\) has 1"):
        spread.deploy(instance_type="ml.g4dn.12xlarge", inference_component=InferenceComponentConfig(accelerators=1))
    single = SagelmiModel(handler_dir=model_dir, image_uri=IMAGE, role=ROLE, sagemaker_session=session)
    with pytest.raises(DoesNotFit, match=r"does not fit on 1 GPU\(s\) of ml.g4dn.12xlarge"):
        single.deploy(instance_type="ml.g4dn.12xlarge", inference_component=True)
    assert components.requests == [] and not [c for c in session.counter.calls if c.startswith("sagemaker.Create")]
    # two GPUs a copy (tensor parallel 2, the default accelerators): it fits, and is deployed
    spread.deploy(instance_type="ml.g4dn.12xlarge", inference_component=True, wait=False)
    requirements = components.request("CreateInferenceComponent")["Specification"]["ComputeResourceRequirements"]
    assert requirements["NumberOfAcceleratorDevicesRequired"] == 2


def test_tensor_parallel_max_is_resolved_alike_by_the_container_the_planner_and_the_sdk(session, tmp_path):
    """tp=max with pp=2 on 4 GPUs of 24 GiB is tp=2, pp=2 for all three (container.core.devices.
    resolve_tensor_parallel): the worker groups the container starts, `sagelmi plan` and the SDK's plan."""
    import json
    import subprocess
    import sys

    from container.core.devices import plan_groups

    model = _model_dir(tmp_path / "8b", 32, 16 * 10**9)
    env = {"TENSOR_PARALLEL_DEGREE": "max", "PIPELINE_PARALLEL_DEGREE": "2"}
    groups = plan_groups(resolve_settings(env, str(model)), ["0", "1", "2", "3"])
    assert [(g.tensor_parallel_degree, g.pipeline_parallel_degree) for g in groups] == [(2, 2)]

    cli = subprocess.run([sys.executable, "-m", "container", "plan", "--model-dir", str(model), "--gpus", "4",
                          "--gpu-memory", "24", "--json", *(f"{k}={v}" for k, v in env.items())],
                         capture_output=True, text=True, timeout=120)
    assert [(s["tp"], s["pp"]) for s in json.loads(cli.stdout)["splits"]] == [(2, 2)], cli.stdout + cli.stderr

    sdk = SagelmiModel(handler_dir=model, tensor_parallel_degree="max", pipeline_parallel_degree=2, image_uri=IMAGE,
                       role=ROLE, sagemaker_session=session)
    assert [(s.tp, s.pp) for s in sdk.plan("ml.g5.12xlarge").splits] == [(2, 2)]  # 4 x A10G 24 GiB


def test_the_fit_check_reads_a_gated_hub_model_with_the_models_token(session, hub_api, tmp_path, monkeypatch,
                                                                     caplog):
    """A gated Hub model (tests/fake_hub.py: only the granted token gets in) is planned with the
    model's HF_TOKEN (huggingface_hub_token= or env), the token the container downloads with."""
    from sagemaker_sdk import DoesNotFit

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_TOKEN", "hf_granted")  # this machine's token is not the container's: not used
    hub_api.repos["org/gated-70b"] = Repo(_model_files(80, 140 * 10 ** 9), token="hf_granted", gated=True)
    instance = "ml.g4dn.12xlarge"
    for arguments in ({"huggingface_hub_token": "hf_granted"}, {"env": {"HF_TOKEN": "hf_granted"}}):
        model = SagelmiModel("org/gated-70b", image_uri=IMAGE, role=ROLE, sagemaker_session=session, **arguments)
        with pytest.raises(DoesNotFit, match=f"org/gated-70b does not fit on {instance} .*: needs 130.4 GiB per GPU"):
            model.deploy(instance_type=instance, wait=False)
    assert not [c for c in session.counter.calls if c.startswith("sagemaker.Create")]

    caplog.set_level("WARNING", logger="sagemaker_sdk.model")
    for arguments, why in (({}, "a gated or private model needs huggingface_hub_token="),
                           ({"huggingface_hub_token": "hf_other"}, "HF_TOKEN was refused")):
        caplog.clear()
        unchecked = SagelmiModel("org/gated-70b", image_uri=IMAGE, role=ROLE, sagemaker_session=session, **arguments)
        assert unchecked.plan(instance) is None
        assert [r.getMessage() for r in caplog.records if r.name == "sagemaker_sdk.model"] == [
            f"cannot read Hub model org/gated-70b (GatedRepoError): {why}; deploying unchecked"]


@pytest.mark.parametrize("instance_type", ["local", "local_gpu"])
def test_sagemakers_local_mode_is_refused_for_local_endpoint(session, instance_type):
    model = SagelmiModel(handler_dir=TEXTGEN, image_uri=IMAGE, role=ROLE, sagemaker_session=session)
    with pytest.raises(ValueError, match=f"deploy.instance_type='{instance_type}'. is not supported: .* cannot "
                                         "stream. Use sagemaker_sdk.local.LocalEndpoint"):
        model.deploy(instance_type=instance_type)
    assert session.counter.calls == []
