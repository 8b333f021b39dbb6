"""SagelmiModel.deploy() and SagelmiPredictor on the installed major of the sagemaker SDK, under
moto (tests/sdk/aws.py): a model whose container has sagelmi's image and settings, on an endpoint
or as an inference component (whose requests moto cannot take: they are checked against
botocore's service model), and predictors that name the component. The requests asserted here
are the same on both majors. tests/sdk/test_other_major.py runs this file in a virtual
environment with the other major; it imports nothing of tests/ but tests/sdk/aws.py and
tests/sdk/fake_runtime.py, and never reaches the Hub (model_size_gb, check_fit=False)."""

import gzip
import io
import json
import sys
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
import pytest
from botocore.exceptions import ClientError

from container.core.settings import resolve_settings
from sagemaker_sdk import SDK_MAJOR, DoesNotFit, InferenceComponentConfig, SagelmiModel, SagelmiPredictor
from sagemaker_sdk.local import LocalEndpoint
from sagemaker_sdk.sdk_major import Session
from tests.sdk.aws import IMAGE, INSTANCE_TYPE, REGION, ROLE, aws, components  # noqa: F401 (fixtures)
from tests.sdk.fake_runtime import FakeRuntime

FOUR_GPUS = "ml.g4dn.12xlarge"  # 4 x T4, in moto's list of instance types
STARTUP = 600 + 20 * 2  # sagemaker_sdk.sizing for a 2 GB model


@pytest.fixture
def session(aws):
    return Session(boto_session=aws)


def model(session, **kwargs):
    for name, value in {"model_id": "org/model", "max_rolling_batch_size": 16,
                        "options": {"max_model_len": 4096}}.items():
        kwargs.setdefault(name, value)
    return SagelmiModel(image_uri=IMAGE, role=ROLE, sagemaker_session=session, model_size_gb=2, **kwargs)


def test_deploy_creates_a_model_with_sagelmis_image_and_settings(session, aws):
    made = model(session, tensor_parallel_degree=1)
    predictor = made.deploy(instance_type=INSTANCE_TYPE, check_fit=False, wait=False)
    assert isinstance(predictor, SagelmiPredictor) and predictor.endpoint_name == made.endpoint_name

    client = aws.client("sagemaker")
    container = client.describe_model(ModelName=made.name)["PrimaryContainer"]
    assert container["Image"] == IMAGE
    settings = resolve_settings(container["Environment"], "/nonexistent")
    assert (settings.model_id, settings.tensor_parallel_degree, settings.max_rolling_batch_size) == \
        ("org/model", 1, 16)
    assert settings.passthrough_options() == {"max_model_len": "4096"}
    (variant,) = client.describe_endpoint_config(EndpointConfigName=made.endpoint_name)["ProductionVariants"]
    assert (variant["ModelName"], variant["InstanceType"], variant["InitialInstanceCount"]) == \
        (made.name, INSTANCE_TYPE, 1)
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == STARTUP
    assert client.describe_endpoint(EndpointName=made.endpoint_name)["EndpointStatus"] == "InService"

    predictor.delete_endpoint()
    with pytest.raises(ClientError, match="Could not find endpoint"):
        client.describe_endpoint(EndpointName=made.endpoint_name)


def test_a_handler_directory_becomes_the_model_data(session, aws, tmp_path):
    (tmp_path / "model.py").write_text("def handle(inputs):\n    return None\n")
    made = model(session, model_id=None, handler_dir=tmp_path, options={"knob": 1}, max_rolling_batch_size=None)
    made.deploy(instance_type=INSTANCE_TYPE, check_fit=False, wait=False)
    container = aws.client("sagemaker").describe_model(ModelName=made.name)["PrimaryContainer"]
    uri = container["ModelDataUrl"]
    assert uri.startswith(f"s3://{session.default_bucket()}/sagelmi/handler-") and uri.endswith("/model.tar.gz")
    bucket, key = uri[len("s3://"):].split("/", 1)
    packed = aws.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(packed))) as tar:
        assert tar.extractfile("model.py").read() == (tmp_path / "model.py").read_bytes()
    assert container["Environment"] == {"OPTION_KNOB": "1"}


