"""Model artifacts on S3: ``option.model_id=s3://bucket/prefix`` is downloaded
once, before the workers start, and handlers see the local directory.

Hub ids and local paths need nothing here (vLLM and transformers read them).
The download lands in ``<temp dir>/sagelmi-models/<hash of the URI>`` and is
reused by a later start in the same container once complete. boto3 finds
credentials and endpoints the usual way (instance role, ``AWS_*`` variables,
``AWS_ENDPOINT_URL_S3``).
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import time
from pathlib import Path

log = logging.getLogger("sagelmi.artifacts")

_COMPLETE = ".sagelmi-download-complete"


class ArtifactError(Exception):
    """The model could not be fetched; the message says why."""


def parse_s3_uri(uri: str) -> tuple[str, str]:
    rest = uri[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ArtifactError(f"option.model_id={uri!r} names no bucket")
    return bucket, prefix


def download_dir(uri: str) -> Path:
    return Path(tempfile.gettempdir()) / "sagelmi-models" / hashlib.sha256(uri.encode()).hexdigest()[:16]


def fetch_s3(uri: str) -> Path:
    """Download every object under the ``s3://`` prefix; return the local directory.

    Raises ``ArtifactError`` (no credentials, no bucket, no objects, ...)."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = parse_s3_uri(uri)
    target = download_dir(uri)
    if (target / _COMPLETE).exists():
        log.info("using %s, downloaded earlier from %s", target, uri)
        return target
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    started, count, size = time.monotonic(), 0, 0
    try:
        s3 = boto3.client("s3")
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                relative = item["Key"][len(prefix):]
                if not relative or relative.endswith("/"):
                    continue
                destination = target / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                s3.download_file(bucket, item["Key"], str(destination))
                count, size = count + 1, size + item["Size"]
    except (ClientError, BotoCoreError) as exc:
        raise ArtifactError(f"cannot download {uri}: {exc}") from None
    if count == 0:
        raise ArtifactError(f"no objects under {uri}")
    (target / _COMPLETE).touch()
    log.info("downloaded %d files (%.1f MiB) from %s in %.1fs", count, size / 2 ** 20, uri,
             time.monotonic() - started)
    return target
