"""How long SageMaker should wait for a model, from its size.

SageMaker stops an endpoint whose container does not answer ``/ping`` within
``container_startup_health_check_timeout`` seconds, and one whose model data it
could not copy within ``model_data_download_timeout``; both default to values
too short for large models and both are capped at 3600 s. ``deploy()`` sets them
from the model's size unless given:

- startup: 600 s (engine start-up, compilation) + 20 s per GB of model (a Hub or
  ``s3://`` download by the container, then loading), at most 3600 s;
- model data download: 600 s + 10 s per GB of model data, at most 3600 s;
- size unknown (a Hub model the Hub API does not size, or S3 objects that cannot
  be listed): 1800 s each.

Both are whole seconds. The model's size is ``model_size_gb`` when
given, else the S3 objects of an ``s3://`` ``model_id``, else the files of a Hub
``model_id`` that the container downloads (asked of the Hub API with ``HF_TOKEN``;
unknown when the Hub cannot be reached), else the model data's when the model is in
it; the model data's is the S3 objects of ``model_data`` or the handler directory's
files.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The formulas are the container's (``sagelmi plan`` suggests the same timeouts).
from container.core.sizing import (  # noqa: E402,F401
    DOWNLOAD_BASE,
    DOWNLOAD_PER_GB,
    MAX_TIMEOUT,
    MIN_TIMEOUT,
    STARTUP_BASE,
    STARTUP_PER_GB,
    UNKNOWN_SIZE_TIMEOUT,
    download_timeout,
    startup_timeout,
)


def directory_gb(directory: Path) -> float:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) / 1e9


def _split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://") :].partition("/")
    return bucket, key


def s3_gb(s3_client: Any, uri: str) -> float | None:
    """The size of an S3 object, or of every object under an S3 prefix, in GB;
    None when it cannot be listed (logged)."""
    bucket, key = _split_s3(uri)
    try:
        if key and not key.endswith("/"):
            try:
                return s3_client.head_object(Bucket=bucket, Key=key)["ContentLength"] / 1e9
            except s3_client.exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey"):
                    raise
                key += "/"  # not an object: a prefix without its trailing slash
        total = 0
        for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
            total += sum(obj["Size"] for obj in page.get("Contents", []))
        return total / 1e9
    except Exception as exc:  # no permission, no such bucket: the size stays unknown, said once
        log.warning("cannot size %s (%s); using the timeouts for an unknown size", uri, exc)
        return None


def hub_gb(
    repo_id: str, revision: str | None = None, token: str | bool | None = None, timeout: float = 10
) -> float | None:
    """The size in GB of what the container downloads for a Hub model (its
    ``container.core.hub_download.selected_files``); None when the Hub cannot tell (logged)."""
    from container.core.hub_download import selected_files

    try:
        from huggingface_hub import HfApi

        info = HfApi(token=token).model_info(repo_id, revision=revision, files_metadata=True, timeout=timeout)
        sizes = {s.rfilename: s.size for s in info.siblings or []}
        wanted = selected_files(list(sizes))
        known = [size for name in wanted if (size := sizes[name]) is not None]
        if not wanted or len(known) != len(wanted):
            raise ValueError("the Hub gave no file sizes")
        return sum(known) / 1e9
    except Exception as exc:  # unreachable, private, gated, not installed: the size stays unknown, said once
        log.warning(
            "cannot size Hub model %s (%s); using the timeouts for an unknown size (or pass model_size_gb)",
            repo_id,
            exc,
        )
        return None