def test_an_inference_component_deploy(session, components):
    made = model(session, tensor_parallel_degree=2)
    config = InferenceComponentConfig(memory_mb=8192, copies=2, min_instances=0, max_instances=2)
    predictor = made.deploy(instance_type=FOUR_GPUS, inference_component=config, check_fit=False, wait=False)
    assert predictor.endpoint_name == made.endpoint_name
    assert predictor.component_name == made.inference_component_name

    # The endpoint configuration names no model: the role is the configuration's.
    endpoint_config = components.request("CreateEndpointConfig")
    assert endpoint_config["EndpointConfigName"] == made.endpoint_name
    assert endpoint_config["ExecutionRoleArn"] == ROLE
    assert endpoint_config["ProductionVariants"] == [{
        "VariantName": "AllTraffic", "InstanceType": FOUR_GPUS, "InitialInstanceCount": 1,
        "ContainerStartupHealthCheckTimeoutInSeconds": STARTUP,
        "ManagedInstanceScaling": {"Status": "ENABLED", "MinInstanceCount": 0, "MaxInstanceCount": 2},
        "RoutingConfig": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}}]
    assert components.request("CreateEndpoint")["EndpointConfigName"] == made.endpoint_name
    # The component places the model: two GPUs (tensor parallel 2) for each of two copies.
    assert components.request("CreateInferenceComponent") == {
        "InferenceComponentName": predictor.component_name, "EndpointName": made.endpoint_name,
        "VariantName": "AllTraffic",
        "Specification": {"ModelName": made.name,
                          "StartupParameters": {"ContainerStartupHealthCheckTimeoutInSeconds": STARTUP},
                          "ComputeResourceRequirements": {"MinMemoryRequiredInMb": 8192,
                                                          "NumberOfAcceleratorDevicesRequired": 2}},
        "RuntimeConfig": {"CopyCount": 2}}
    # The model it names is in the account (moto), with sagelmi's image and settings.
    container = components.boto_session.client("sagemaker").describe_model(ModelName=made.name)["PrimaryContainer"]
    assert container["Image"] == IMAGE
    assert resolve_settings(container["Environment"], "/nonexistent").tensor_parallel_degree == 2

    if SDK_MAJOR == 3:  # 3.x's predictor deletes the component before the endpoint (2.x's has delete_predictor)
        predictor.delete_endpoint()
        assert [name for name, _ in components.requests if name.startswith("Delete")] == [
            "DeleteInferenceComponent", "DeleteEndpoint", "DeleteEndpointConfig"]
        assert components.components == components.endpoints == components.configs == {}


def test_an_inference_component_with_its_defaults(session, components):
    made = model(session)
    predictor = made.deploy(instance_type=INSTANCE_TYPE, inference_component=True, check_fit=False, wait=False)
    (variant,) = components.request("CreateEndpointConfig")["ProductionVariants"]
    assert "ManagedInstanceScaling" not in variant and "ModelName" not in variant
    specification = components.request("CreateInferenceComponent")["Specification"]
    assert specification["ComputeResourceRequirements"] == {"MinMemoryRequiredInMb": 1024,
                                                            "NumberOfAcceleratorDevicesRequired": 1}
    assert components.request("CreateInferenceComponent")["RuntimeConfig"] == {"CopyCount": 1}
    assert predictor.component_name == components.request("CreateInferenceComponent")["InferenceComponentName"]


def test_an_inference_component_that_cannot_be_placed_is_refused_before_aws(session, components):
    with pytest.raises(DoesNotFit, match="each copy of the inference component asks for 8 accelerators; "
                                         f"{FOUR_GPUS} has 4"):
        model(session).deploy(instance_type=FOUR_GPUS, inference_component=InferenceComponentConfig(accelerators=8))
    with pytest.raises(ValueError, match="tensor_parallel_degree='max' on 'ml.x9.huge', an instance type sagelmi "
                                         "does not know: give the GPUs of each copy"):
        model(session, tensor_parallel_degree="max").deploy(instance_type="ml.x9.huge", inference_component=True)
    with pytest.raises(ValueError, match="copies must be a whole number >= 1, not 0"):
        InferenceComponentConfig(copies=0)
    with pytest.raises(ValueError, match="routing must be one of"):
        InferenceComponentConfig(routing="ROUND_ROBIN")
    assert components.requests == []
    assert components.boto_session.client("sagemaker").list_models()["Models"] == []


