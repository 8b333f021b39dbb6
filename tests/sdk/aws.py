"""The AWS account the SDK tests deploy into: moto's, answering as SageMaker does, plus SageMaker's
inference-component endpoints, which moto lacks, checked against botocore's service model.

Only pytest, boto3, botocore and moto: the tests that run under both majors of the sagemaker SDK
(tests/sdk/test_sdk_majors.py, run in a second virtual environment by test_other_major.py) import
their fixtures from here rather than from a conftest."""

import contextlib
import datetime
import json
import re

import pytest
from botocore.awsrequest import AWSResponse
from botocore.validate import validate_parameters

REGION = "us-east-1"
ACCOUNT = "123456789012"
IMAGE = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/sagelmi:latest"
ROLE = f"arn:aws:iam::{ACCOUNT}:role/SageMakerRole"
# moto's list of instance types is old: ml.g5.* is refused, ml.g4dn.xlarge accepted.
INSTANCE_TYPE = "ml.g4dn.xlarge"


def _prune(value, shape) -> None:
    """Drop the empty structures moto answers with where SageMaker leaves the member out
    (``"VpcConfig": {}`` on DescribeModel, ``"DataCaptureConfig": {}`` on
    DescribeEndpointConfig): a structure with required members cannot be empty."""
    if shape.type_name == "structure" and isinstance(value, dict):
        for name in list(value):
            member = shape.members.get(name)
            if member is None:
                continue
            if member.type_name == "structure" and value[name] == {} and member.required_members:
                del value[name]
            else:
                _prune(value[name], member)
    elif shape.type_name == "list" and isinstance(value, list):
        for item in value:
            _prune(item, shape.member)


def answer_as_sagemaker_does(boto_session) -> None:
    """moto's SageMaker answers, made to fit the service model before a client parses them
    further (sagemaker 3.x's resources validate every answer)."""

    def prune(parsed, model, **_):
        if model.output_shape is not None:
            _prune(parsed, model.output_shape)

    boto_session.events.register("after-call.sagemaker", prune)


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z])(?=[A-Z])", "_", name).lower()


