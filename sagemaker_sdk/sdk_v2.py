"""What ``SagelmiModel`` and ``SagelmiPredictor`` stand on with the ``sagemaker`` SDK 2.x: its
``Model`` (deploy, the container definition, inference components) and ``Predictor``.
Imported only when 2.x is installed (``sagemaker_sdk.sdk_major``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sagemaker import s3
from sagemaker.compute_resource_requirements.resource_requirements import ResourceRequirements
from sagemaker.deserializers import JSONDeserializer
from sagemaker.enums import EndpointType
from sagemaker.iterators import ByteIterator
from sagemaker.local import LocalSession
from sagemaker.model import Model
from sagemaker.predictor import Predictor
from sagemaker.serializers import JSONSerializer
from sagemaker.session import Session
from sagemaker.utils import base_name_from_image, name_from_base

from sagemaker_sdk.component import InferenceComponentConfig

__all__ = ["ByteIterator", "LocalSession", "ModelBase", "PredictorBase", "Session"]

# Model.deploy's own way to an inference component, which inference_component= replaces
_COMPONENT_ARGUMENTS = ("endpoint_type", "resources", "managed_instance_scaling", "inference_component_name")


class ModelBase(Model):
    """``sagemaker.model.Model``, with the hooks ``SagelmiModel`` fills in."""

    def _prepare_model_data(self) -> None:
        """Called before the model is created in SageMaker (``SagelmiModel`` uploads its handler directory)."""

    def prepare_container_def(self, *args, **kwargs):
        self._prepare_model_data()
        return super().prepare_container_def(*args, **kwargs)

    def _ensure_session(self, instance_type: str | None) -> None:
        self._init_sagemaker_session_if_does_not_exist(instance_type)

    def _s3_client(self) -> Any:
        return self._session().s3_client

    def _session(self) -> Session:
        session = self.sagemaker_session
        if session is None:
            raise ValueError("this needs a SageMaker session: pass sagemaker_session=, or deploy() first")
        return session

    def _upload_archive(self, archive: Path, folder: str) -> str:
        """Upload ``archive`` to ``<code_location or the default bucket>/<prefix>/<folder>/``; its S3 URI."""
        session = self._session()
        bucket, key_prefix = s3.determine_bucket_and_prefix(
            bucket=self.bucket, key_prefix=f"{self.key_prefix or 'sagelmi'}/{folder}", sagemaker_session=session
        )
        return session.upload_data(str(archive), bucket=bucket, key_prefix=key_prefix)

    def _deploy_on_sdk(
        self, initial_instance_count, instance_type, *args, component: InferenceComponentConfig | None, **kwargs
    ):
        """``Model.deploy``; with ``component``, as an inference component (2.x's
        ``endpoint_type=INFERENCE_COMPONENT_BASED`` and ``resources``)."""
        if component is not None:
            given = [name for name in _COMPONENT_ARGUMENTS if kwargs.get(name) is not None]
            if given:
                raise TypeError(f"inference_component= replaces {', '.join(given)}=: give it alone")
            scaling = component.managed_instance_scaling(initial_instance_count or 1)
            requests: dict[str, Any] = {"memory": component.memory_mb, "copies": component.copies}
            if component.accelerators:
                requests["num_accelerators"] = component.accelerators
            if component.cpus is not None:
                requests["num_cpus"] = component.cpus
            limits = {"memory": component.max_memory_mb} if component.max_memory_mb is not None else None
            # 2.x names an inference-component endpoint after the model's name, which it sets later
            kwargs["endpoint_name"] = kwargs.get("endpoint_name") or name_from_base(
                self.name or base_name_from_image(self.image_uri)
            )
            kwargs.update(
                endpoint_type=EndpointType.INFERENCE_COMPONENT_BASED,
                resources=ResourceRequirements(requests=requests, limits=limits),
                # 2.x adds "Status": "ENABLED" itself
                managed_instance_scaling={k: v for k, v in scaling.items() if k != "Status"} if scaling else None,
                routing_config=component.routing_config(),
                inference_component_name=component.name,
            )
        return super().deploy(initial_instance_count, instance_type, *args, **kwargs)


class PredictorBase(Predictor):
    """``sagemaker.predictor.Predictor`` sending and reading JSON unless told otherwise."""

    def __init__(
        self, endpoint_name: str, sagemaker_session=None, serializer=None, deserializer=None, **kwargs
    ) -> None:
        super().__init__(
            endpoint_name,
            sagemaker_session,
            serializer=serializer or JSONSerializer(),
            deserializer=deserializer or JSONDeserializer(),
            **kwargs,
        )
