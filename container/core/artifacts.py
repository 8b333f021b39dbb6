"""Model artifacts: what ``option.model_id`` names is on this machine before
the workers start, and start-up logs how the download goes.

- ``s3://bucket/prefix``: every object under the prefix is downloaded (many at once, large
  ones in ranged parts) into
  ``<temp dir>/sagelmi-models/<hash of the URI>``; handlers and the engine get that
  directory. A later start in the same container reuses it when the listing (keys,
  sizes, ETags) is the one it was downloaded from, and downloads again when not.
  boto3 finds credentials and endpoints the usual way (instance role, ``AWS_*``
  variables, ``AWS_ENDPOINT_URL_S3``).
- a Hugging Face Hub id (``org/name``; ``container/core/hub_download.py``): the model's files are downloaded into the
  Hub cache (``HF_HOME``; ``HF_TOKEN`` for gated and private models,
  ``HF_ENDPOINT`` for a mirror, ``HF_HUB_OFFLINE=1`` to use the cache alone) and
  the id is handed on unchanged: vLLM and transformers find the files in the cache.
  When the repository has safetensors weights, the other weight formats are skipped.
- a local directory: used as it is.

Both downloads log their size first, progress (bytes, rate, time left) every
``PROGRESS_INTERVAL`` seconds, and a summary. A download that cannot happen
raises ``ArtifactError`` saying which part is missing (bucket, prefix, repository,
revision, credentials).

Downloads stay inside their directory: an object's key (after the prefix) or a Hub
file name that is absolute, or that ``..`` or a symbolic link on the way leads out of
the directory, is refused with ``ArtifactError`` naming it, before any file is
downloaded. An ``s3://`` prefix is downloaded into a fresh directory beside the target
and renamed into place once complete, each object pinned to the ETag it was listed
with: what lands is what was listed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("sagelmi.artifacts")

_COMPLETE = ".sagelmi-download-complete"
PROGRESS_INTERVAL = 10.0
S3_CONCURRENCY = 32  # requests in flight at once (objects, and parts of large ones)
S3_PART_BYTES = 64 * 2**20  # objects above this come in ranged parts of this size
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# Weight formats no engine here loads; and, when safetensors are there, the other formats of the same weights.


class ArtifactError(Exception):
    """The model could not be fetched; the message says why."""


# -- staying inside the directory


def landing(root: Path | str, name: str) -> Path | None:
    """Where the file ``name`` (a '/'-separated relative name: an S3 key after its prefix,
    a Hub file name) lands under ``root``: ``..`` and the symbolic links already on disk
    resolved as the kernel would resolve them. ``None`` when it lands outside ``root``,
    is absolute, or does not name a file (ends in ``/``, ``.`` or ``..``)."""
    parent, _, leaf = name.rpartition("/")
    if name.startswith("/") or "\0" in name or leaf in ("", ".", ".."):
        return None
    real_root = os.path.realpath(root)
    where = os.path.realpath(os.path.join(real_root, parent))
    if where != real_root and not where.startswith(real_root.rstrip("/") + "/"):
        return None
    return Path(where) / leaf


def outside_error(names: Iterable[str], what: str) -> ArtifactError:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return ArtifactError(
        f"cannot download {what}: {shown} would be written outside the download directory "
        f"(an absolute name, '..', or a symbolic link leads out of it); nothing was downloaded"
    )


# -- progress


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """Bytes of one download: ``add``/``set`` from any thread; a log line at most
    every ``interval`` seconds, and ``finish`` for the summary."""

    def __init__(
        self,
        what: str,
        total: int,
        files: int,
        interval: float = PROGRESS_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.total, self.interval, self.clock = what, total, interval, clock
        self.done = 0
        self._lock = threading.Lock()
        self.started = self._last = clock()
        log.info("downloading %s: %d file(s), %s", what, files, _size(total))

    def add(self, n: int) -> None:
        with self._lock:
            self._update(self.done + n)

    def set(self, done: int) -> None:
        with self._lock:
            self._update(done)

    def _update(self, done: int) -> None:
        self.done = done
        now = self.clock()
        if now - self._last >= self.interval:
            self._last = now
            log.info("%s", self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        text = f"downloading {self.what}: {_size(self.done)} of {_size(self.total)}"
        if self.total:
            text += f" ({100 * self.done / self.total:.0f}%)"
        text += f", {_size(rate)}/s"
        if rate > 0 and self.total > self.done:
            text += f", about {_duration((self.total - self.done) / rate)} left"
        return text

    def finish(self) -> None:
        elapsed = self.clock() - self.started
        log.info(
            "downloaded %s: %s in %.1fs (%s/s)",
            self.what,
            _size(self.done),
            elapsed,
            _size(self.done / max(elapsed, 1e-9)),
        )


# -- S3


def parse_s3_uri(uri: str) -> tuple[str, str]:
    rest = uri[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ArtifactError(f"option.model_id={uri!r} names no bucket")
    return bucket, prefix


def download_root() -> Path:
    """Where ``s3://`` prefixes are downloaded (one directory each)."""
    return Path(tempfile.gettempdir()) / "sagelmi-models"