class ComponentEndpoints:
    """SageMaker's inference-component endpoints, which moto lacks: it has no
    CreateInferenceComponent (nor its Describe and Delete), and fails on an endpoint
    configuration whose variant names no model. The requests for these, as the client sends
    them (the JSON body on the wire), are checked against botocore's service model
    (``validate_parameters`` with the operation's input shape: members, types, required
    members) and recorded in ``requests``; the answers are checked against the output shape.
    Every other call goes on to moto. An endpoint or component is InService at once."""

    def __init__(self, boto_session) -> None:
        self.boto_session = boto_session
        self.requests: list[tuple[str, dict]] = []
        self.configs: dict[str, dict] = {}
        self.endpoints: dict[str, dict] = {}
        self.components: dict[str, dict] = {}
        boto_session.events.register("before-call.sagemaker", self._call)

    def request(self, operation: str) -> dict:
        """The one request of ``operation`` made (asserted)."""
        (body,) = [body for name, body in self.requests if name == operation]
        return body

    # -- botocore's before-call: an answer here means no HTTP request (moto never sees it)

    def _call(self, model, params, **_):
        body = json.loads(params["body"]) if params.get("body") else {}
        handler = getattr(self, "_" + _snake(model.name), None)
        if handler is None or not self._ours(model.name, body):
            return None
        validate_parameters(body, model.input_shape)  # raises ParamValidationError naming what is wrong
        self.requests.append((model.name, body))
        status, answer = handler(body)
        if status == 200 and model.output_shape is not None:
            validate_parameters(answer, model.output_shape)
        answer["ResponseMetadata"] = {"HTTPStatusCode": status, "RequestId": "sagelmi-test"}
        return AWSResponse(f"https://api.sagemaker.{REGION}.amazonaws.com/", status, {}, None), answer

    def _ours(self, operation: str, body: dict) -> bool:
        if operation == "CreateEndpointConfig":
            return not any("ModelName" in variant for variant in body.get("ProductionVariants", []))
        if operation in ("DescribeEndpointConfig", "DeleteEndpointConfig"):
            return body.get("EndpointConfigName") in self.configs
        if operation == "CreateEndpoint":
            return body.get("EndpointConfigName") in self.configs
        if operation in ("DescribeEndpoint", "DeleteEndpoint"):
            return body.get("EndpointName") in self.endpoints
        return "InferenceComponent" in operation

    @staticmethod
    def _arn(kind: str, name: str) -> str:
        return f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:{kind}/{name.lower()}"

    @staticmethod
    def _not_found(what: str) -> tuple[int, dict]:
        return 400, {"Error": {"Code": "ValidationException", "Message": f"Could not find {what}."}}

    def _create_endpoint_config(self, body):
        name = body["EndpointConfigName"]
        self.configs[name] = {**body, "EndpointConfigArn": self._arn("endpoint-config", name),
                              "CreationTime": datetime.datetime.now(datetime.timezone.utc)}
        return 200, {"EndpointConfigArn": self.configs[name]["EndpointConfigArn"]}

    def _describe_endpoint_config(self, body):
        return 200, {k: v for k, v in self.configs[body["EndpointConfigName"]].items() if k != "Tags"}

    def _delete_endpoint_config(self, body):
        del self.configs[body["EndpointConfigName"]]
        return 200, {}

    def _create_endpoint(self, body):
        name, now = body["EndpointName"], datetime.datetime.now(datetime.timezone.utc)
        self.endpoints[name] = {"EndpointName": name, "EndpointArn": self._arn("endpoint", name),
                                "EndpointConfigName": body["EndpointConfigName"], "EndpointStatus": "InService",
                                "CreationTime": now, "LastModifiedTime": now}
        return 200, {"EndpointArn": self.endpoints[name]["EndpointArn"]}

    def _describe_endpoint(self, body):
        return 200, dict(self.endpoints[body["EndpointName"]])

    def _delete_endpoint(self, body):
        del self.endpoints[body["EndpointName"]]
        return 200, {}

    def _create_inference_component(self, body):
        name, endpoint = body["InferenceComponentName"], body["EndpointName"]
        if endpoint not in self.endpoints:
            return self._not_found(f"endpoint {self._arn('endpoint', endpoint)}")
        now = datetime.datetime.now(datetime.timezone.utc)
        self.components[name] = {
            "InferenceComponentName": name, "InferenceComponentArn": self._arn("inference-component", name),
            "EndpointName": endpoint, "EndpointArn": self.endpoints[endpoint]["EndpointArn"],
            "VariantName": body.get("VariantName", "AllTraffic"), "Specification": body["Specification"],
            "RuntimeConfig": {"DesiredCopyCount": body["RuntimeConfig"]["CopyCount"],
                              "CurrentCopyCount": body["RuntimeConfig"]["CopyCount"]},
            "InferenceComponentStatus": "InService", "CreationTime": now, "LastModifiedTime": now}
        return 200, {"InferenceComponentArn": self.components[name]["InferenceComponentArn"]}

    def _describe_inference_component(self, body):
        component = self.components.get(body["InferenceComponentName"])
        if component is None:
            return self._not_found(f"inference component {body['InferenceComponentName']}")
        return 200, dict(component)

    def _delete_inference_component(self, body):
        if self.components.pop(body["InferenceComponentName"], None) is None:
            return self._not_found(f"inference component {body['InferenceComponentName']}")
        return 200, {}


@contextlib.contextmanager
def moto_account(monkeypatch):
    """A moto account; yields a boto3 session on it, its answers as SageMaker's. No real AWS call can leave."""
    import boto3
    from moto import mock_aws

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with mock_aws():
        session = boto3.Session(region_name=REGION)
        answer_as_sagemaker_does(session)
        yield session


@pytest.fixture
def components(monkeypatch):
    """The inference-component endpoints (``ComponentEndpoints``) of a moto account."""
    with moto_account(monkeypatch) as session:
        yield ComponentEndpoints(session)


@pytest.fixture
def aws(components):
    """A moto account with inference-component endpoints; a boto3 session on it."""
    return components.boto_session
