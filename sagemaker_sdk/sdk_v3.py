"""What ``SagelmiModel`` and ``SagelmiPredictor`` stand on with the ``sagemaker`` SDK 3.x, which
has no ``Model`` or ``Predictor`` class: the ``sagemaker-core`` resources (``Model``,
``EndpointConfig``, ``Endpoint``, ``InferenceComponent`` of ``sagemaker.core.resources``) for
deploying, and the runtime client of ``sagemaker.core``'s ``Session`` for requests (what
``Endpoint.invoke`` calls, reachable here by ``LocalEndpoint``'s session as well).
Imported only when 3.x is installed (``sagemaker_sdk.sdk_major``).

The requests are the ones 2.x's ``Model.deploy`` sends for the same arguments, built from the
same API-shaped dictionaries (``sagemaker_sdk.component``) and turned into ``sagemaker.core``'s
shapes by ``api_shape`` (the endpoint configuration excepted: see ``_deploy_on_sdk``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sagemaker.core import resources
from sagemaker.core import shapes as core_shapes
from sagemaker.core.common_utils import base_name_from_image, name_from_base, unique_name_from_base
from sagemaker.core.deserializers import JSONDeserializer
from sagemaker.core.helper.session_helper import Session
from sagemaker.core.iterators import ByteIterator
from sagemaker.core.local.local_session import LocalSession
from sagemaker.core.serializers import JSONSerializer

from sagemaker_sdk.component import InferenceComponentConfig

__all__ = ["ByteIterator", "LocalSession", "ModelBase", "PredictorBase", "Session"]

VARIANT = "AllTraffic"  # the variant name 2.x gives its single variant
# deploy() arguments of 2.x's Model.deploy that the 3.x front takes (the rest are refused by name)
_DEPLOY_ARGUMENTS = (
    "serializer",
    "deserializer",
    "endpoint_name",
    "tags",
    "kms_key",
    "wait",
    "volume_size",
    "model_data_download_timeout",
    "container_startup_health_check_timeout",
    "inference_ami_version",
    "routing_config",
)


def _snake(name: str) -> str:
    """An API member's name as ``sagemaker.core.shapes`` spells it: ``VolumeSizeInGB`` -> ``volume_size_in_gb``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def _snake_keys(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {_snake(key): _snake_keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_snake_keys(item) for item in value]
    return value


def api_shape(shape: type, value: Mapping[str, Any]) -> Any:
    """The ``sagemaker.core.shapes`` object ``shape`` for ``value`` spelled as the API spells it
    (``{"S3DataSource": {"S3Uri": ...}}``); environment maps keep their keys."""
    converted = _snake_keys({k: v for k, v in value.items() if k != "Environment"})
    if "Environment" in value:
        converted["environment"] = dict(value["Environment"])
    return shape(**converted)


def _api_tags(tags: Any) -> list[dict[str, str]] | None:
    """``tags`` (a dict, or the API's list of ``{"Key", "Value"}``) as the API spells them."""
    if not tags:
        return None
    pairs = tags.items() if isinstance(tags, Mapping) else ((t["Key"], t["Value"]) for t in tags)
    return [{"Key": key, "Value": value} for key, value in pairs]


def _tags(tags: Any) -> list | None:
    api = _api_tags(tags)
    return [core_shapes.Tag(key=t["Key"], value=t["Value"]) for t in api] if api else None


def _startup_parameters(arguments: Mapping[str, Any]) -> dict[str, int]:
    """The startup timeouts ``deploy()`` was given, as the API spells them."""
    return _given(
        ModelDataDownloadTimeoutInSeconds=arguments.get("model_data_download_timeout"),
        ContainerStartupHealthCheckTimeoutInSeconds=arguments.get("container_startup_health_check_timeout"),
    )


def _given(**arguments: Any) -> dict[str, Any]:
    """The arguments that have a value (sagemaker.core's resources refuse None for a member left out)."""
    return {name: value for name, value in arguments.items() if value is not None}


