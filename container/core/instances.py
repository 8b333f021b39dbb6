"""SageMaker's GPU instance types for hosting: accelerator count and memory per
accelerator (GiB as the driver reports it, rounded down).

Source: AWS, "Amazon SageMaker AI pricing" (instance details) and the EC2
accelerated-computing instance pages (A10G 24 GB, L4 24 GB, L40S 48 GB, T4 16 GB,
V100 16/32 GB, A100 40/80 GB, H100 80 GB, H200 141 GB, B200 180 GB), read 2026-11.
Inferentia/Trainium (inf2, trn1) are not here: vLLM's GPU build does not run on them.
"""

from __future__ import annotations

from typing import NamedTuple


class Instance(NamedTuple):
    gpus: int
    gpu_memory_gib: float
    gpu: str


def _family(gpu: str, memory: float, sizes: dict[str, int]) -> dict[str, Instance]:
    return {name: Instance(count, memory, gpu) for name, count in sizes.items()}


INSTANCES: dict[str, Instance] = {
    **_family(
        "T4",
        15,
        {
            "ml.g4dn.xlarge": 1,
            "ml.g4dn.2xlarge": 1,
            "ml.g4dn.4xlarge": 1,
            "ml.g4dn.8xlarge": 1,
            "ml.g4dn.16xlarge": 1,
            "ml.g4dn.12xlarge": 4,
        },
    ),
    **_family(
        "A10G",
        22,
        {
            "ml.g5.xlarge": 1,
            "ml.g5.2xlarge": 1,
            "ml.g5.4xlarge": 1,
            "ml.g5.8xlarge": 1,
            "ml.g5.16xlarge": 1,
            "ml.g5.12xlarge": 4,
            "ml.g5.24xlarge": 4,
            "ml.g5.48xlarge": 8,
        },
    ),
    **_family(
        "L4",
        22,
        {
            "ml.g6.xlarge": 1,
            "ml.g6.2xlarge": 1,
            "ml.g6.4xlarge": 1,
            "ml.g6.8xlarge": 1,
            "ml.g6.16xlarge": 1,
            "ml.g6.12xlarge": 4,
            "ml.g6.24xlarge": 4,
            "ml.g6.48xlarge": 8,
        },
    ),
    **_family(
        "L40S",
        44,
        {
            "ml.g6e.xlarge": 1,
            "ml.g6e.2xlarge": 1,
            "ml.g6e.4xlarge": 1,
            "ml.g6e.8xlarge": 1,
            "ml.g6e.16xlarge": 1,
            "ml.g6e.12xlarge": 4,
            "ml.g6e.24xlarge": 4,
            "ml.g6e.48xlarge": 8,
        },
    ),
    **_family("V100", 15, {"ml.p3.2xlarge": 1, "ml.p3.8xlarge": 4, "ml.p3.16xlarge": 8}),
    **_family("V100-32GB", 31, {"ml.p3dn.24xlarge": 8}),
    **_family("A100-40GB", 39, {"ml.p4d.24xlarge": 8}),
    **_family("A100-80GB", 79, {"ml.p4de.24xlarge": 8}),
    **_family("H100", 79, {"ml.p5.48xlarge": 8}),
    **_family("H200", 139, {"ml.p5e.48xlarge": 8, "ml.p5en.48xlarge": 8}),
    **_family("B200", 178, {"ml.p6-b200.48xlarge": 8}),
}
