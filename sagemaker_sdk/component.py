"""Deploying as a SageMaker inference component: what one copy of the model gets on the
endpoint's instances, how many copies run, and how the endpoint scales and routes.

An inference-component endpoint has an endpoint configuration without a model (its variant
names the instances, ``ManagedInstanceScaling`` and ``RoutingConfig``; the configuration
carries the execution role), and the model is placed on it by ``CreateInferenceComponent``
(``Specification``: the model, its ``ComputeResourceRequirements`` and ``StartupParameters``;
``RuntimeConfig``: the copy count). Requests name the component (``InferenceComponentName``).
``SagelmiModel.deploy(inference_component=...)`` does this on both SDK majors; this module
holds the numbers and their API shapes. Pure code: no AWS, no SDK.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

ROUTING_STRATEGIES = ("LEAST_OUTSTANDING_REQUESTS", "RANDOM")
DEFAULT_MEMORY_MB = 1024


@dataclass(frozen=True)
class InferenceComponentConfig:
    """One argument of ``deploy()``: ``deploy(instance_type=..., inference_component=InferenceComponentConfig(...))``
    (or ``inference_component=True`` for these defaults).

    - ``accelerators``: GPUs (accelerator devices) for each copy; default the model's tensor x
      pipeline parallel degree (``tensor_parallel_degree="max"``: the instance's GPUs). ``0`` asks
      for none (a CPU instance).
    - ``memory_mb``: host memory SageMaker reserves for each copy (``MinMemoryRequiredInMb``);
      ``max_memory_mb`` caps it (``MaxMemoryRequiredInMb``); ``cpus``: CPU cores for each copy.
    - ``copies``: copies of the container (``CopyCount``), each with its own ``accelerators``.
    - ``name``: the component's name (default: one made from the model's).
    - ``min_instances`` / ``max_instances``: SageMaker's managed instance scaling of the endpoint
      (either one turns it on; ``min_instances=0`` lets the endpoint scale to zero instances).
    - ``routing``: how the endpoint picks an instance for a request: ``LEAST_OUTSTANDING_REQUESTS``
      (the default: long LLM requests make random routing uneven) or ``RANDOM``.

    Raises ``ValueError`` for a number SageMaker would refuse."""

    accelerators: int | None = None
    memory_mb: int = DEFAULT_MEMORY_MB
    copies: int = 1
    cpus: float | None = None
    max_memory_mb: int | None = None
    name: str | None = None
    min_instances: int | None = None
    max_instances: int | None = None
    routing: str | None = "LEAST_OUTSTANDING_REQUESTS"

    def __post_init__(self) -> None:
        _at_least("accelerators", self.accelerators, 0)
        _at_least("memory_mb", self.memory_mb, 128)
        _at_least("copies", self.copies, 1)
        _at_least("min_instances", self.min_instances, 0)
        _at_least("max_instances", self.max_instances, 1)
        if self.cpus is not None and self.cpus <= 0:
            raise ValueError(f"cpus must be more than 0, not {self.cpus}")
        if self.max_memory_mb is not None and self.max_memory_mb < self.memory_mb:
            raise ValueError(f"max_memory_mb={self.max_memory_mb} is below memory_mb={self.memory_mb}")
        low, high = self.min_instances, self.max_instances
        if low is not None and high is not None and high < low:
            raise ValueError(f"max_instances={self.max_instances} is below min_instances={self.min_instances}")
        if self.routing is not None and self.routing not in ROUTING_STRATEGIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_STRATEGIES)}, not {self.routing!r}")

    def with_accelerators(self, accelerators: int) -> InferenceComponentConfig:
        return replace(self, accelerators=accelerators)

    # -- the API's shapes (as CreateInferenceComponent and CreateEndpointConfig spell them) --

    def compute_resource_requirements(self) -> dict[str, Any]:
        """``Specification.ComputeResourceRequirements`` of one copy."""
        requirements: dict[str, Any] = {"MinMemoryRequiredInMb": self.memory_mb}
        if self.accelerators:
            requirements["NumberOfAcceleratorDevicesRequired"] = self.accelerators
        if self.cpus is not None:
            requirements["NumberOfCpuCoresRequired"] = self.cpus
        if self.max_memory_mb is not None:
            requirements["MaxMemoryRequiredInMb"] = self.max_memory_mb
        return requirements

    def runtime_config(self) -> dict[str, Any]:
        return {"CopyCount": self.copies}

    def managed_instance_scaling(self, initial_instance_count: int) -> dict[str, Any] | None:
        """The variant's ``ManagedInstanceScaling`` (None: not asked for): a bound not given is the
        initial instance count."""
        if self.min_instances is None and self.max_instances is None:
            return None
        low = self.min_instances if self.min_instances is not None else initial_instance_count
        high = self.max_instances if self.max_instances is not None else max(low, initial_instance_count, 1)
        return {"Status": "ENABLED", "MinInstanceCount": low, "MaxInstanceCount": high}

    def routing_config(self) -> dict[str, Any] | None:
        return {"RoutingStrategy": self.routing} if self.routing else None


def _at_least(name: str, value: int | None, low: int) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
        raise ValueError(f"{name} must be a whole number >= {low}, not {value!r}")