class ModelBase:
    """A model for ``SagelmiModel`` to build on with sagemaker 3.x, keeping 2.x ``Model``'s
    arguments that apply (``image_uri``, ``model_data``, ``role``, ``env``, ``name``,
    ``vpc_config``, ``sagemaker_session`` (``sagemaker.core.helper.session_helper.Session``),
    ``enable_network_isolation``, ``code_location``, ``predictor_cls``) and its attributes
    (``name``, ``endpoint_name``, ``inference_component_name`` after ``deploy()``). The
    ``sagemaker.core.resources`` objects made are kept as ``core_model``, ``endpoint`` and
    ``inference_component``. Other 2.x ``Model`` arguments raise a ``TypeError`` naming them."""

    def __init__(
        self,
        image_uri: str | None = None,
        model_data: Any = None,
        role: str | None = None,
        predictor_cls: Any = None,
        env: dict[str, str] | None = None,
        name: str | None = None,
        vpc_config: dict[str, list[str]] | None = None,
        sagemaker_session: Session | None = None,
        enable_network_isolation: bool = False,
        code_location: str | None = None,
        **unsupported: Any,
    ) -> None:
        if unsupported:
            raise TypeError(
                f"SagelmiModel on sagemaker 3.x takes no {', '.join(f'{name}=' for name in sorted(unsupported))} "
                "(sagemaker 2.x's Model arguments that have no counterpart here)"
            )
        self.image_uri = image_uri
        self.model_data = model_data
        self.role = role
        self.predictor_cls = predictor_cls
        self.env = dict(env or {})
        self.name = name
        self.vpc_config = vpc_config
        self.sagemaker_session = sagemaker_session
        self.enable_network_isolation = enable_network_isolation
        self.bucket, self.key_prefix = None, None
        if code_location:
            self.bucket, _, self.key_prefix = code_location.removeprefix("s3://").partition("/")
        self.endpoint_name: str | None = None
        self.inference_component_name: str | None = None
        self.core_model: Any = None
        self.endpoint: Any = None
        self.inference_component: Any = None

    # -- hooks SagelmiModel fills in or calls -----------------------------------------

    def _prepare_model_data(self) -> None:
        """Called before the model is created in SageMaker (``SagelmiModel`` uploads its handler directory)."""

    def _ensure_session(self, instance_type: str | None) -> None:
        if self.sagemaker_session is None:
            self.sagemaker_session = Session()

    def _session(self) -> Session:
        if self.sagemaker_session is None:
            raise ValueError("this needs a SageMaker session: pass sagemaker_session=, or deploy() first")
        return self.sagemaker_session

    def _s3_client(self) -> Any:
        return self._session().s3_client

    def _upload_archive(self, archive: Path, folder: str) -> str:
        """Upload ``archive`` to ``<code_location or the default bucket>/<prefix>/<folder>/``; its S3 URI."""
        session = self._session()
        bucket, key_prefix = session.determine_bucket_and_prefix(
            bucket=self.bucket, key_prefix=f"{self.key_prefix or 'sagelmi'}/{folder}", sagemaker_session=session
        )
        return session.upload_data(str(archive), bucket=bucket, key_prefix=key_prefix)

    # -- the requests --------------------------------------------------------------------

    def container_definition(self) -> dict[str, Any]:
        """``PrimaryContainer`` of ``CreateModel``, as the API spells it."""
        container: dict[str, Any] = {"Image": self.image_uri, "Environment": dict(self.env)}
        if isinstance(self.model_data, str):
            container["ModelDataUrl"] = self.model_data
        elif isinstance(self.model_data, Mapping):
            container["ModelDataSource"] = dict(self.model_data)
        return container

    def _deploy_on_sdk(
        self,
        initial_instance_count: int | None,
        instance_type: str | None,
        *args: Any,
        component: InferenceComponentConfig | None,
        **kwargs: Any,
    ) -> Any:
        """Create the model, the endpoint configuration and the endpoint (and with ``component``
        the inference component) with ``sagemaker.core.resources``; the ``predictor_cls`` on it."""
        refused = sorted(k for k, v in kwargs.items() if k not in _DEPLOY_ARGUMENTS and v is not None)
        if args or refused:
            raise TypeError(
                "deploy() on sagemaker 3.x takes initial_instance_count and instance_type, then by keyword "
                f"{', '.join(_DEPLOY_ARGUMENTS)} and inference_component; not "
                + (", ".join(f"{k}=" for k in refused) if refused else f"{len(args)} more positional arguments")
            )
        if not instance_type:
            raise ValueError("deploy() needs instance_type (serverless endpoints are not supported with sagemaker 3.x)")
        session = self._session()
        where = {"session": session.boto_session, "region": session.boto_region_name}
        tags = _given(tags=_tags(kwargs.get("tags")))
        self._prepare_model_data()
        base = self.name or base_name_from_image(self.image_uri)
        self.name = self.name or name_from_base(base)
        self.core_model = resources.Model.create(
            model_name=self.name,
            primary_container=api_shape(core_shapes.ContainerDefinition, self.container_definition()),
            **_given(execution_role_arn=self.role, vpc_config=self._vpc_config()),
            enable_network_isolation=self.enable_network_isolation,
            **tags,
            **where,
        )
        self.endpoint_name = kwargs.get("endpoint_name") or name_from_base(base)
        # sagemaker-core (2.27) leaves out a shape's members whose value is falsy when it serialises a
        # request, and so MinInstanceCount=0 (an endpoint that scales to zero): the endpoint configuration,
        # built as the API spells it, goes through the session's client instead of EndpointConfig.create.
        count = initial_instance_count or 1
        session.sagemaker_client.create_endpoint_config(**self.endpoint_config(instance_type, count, component, kwargs))
        self.endpoint = resources.Endpoint.create(
            endpoint_name=self.endpoint_name, endpoint_config_name=self.endpoint_name, **tags, **where
        )
        if component is not None:
            self.endpoint.wait_for_status("InService")  # the component is placed on a running endpoint
            self.inference_component_name = component.name or unique_name_from_base(self.name)
            specification: dict[str, Any] = {
                "ModelName": self.name,
                "ComputeResourceRequirements": component.compute_resource_requirements(),
            }
            if startup := _startup_parameters(kwargs):
                specification["StartupParameters"] = startup
            self.inference_component = resources.InferenceComponent.create(
                inference_component_name=self.inference_component_name,
                endpoint_name=self.endpoint_name,
                variant_name=VARIANT,
                specification=api_shape(core_shapes.InferenceComponentSpecification, specification),
                runtime_config=api_shape(core_shapes.InferenceComponentRuntimeConfig, component.runtime_config()),
                **tags,
                **where,
            )
            if kwargs.get("wait", True):
                self.inference_component.wait_for_status("InService")
        elif kwargs.get("wait", True):
            self.endpoint.wait_for_status("InService")
        if self.predictor_cls is None:
            return None
        predictor = self.predictor_cls(self.endpoint_name, session, component_name=self.inference_component_name)
        for name in ("serializer", "deserializer"):
            if kwargs.get(name) is not None:
                setattr(predictor, name, kwargs[name])
        return predictor

    def endpoint_config(
        self,
        instance_type: str,
        count: int,
        component: InferenceComponentConfig | None,
        arguments: Mapping[str, Any],
    ) -> dict[str, Any]:
        """``CreateEndpointConfig``'s request for ``deploy()``'s ``arguments``, as 2.x sends it: one
        variant with the model, or for an inference component one without (the configuration
        then carries the execution role and the network settings)."""
        variant: dict[str, Any] = {"VariantName": VARIANT, "InstanceType": instance_type, "InitialInstanceCount": count}
        variant.update(_startup_parameters(arguments))  # in the variant too, with a component as well (as 2.x)
        variant.update(
            _given(
                VolumeSizeInGB=arguments.get("volume_size"),
                InferenceAmiVersion=arguments.get("inference_ami_version"),
            )
        )
        routing = arguments.get("routing_config") or (component.routing_config() if component else None)
        variant.update(_given(RoutingConfig=routing))
        config: dict[str, Any] = {"EndpointConfigName": self.endpoint_name, "ProductionVariants": [variant]}
        if component is None:
            variant.update(ModelName=self.name, InitialVariantWeight=1.0)
        else:
            variant.update(_given(ManagedInstanceScaling=component.managed_instance_scaling(count)))
            config.update(_given(ExecutionRoleArn=self.role, VpcConfig=self.vpc_config))
            config["EnableNetworkIsolation"] = bool(self.enable_network_isolation)
        config.update(_given(KmsKeyId=arguments.get("kms_key"), Tags=_api_tags(arguments.get("tags"))))
        return config

    def _vpc_config(self) -> Any:
        return api_shape(core_shapes.VpcConfig, self.vpc_config) if self.vpc_config else None


