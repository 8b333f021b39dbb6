"""Downloads from the Hugging Face Hub, into the Hub cache (``container.core.artifacts``
describes what is downloaded and how it is logged; this module is its Hub half)."""

from __future__ import annotations

import glob
import logging
import threading
from pathlib import Path

from container.core.artifacts import PROGRESS_INTERVAL, ArtifactError, Progress, landing, outside_error

log = logging.getLogger("sagelmi.artifacts")

# Weight formats no engine here loads; and, when safetensors are there, the other formats of the same weights.
_NEVER = ("*.msgpack", "*.h5", "*.ot", "*.onnx", "*.onnx_data", "*.tflite", "*.mlmodel")
_DUPLICATES_OF_SAFETENSORS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "original/*")


def selected_files(files: list[str]) -> list[str]:
    """The repository's files worth downloading (see the module docstring)."""
    from fnmatch import fnmatch

    skip = _NEVER + (_DUPLICATES_OF_SAFETENSORS if any(f.endswith(".safetensors") for f in files) else ())
    return [f for f in files if not any(fnmatch(f, pattern) for pattern in skip)]


def hub_failures() -> tuple[type[Exception], ...]:
    """What huggingface_hub raises when a repository cannot be read: the Hub's answers
    (``HfHubHTTPError``), the transport's errors (the HTTP client's base class, which those
    extend), a file neither on the Hub nor in the cache, offline mode (``OSError``s)."""
    from huggingface_hub.errors import HfHubHTTPError

    return (OSError, *HfHubHTTPError.__bases__)


def hub_error(repo_id: str, revision: str | None, exc: Exception) -> ArtifactError:
    """``exc``, raised by huggingface_hub for ``repo_id``, as one line saying what to change."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"Hub model {repo_id!r}"
    if isinstance(exc, GatedRepoError):
        return ArtifactError(f"{where} is gated: set HF_TOKEN to a token of an account that was granted access")
    if isinstance(exc, RepositoryNotFoundError):
        return ArtifactError(
            f"{where} not found (a private model needs HF_TOKEN; check the spelling of option.model_id / HF_MODEL_ID)"
        )
    if isinstance(exc, RevisionNotFoundError):
        return ArtifactError(f"{where} has no revision {revision!r} (option.revision / HF_REVISION)")
    if isinstance(exc, LocalEntryNotFoundError):
        return ArtifactError(
            f"{where} is not in the cache and the Hub could not be reached "
            f"(HF_ENDPOINT, proxy settings, HF_HUB_OFFLINE)"
        )
    if isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code == 401:
        return ArtifactError(f"{where}: the Hub refused HF_TOKEN (401)")
    return ArtifactError(f"cannot download {where}: {exc}")


class _CacheWatcher:
    """Feeds ``progress`` with the bytes under a Hub cache folder (downloads in
    flight included), polled once a second from a thread."""

    def __init__(self, folder: Path, progress: Progress) -> None:
        self.folder, self.progress = folder, progress
        self.initial = self._bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="download-progress", daemon=True)

    def _bytes(self) -> int:
        blobs = self.folder / "blobs"
        return sum(p.stat().st_size for p in blobs.iterdir() if p.is_file()) if blobs.is_dir() else 0

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.progress.set(self._bytes() - self.initial)
            except OSError:  # a file renamed between listing and stat
                pass

    def __enter__(self) -> _CacheWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.progress.set(self._bytes() - self.initial)


def fetch_hub(repo_id: str, revision: str | None = None, interval: float = PROGRESS_INTERVAL) -> str:
    """Download a Hub model into the Hub cache; return its local snapshot directory.

    Raises ``ArtifactError`` (repository, revision or token problems, Hub unreachable
    and nothing cached)."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import DryRunError, HfHubHTTPError, LocalEntryNotFoundError
        from huggingface_hub.file_download import repo_folder_name
    except ImportError:
        raise ArtifactError(
            f"option.model_id={repo_id!r} is a Hub model id, and downloading it needs the "
            f"huggingface_hub package (installed with the cpu and gpu extras)"
        ) from None

    try:
        listing = None if constants.HF_HUB_OFFLINE else snapshot_download(repo_id, revision=revision, dry_run=True)
    except DryRunError:
        listing = None  # unreachable, or refused: the real call below says which, or finds the cache
    except (HfHubHTTPError, LocalEntryNotFoundError, ValueError) as exc:
        raise hub_error(repo_id, revision, exc) from None
    folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    try:
        if listing is None:  # the cache alone: nothing is downloaded
            return snapshot_download(repo_id, revision=revision)
        refused = [f.filename for f in listing if landing(folder / "snapshots" / f.commit_hash, f.filename) is None]
        if refused:
            raise outside_error(refused, f"Hub model {repo_id!r}")
        wanted = selected_files([f.filename for f in listing])
        # Patterns that match these names only (a name may hold '*', '?' or '['), should the
        # repository list other files by the time the download lists it again.
        patterns = [glob.escape(f) for f in wanted]
        pending = [f for f in listing if f.filename in wanted and f.will_download]
        if not pending:
            log.info("Hub model %s is in the cache", repo_id)
            return snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
        progress = Progress(f"{repo_id} from the Hub", sum(f.file_size or 0 for f in pending), len(pending), interval)
        with _CacheWatcher(folder, progress):
            path = snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
        progress.finish()
        return path
    except (HfHubHTTPError, LocalEntryNotFoundError, ValueError) as exc:
        raise hub_error(repo_id, revision, exc) from None