def download_dir(uri: str) -> Path:
    return download_root() / hashlib.sha256(uri.encode()).hexdigest()[:16]


def _s3_error(uri: str, bucket: str, exc: Exception) -> ArtifactError:
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    if isinstance(exc, NoCredentialsError):
        return ArtifactError(
            f"cannot download {uri}: no AWS credentials found (on SageMaker: the execution role; "
            f"elsewhere: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE)"
        )
    if isinstance(exc, EndpointConnectionError):
        return ArtifactError(f"cannot download {uri}: S3 is not reachable ({exc})")
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        if code == "NoSuchBucket":
            return ArtifactError(f"cannot download {uri}: bucket {bucket!r} does not exist")
        if code in ("AccessDenied", "403", "AllAccessDisabled"):
            return ArtifactError(
                f"cannot download {uri}: access denied (the credentials need s3:ListBucket on "
                f"{bucket!r} and s3:GetObject under the prefix)"
            )
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"):
            return ArtifactError(f"cannot download {uri}: the AWS credentials were refused ({code})")
        if code in ("PreconditionFailed", "412"):
            return ArtifactError(f"cannot download {uri}: the objects changed while they were downloaded; try again")
    return ArtifactError(f"cannot download {uri}: {exc}")


@dataclass(frozen=True)
class S3Object:
    key: str
    size: int
    etag: str