class PredictorBase:
    """Requests to an endpoint with sagemaker 3.x, with the arguments of 2.x's ``Predictor``:
    ``predict`` (``invoke_endpoint``) and ``predict_stream``
    (``invoke_endpoint_with_response_stream``) through the session's runtime client, the body
    written by ``serializer`` and the answer read by ``deserializer`` (JSON unless told
    otherwise), ``component_name`` naming an inference component."""

    def __init__(
        self,
        endpoint_name: str,
        sagemaker_session: Any = None,
        serializer: Any = None,
        deserializer: Any = None,
        component_name: str | None = None,
    ) -> None:
        self.endpoint_name = endpoint_name
        self.sagemaker_session = sagemaker_session or Session()
        self.serializer = serializer or JSONSerializer()
        self.deserializer = deserializer or JSONDeserializer()
        self.component_name = component_name

    @property
    def content_type(self) -> str:
        return self.serializer.CONTENT_TYPE

    @property
    def accept(self) -> str:
        accept = self.deserializer.ACCEPT
        return accept if isinstance(accept, str) else ", ".join(accept)

    def _request(self, data: Any, initial_args: Mapping[str, Any] | None, **options: Any) -> dict[str, Any]:
        """``invoke_endpoint``'s arguments: ``initial_args`` first, then the options given."""
        request = dict(initial_args or {})
        request.setdefault("EndpointName", self.endpoint_name)
        request.setdefault("ContentType", self.content_type)
        request.setdefault("Accept", self.accept)
        options["InferenceComponentName"] = options.get("InferenceComponentName") or self.component_name
        request.update({key: value for key, value in options.items() if value})
        request["Body"] = self.serializer.serialize(data)
        return request

    def predict(
        self,
        data,
        initial_args=None,
        target_model=None,
        target_variant=None,
        inference_id=None,
        custom_attributes=None,
        component_name=None,
    ) -> Any:
        request = self._request(
            data,
            initial_args,
            TargetModel=target_model,
            TargetVariant=target_variant,
            InferenceId=inference_id,
            CustomAttributes=custom_attributes,
            InferenceComponentName=component_name,
        )
        response = self.sagemaker_session.sagemaker_runtime_client.invoke_endpoint(**request)
        return self.deserializer.deserialize(response["Body"], response.get("ContentType", "application/octet-stream"))

    def predict_stream(
        self,
        data,
        initial_args=None,
        target_variant=None,
        inference_id=None,
        custom_attributes=None,
        component_name=None,
        target_container_hostname=None,
        iterator=ByteIterator,
    ):
        request = self._request(
            data,
            initial_args,
            TargetVariant=target_variant,
            InferenceId=inference_id,
            CustomAttributes=custom_attributes,
            InferenceComponentName=component_name,
            TargetContainerHostname=target_container_hostname,
        )
        response = self.sagemaker_session.sagemaker_runtime_client.invoke_endpoint_with_response_stream(**request)
        return iterator(response["Body"])

    def delete_endpoint(self, delete_endpoint_config: bool = True) -> None:
        """Delete the inference component (if any), the endpoint and its configuration."""
        where = {"session": self.sagemaker_session.boto_session, "region": self.sagemaker_session.boto_region_name}
        if self.component_name:
            component = resources.InferenceComponent.get(inference_component_name=self.component_name, **where)
            component.delete()
            component.wait_for_delete()
        endpoint = resources.Endpoint.get(endpoint_name=self.endpoint_name, **where)
        config_name = endpoint.endpoint_config_name
        endpoint.delete()
        if delete_endpoint_config:
            resources.EndpointConfig.get(endpoint_config_name=config_name, **where).delete()
