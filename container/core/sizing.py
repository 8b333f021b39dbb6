"""How long SageMaker should wait for a model of a given size (see
``sagemaker_sdk.sizing`` for where the size comes from): the SDK's ``deploy()`` sets
these timeouts, and ``sagelmi plan`` suggests them."""

from __future__ import annotations

MAX_TIMEOUT = 3600  # SageMaker's upper bound for both timeouts
MIN_TIMEOUT = 60
STARTUP_BASE, STARTUP_PER_GB = 600, 20
DOWNLOAD_BASE, DOWNLOAD_PER_GB = 600, 10
UNKNOWN_SIZE_TIMEOUT = 1800


def _bounded(seconds: float) -> int:
    """Whole seconds, within SageMaker's bounds."""
    return int(min(MAX_TIMEOUT, max(MIN_TIMEOUT, round(seconds))))


def startup_timeout(size_gb: float | None) -> int:
    """``container_startup_health_check_timeout`` for a model of ``size_gb`` GB (None: unknown)."""
    return UNKNOWN_SIZE_TIMEOUT if size_gb is None else _bounded(STARTUP_BASE + STARTUP_PER_GB * size_gb)


def download_timeout(size_gb: float | None) -> int:
    """``model_data_download_timeout`` for model data of ``size_gb`` GB (None: unknown)."""
    return UNKNOWN_SIZE_TIMEOUT if size_gb is None else _bounded(DOWNLOAD_BASE + DOWNLOAD_PER_GB * size_gb)