@dataclass(frozen=True)
class S3Listing:
    """The objects under an ``s3://`` prefix, as one listing saw them."""

    uri: str
    bucket: str
    prefix: str  # with its trailing '/', or empty
    objects: tuple[S3Object, ...]

    @property
    def size(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def fingerprint(self) -> str:
        """Changes when any object is added, removed or rewritten (its ETag changes)."""
        lines = sorted(f"{o.key}\0{o.size}\0{o.etag}" for o in self.objects)
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()

    def name(self, obj: S3Object) -> str:
        return obj.key[len(self.prefix) :]


def _client():
    import boto3

    return boto3.session.Session().client("s3")  # credentials looked up now, not cached from an earlier call


def list_s3(uri: str) -> S3Listing:
    """Every object under the ``s3://`` prefix (directory markers left out). Raises
    ``ArtifactError`` (no credentials, no bucket, no objects, ...)."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = parse_s3_uri(uri)
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    try:
        objects = tuple(
            S3Object(item["Key"], item["Size"], item.get("ETag", ""))
            for page in _client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for item in page.get("Contents", [])
            if item["Key"][len(prefix) :] and not item["Key"].endswith("/")
        )
    except (ClientError, BotoCoreError) as exc:
        raise _s3_error(uri, bucket, exc) from None
    if not objects:
        raise ArtifactError(
            f"cannot download {uri}: no objects under the prefix {prefix or '/'!r} in bucket {bucket!r}"
        )
    return S3Listing(uri, bucket, prefix, objects)


def _landings(listing: S3Listing, root: Path) -> list[tuple[S3Object, Path]]:
    """Each object with the file it is written to under ``root``; ``ArtifactError`` naming
    the keys that would land outside it."""
    placed = [(obj, landing(root, listing.name(obj))) for obj in listing.objects]
    refused = [obj.key for obj, path in placed if path is None]
    if refused:
        raise outside_error(refused, listing.uri)
    seen: dict[Path | None, str] = {}
    for obj, path in placed:
        if path in seen:
            raise ArtifactError(
                f"cannot download {listing.uri}: the keys {seen[path]!r} and {obj.key!r} name the same file"
            )
        seen[path] = obj.key
    return [(obj, path) for obj, path in placed if path is not None]


def _download_all(s3, bucket: str, files: list[tuple[S3Object, Path]], progress: Progress) -> None:
    """Download every ``(object, destination)`` at once: up to ``S3_CONCURRENCY`` requests in
    flight, objects larger than ``S3_PART_BYTES`` fetched in ranged parts (boto3's transfer
    manager). Real models are many shards of GBs, and one S3 connection carries a fraction of
    what an instance's network does: one object after another leaves most of it idle.

    Each transfer is told the listing's size and ETag: no HEAD request per object, and every
    GET carries ``If-Match`` with that ETag, so an object rewritten since the listing fails
    the download instead of landing with other bytes (or more of them)."""
    from boto3.s3.transfer import ProgressCallbackInvoker, TransferConfig, create_transfer_manager
    from s3transfer.subscribers import BaseSubscriber

    class Listed(BaseSubscriber):
        def __init__(self, obj: S3Object) -> None:
            self.obj = obj

        def on_queued(self, future, **kwargs) -> None:
            future.meta.provide_transfer_size(self.obj.size)
            if self.obj.etag:
                future.meta.provide_object_etag(self.obj.etag)

    config = TransferConfig(
        max_concurrency=S3_CONCURRENCY, multipart_threshold=S3_PART_BYTES, multipart_chunksize=S3_PART_BYTES
    )
    for _, destination in files:
        destination.parent.mkdir(parents=True, exist_ok=True)
    with create_transfer_manager(s3, config) as manager:  # leaving it early cancels what is left
        futures = [
            manager.download(
                bucket, obj.key, str(destination), subscribers=[Listed(obj), ProgressCallbackInvoker(progress.add)]
            )
            for obj, destination in files
        ]
        for future in futures:
            future.result()


def _fingerprint_of(directory: Path) -> str | None:
    """The listing a complete download in ``directory`` was made from (None: no complete one)."""
    try:
        return (directory / _COMPLETE).read_text()
    except OSError:
        return None


def download_s3(listing: S3Listing, target: Path, interval: float = PROGRESS_INTERVAL) -> Path:
    """Download the listed objects into ``target`` (replacing what is there); return it.

    Every key is checked first: one that would land outside the directory raises
    ``ArtifactError`` naming it, and nothing is written. The files go into a new
    directory beside ``target`` (nothing else in it, no symbolic links), renamed to
    ``target`` once all arrived with the listed sizes; a failed download leaves nothing."""
    from botocore.exceptions import BotoCoreError, ClientError

    staging = target.parent / f".partial-{uuid.uuid4().hex}"
    files = _landings(listing, staging)  # before anything is written
    staging.mkdir(mode=0o700, parents=True)
    try:
        shutil.rmtree(target, ignore_errors=True)  # an older copy: its space is needed first
        progress = Progress(listing.uri, listing.size, len(files), interval)
        try:
            _download_all(_client(), listing.bucket, files, progress)
        except (ClientError, BotoCoreError) as exc:
            raise _s3_error(listing.uri, listing.bucket, exc) from None
        except OSError as exc:  # a full disk; a key that is a file and another's directory
            raise ArtifactError(f"cannot download {listing.uri}: writing its files failed ({exc.strerror})") from None
        arrived = sum(path.stat().st_size for _, path in files)
        if arrived != listing.size:  # an endpoint that ignored If-Match
            raise ArtifactError(f"cannot download {listing.uri}: the objects changed while they were downloaded")
        (staging / _COMPLETE).write_text(listing.fingerprint)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    progress.finish()
    return target


def fetch_s3(uri: str, interval: float = PROGRESS_INTERVAL) -> Path:
    """Download every object under the ``s3://`` prefix; return the local directory: the
    copy downloaded earlier when the objects are the same, else a new download.

    Raises ``ArtifactError`` (no credentials, no bucket, no objects, a key that leads out
    of the directory, ...)."""
    listing = list_s3(uri)
    target = download_dir(uri)
    earlier = _fingerprint_of(target)
    if earlier == listing.fingerprint:
        log.info("using %s, downloaded earlier from %s (the objects are unchanged)", target, uri)
        return target
    if earlier is not None:
        log.info("the objects under %s changed since they were downloaded: downloading them again", uri)
    return download_s3(listing, target, interval)


def fetch_model(model_id: str, revision: str | None = None) -> str:
    """Where the engine and the handler find the model named by ``option.model_id``:
    a downloaded ``s3://`` prefix's directory, a Hub id (now in the cache) or a
    local directory. Raises ``ArtifactError``."""
    if model_id.startswith("s3://"):
        return str(fetch_s3(model_id))
    if Path(model_id).exists():
        return model_id
    if model_id.startswith(("/", ".", "~")) or not HUB_ID.match(model_id):
        raise ArtifactError(
            f"option.model_id={model_id!r} is neither a directory here, an s3:// URI nor a Hub model id (org/name)"
        )
    from container.core.hub_download import fetch_hub  # a module of its own: it imports this one

    fetch_hub(model_id, revision)
    return model_id
