"""The LoRA adapter registry: the one place that knows which adapters the server
serves. It lives in the frontend process, which outlives worker groups.

- At start it registers every ``<model dir>/adapters/<name>/`` it finds.
- ``register`` checks the source (``check_source``), sends ``SetAdapter``
  to every connected group and waits for each to load it; one refusal undoes
  the registration everywhere and is the client's error.
- An ``s3://`` source is listed first: a key that would land outside the download
  directory, or objects over ``max_adapter_size_in_mb`` in all, refuse it before
  anything is downloaded. Each registration downloads into a directory of its own
  (a registration after the objects changed gets the new ones), without holding the
  registry's lock (other registrations and listings go on meanwhile); unregistering
  the adapter, or a refused registration, removes that directory.
- Every new connection to a group starts with the whole registry
  (``GroupClient.on_connect``): a restarted group serves what was registered.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from container.core.errors import Conflict, InputError, NotFound, PayloadTooLarge, ServingError
from container.core.launch import ModelInfo
from container.core.protocol import Message, SetAdapter
from container.frontend.group_client import GroupClient
from container.frontend.pending import WorkerFailed

log = logging.getLogger("sagelmi.adapters")

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class Adapter:
    name: str
    src: str  # as the client gave it (a directory or an s3:// prefix)
    path: str  # the local directory the engine loads
    downloaded: str = ""  # the directory this registration downloaded (removed when it is unregistered)


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def check_source(directory: Path, roots: list[str], max_rank: int) -> Path:
    """The real path of the adapter in ``directory``. Raises ``InputError`` when it is
    outside ``roots`` (after resolving ``..`` and symbolic links, its files' too), is
    missing, is not a LoRA adapter (peft's ``adapter_config.json`` and weights) or
    has a rank over ``max_rank``. Messages do not repeat server paths."""
    real_roots = [os.path.realpath(r) for r in roots]
    real = os.path.realpath(directory)
    outside = (
        "the adapter source is outside the directories adapters may come from (the model directory, "
        "the download cache and option.adapter_roots)"
    )
    if not _inside(real, real_roots):
        raise InputError(outside)
    if not os.path.isdir(real):
        raise InputError("the adapter source does not exist or is not a directory")
    for entry in os.scandir(real):
        if not _inside(os.path.realpath(entry.path), real_roots):
            raise InputError(f"{outside}: {entry.name} links out of them")
    config_file = Path(real) / "adapter_config.json"
    if not config_file.is_file():
        raise InputError(
            "the adapter source is not a LoRA adapter: it has no adapter_config.json "
            "(peft's save_pretrained writes one)"
        )
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, OSError) as exc:
        raise InputError(f"the adapter's adapter_config.json is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise InputError(
            "the adapter source is not a LoRA adapter (adapter_config.json: peft_type is "
            f"{config.get('peft_type') if isinstance(config, dict) else config!r})"
        )
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise InputError(f"the adapter's adapter_config.json has no valid rank 'r' (found {rank!r})")
    if rank > max_rank:
        raise InputError(
            f"the adapter's rank r={rank} is over option.max_lora_rank={max_rank}; "
            f"raise option.max_lora_rank to at least {rank}"
        )
    if not any((Path(real) / w).is_file() for w in WEIGHTS):
        raise InputError(f"the adapter source has no weights ({' or '.join(WEIGHTS)})")
    return Path(real)


class AdapterRegistry:
    def __init__(
        self, model: ModelInfo, groups: list[GroupClient], timeout: float, download_root: str | None = None
    ) -> None:
        """``download_root``: the cache of ``s3://`` models, where local sources may be too.
        ``s3://`` adapters are downloaded under ``model.adapter_downloads`` (else
        ``<download_root or the temp directory>/adapters``), each registration in a directory
        of its own that no local source may name."""
        self.model = model
        self.groups = groups
        self.timeout = timeout
        self.roots = [*model.adapter_roots, *([download_root] if download_root else [])]
        self.downloads = Path(model.adapter_downloads or Path(download_root or tempfile.gettempdir()) / "adapters")
        self._adapters: dict[str, Adapter] = {}
        self._arriving: set[str] = set()  # names being registered (downloaded, checked, loaded)
        self._lock = threading.Lock()  # one registration change at a time
        for group in groups:
            group.on_connect = self.replay
        self._scan()

    # -- start-up
    def _scan(self) -> None:
        found = sorted(
            p for d in dict.fromkeys(self.model.adapter_dirs) for p in (Path(d) / "adapters").glob("*/") if p.is_dir()
        )
        if found and not self.model.lora:
            log.warning(
                "found %d adapter(s) under adapters/ but option.enable_lora is not true: not serving %s",
                len(found),
                ", ".join(p.name for p in found),
            )
            return
        for path in found:
            try:
                self._check_name(path.name)
                real = check_source(path, self.roots, self.model.max_lora_rank)
            except ServingError as exc:
                log.error("not serving adapter %s: %s", path.name, exc.detail)
                continue
            self._adapters[path.name] = Adapter(path.name, str(path), str(real))
            log.info("adapter %s found at start-up", path.name)

    def replay(self) -> list[Message]:
        """What a new connection to a group starts with: every registration."""
        return [
            SetAdapter(id=f"adapter-{uuid.uuid4().hex}", name=a.name, path=a.path)
            for a in list(self._adapters.values())
        ]

    # -- reading
    def list(self) -> list[Adapter]:
        return list(self._adapters.values())

    def get(self, name: str) -> Adapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            raise NotFound(
                f"adapter {name!r} is not registered (registered adapters: "
                f"{', '.join(sorted(self._adapters)) or 'none'})"
            )
        return adapter

    # -- changes
    def _check_name(self, name: str) -> None:
        if not NAME.match(name or ""):
            raise InputError(
                f"adapter name {name!r} is not valid: use letters, digits, '.', '_' or '-' "
                f"(up to 64, starting with a letter or digit)"
            )
        if name == self.model.name:
            raise InputError(f"adapter name {name!r} is the base model's name")

    def register(self, name: str, src: str) -> Adapter:
        """Fetch, check, load on every group, remember. Raises a 4xx ``ServingError`` saying why not."""
        if not self.model.lora:
            raise InputError(
                "this server does not serve LoRA adapters: start it with option.enable_lora=true "
                "(and option.max_lora_rank at least the adapters' rank)"
            )
        self._check_name(name)
        if not src:
            raise InputError("give the adapter's source: src=<directory> or src=s3://bucket/prefix")
        with self._lock:
            if name in self._adapters or name in self._arriving:
                raise Conflict(
                    f"adapter {name!r} is already registered; unregister it first "
                    f"(DELETE /adapters/{name} or DELETE /models/{self.model.name}/adapters/{name})"
                )
            self._arriving.add(name)  # the name is taken while its files download
        downloaded = None
        try:
            local, downloaded = self._local(name, src)
            roots = self.roots if downloaded is None else [str(downloaded)]
            path = check_source(local, roots, self.model.max_lora_rank)
            adapter = Adapter(name, src, str(path), str(downloaded or ""))
            with self._lock:
                self._load(adapter)
        except BaseException:
            if downloaded is not None:
                shutil.rmtree(downloaded, ignore_errors=True)
            raise
        finally:
            with self._lock:
                self._arriving.discard(name)
        log.info("adapter %s registered from %s", name, src)
        return adapter

    def _load(self, adapter: Adapter) -> None:
        """Every group loads ``adapter``; one refusal unloads it everywhere and raises. Under the lock."""
        name = adapter.name
        self._adapters[name] = adapter  # first: a group that connects meanwhile gets it in its replay
        try:
            for group in self.groups:
                group.send_adapter(
                    SetAdapter(id=f"adapter-{uuid.uuid4().hex}", name=name, path=adapter.path), self.timeout
                )
        except ServingError as exc:
            del self._adapters[name]
            self._unload_everywhere(name)
            if isinstance(exc, WorkerFailed) and exc.status < 500:
                raise InputError(f"adapter {name!r} was refused: {exc.detail}") from None
            raise

    def unregister(self, name: str) -> None:
        with self._lock:
            adapter = self.get(name)
            del self._adapters[name]
            self._unload_everywhere(name)
        if adapter.downloaded:  # the groups let it go: its files are no longer read
            shutil.rmtree(adapter.downloaded, ignore_errors=True)
        log.info("adapter %s unregistered", name)

    def _unload_everywhere(self, name: str) -> None:
        for group in self.groups:
            try:
                group.send_adapter(SetAdapter(id=f"adapter-{uuid.uuid4().hex}", name=name), self.timeout)
            except ServingError as exc:
                log.warning("worker group %s: unregistering adapter %s: %s", group.name, name, exc)

    def _local(self, name: str, src: str) -> tuple[Path, Path | None]:
        """The local directory ``src`` names, and the directory downloaded for it (None for a
        local source): an ``s3://`` prefix is downloaded first."""
        if src.startswith("s3://"):
            return self._download(name, src)
        if "://" in src:
            raise InputError("an adapter's src is a local directory or an s3:// prefix")
        path = Path(src)
        directory = (
            path if path.is_absolute() else Path(self.model.adapter_dirs[0] if self.model.adapter_dirs else ".") / path
        )
        return directory, None

    def _download(self, name: str, src: str) -> tuple[Path, Path]:
        """Download ``src`` into a new directory for this registration. Raises ``InputError``
        (a key that would land outside it, S3 errors) or ``PayloadTooLarge`` before anything
        is written."""
        from container.core.artifacts import ArtifactError, download_s3, list_s3

        try:
            listing = list_s3(src)
            limit = self.model.max_adapter_bytes
            if listing.size > limit:
                raise PayloadTooLarge(
                    f"the adapter at {src} is {listing.size / 2**20:.1f} MiB ({len(listing.objects)} objects), over "
                    f"max_adapter_size_in_mb={limit / 2**20:g} (SERVING_MAX_ADAPTER_SIZE_IN_MB); nothing was downloaded"
                )
            target = self.downloads / f"{name}-{uuid.uuid4().hex[:12]}"
            return download_s3(listing, target), target
        except ArtifactError as exc:
            raise InputError(str(exc)) from None