@pytest.mark.skipif(SDK_MAJOR == 2, reason="2.x's Model and Model.deploy take all of these")
def test_arguments_of_2x_that_3x_has_no_counterpart_for_are_refused_by_name(session, components):
    with pytest.raises(TypeError, match="SagelmiModel on sagemaker 3.x takes no image_config=, model_kms_key="):
        model(session, image_config={"RepositoryAccessMode": "Vpc"}, model_kms_key="key")
    with pytest.raises(TypeError, match="deploy.. on sagemaker 3.x takes .* not data_capture_config="):
        model(session).deploy(instance_type=INSTANCE_TYPE, check_fit=False, data_capture_config=object())
    assert components.requests == []
    assert components.boto_session.client("sagemaker").list_models()["Models"] == []


def test_the_checked_requests_are_botocores_input_shape(components):
    """The stand-in refuses what SageMaker's API would (botocore's validator on the wire body)."""
    from botocore.exceptions import ParamValidationError

    client = components.boto_session.client("sagemaker")
    operation = client.meta.service_model.operation_model("CreateInferenceComponent")
    body = {"InferenceComponentName": "ic", "EndpointName": "ep",
            "Specification": {"ModelName": "m", "ComputeResourceRequirements": {"MinMemoryRequiredInMb": "lots"}},
            "RuntimeConfig": {}}
    with pytest.raises(ParamValidationError, match="MinMemoryRequiredInMb.*(CopyCount|type)|CopyCount"):
        components._call(operation, {"body": json.dumps(body)})


@pytest.fixture
def runtime(monkeypatch):
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(name, value)
    with FakeRuntime() as fake:
        boto_session = boto3.Session(region_name=REGION)
        fake.session = Session(boto_session=boto_session,
                               sagemaker_runtime_client=boto_session.client("sagemaker-runtime", endpoint_url=fake.url))
        yield fake


def test_the_predictor_names_its_inference_component(runtime):
    predictor = SagelmiPredictor("endpoint-1", runtime.session, component_name="component-1")
    assert predictor.predict("hi", max_new_tokens=2) == runtime.answer
    runtime.respond([b'{"token": {"text": "a"}}\n', b'{"token": {"text": "b"}}\n'])
    assert list(predictor.predict_stream("hi", max_new_tokens=2)) == ["a", "b"]
    predictor.predict("hi", component_name="component-2")
    plain, streamed, other = runtime.requests
    assert plain["path"] == "/endpoints/endpoint-1/invocations"
    assert streamed["path"] == "/endpoints/endpoint-1/invocations-response-stream"
    assert [r["headers"].get("X-Amzn-SageMaker-Inference-Component") for r in runtime.requests] == \
        ["component-1", "component-1", "component-2"]
    assert json.loads(plain["body"]) == {"inputs": "hi", "parameters": {"max_new_tokens": 2}}
    assert plain["headers"]["Content-Type"] == "application/json"


@pytest.fixture
def container_stub():
    """A stand-in for the container's /invocations on a local port (this test is not about the
    server: test_local.py runs the real one): LMI's answer, or its JSON lines when asked to stream."""
    requests = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append((self.path, body))
            lines = [{"token": {"text": "a"}}, {"token": {"text": "b"}, "generated_text": "ab"}]
            answer = "".join(json.dumps(line) + "\n" for line in lines) if body.get("stream") else \
                json.dumps({"generated_text": "ab"})
            self.send_response(200)
            self.send_header("Content-Type", "application/jsonlines" if body.get("stream") else "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.requests = requests
    yield server
    server.shutdown()
    server.server_close()


def test_a_local_endpoints_predictor(container_stub):
    port = container_stub.server_address[1]
    endpoint = LocalEndpoint(SagelmiModel("org/model", image_uri=IMAGE), mode="docker", port=port)
    assert endpoint.command()[:2] == ["docker", "run"] and endpoint.command()[-2:] == [IMAGE, "serve"]
    predictor = endpoint.predictor()
    assert predictor.predict("hi", max_new_tokens=2) == {"generated_text": "ab"}
    assert list(predictor.predict_stream("hi", max_new_tokens=2)) == ["a", "b"]
    assert container_stub.requests == [
        ("/invocations", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
        ("/invocations", {"inputs": "hi", "parameters": {"max_new_tokens": 2}, "stream": True})]


def test_only_the_installed_majors_front_is_imported():
    import sagemaker_sdk.sdk_major  # noqa: F401

    other = {2: "sagemaker_sdk.sdk_v3", 3: "sagemaker_sdk.sdk_v2"}[SDK_MAJOR]
    assert other not in sys.modules
    if SDK_MAJOR == 3:  # no 2.x module is reached for (3.x has none of them)
        assert not {"sagemaker.model", "sagemaker.predictor", "sagemaker.session"} & set(sys.modules)
