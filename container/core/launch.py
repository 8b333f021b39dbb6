"""What the supervisor hands the processes it starts, written as JSON files:
the frontend's launch (the listening socket, the groups to route to, limits)
and each worker group's launch (its settings, handler properties, layout)."""

from __future__ import annotations

import os
from typing import Any

import msgspec

from container.core.settings import Settings


class GroupAddress(msgspec.Struct, frozen=True):
    """Where the frontend finds a worker group: its rank 0's Unix socket."""

    index: int
    socket_path: str
    devices: str | None = None  # the group's CUDA_VISIBLE_DEVICES, for /ping
    note_path: str = ""  # the supervisor's GroupNote of this group, for /ping


class GroupNote(msgspec.Struct, frozen=True):
    """What the supervisor knows of a worker group and the frontend does not, for ``/ping``:
    why its last start ended, and whether it keeps dying soon after becoming ready."""

    last_exit: str = ""
    crash_loop: bool = False
    restarts: int = 0  # deaths in a row, each soon after a start


def write_note(path: str, note: GroupNote) -> None:
    """Replace the note at ``path`` at once (a reader never sees half of it)."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(note))
    os.replace(tmp, path)


def read_note(path: str) -> GroupNote | None:
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=GroupNote)
    except (OSError, msgspec.DecodeError):
        return None


class FrontendLaunch(msgspec.Struct, frozen=True):
    listen_fd: int
    groups: list[GroupAddress]
    job_queue_size: int
    max_payload_bytes: int
    predict_timeout: float
    grace_period: float
    body_read_timeout: float = 60.0
    header_read_timeout: float = 10.0
    max_connections_per_client: int = 1000  # connections one address may hold waiting (Settings.connections_per_client)
    log_level: str = "INFO"
    log_format: str = "text"  # text or json (container.core.logs)
    traces_exporter: str = "none"  # container.core.tracing: none (off), otlp-http, otlp-grpc, console
    model: ModelInfo | None = None  # what GET /models and the adapter routes describe
    stateful_sessions: bool = True  # option.enable_stateful_sessions: sticky routing by X-Amzn-SageMaker-Session-Id
    sessions_expiration: float = 1200.0  # a session's life when its handler's answer gives no expiry


class ModelInfo(msgspec.Struct, frozen=True):
    """The served model, as the frontend's management routes know it."""

    name: str  # LMI's model name (served_names' management): GET /models and /models/{name}/...
    location: str  # its local path or Hub id
    lora: bool = False  # option.enable_lora
    max_lora_rank: int = 16  # vLLM's default when option.max_lora_rank is not set
    adapter_dirs: list[str] = []  # where adapters are found at start-up (<dir>/adapters/<name>/)
    adapter_roots: list[str] = []  # the only directories an adapter's source may be in
    adapter_downloads: str = ""  # where s3:// adapters are downloaded (the server removes it when it stops)
    max_adapter_bytes: int = 2048 * 2**20  # max_adapter_size_in_mb: the most an s3:// adapter may download
    builtin_schemas: bool = False  # the built-in vLLM engine answers, without a model.py: /openapi.json has its schemas

    @property
    def url(self) -> str:
        """Where the model came from, as clients may see it: a Hub id or an ``s3://`` URL,
        never a local path (the name then)."""
        return self.name if self.location.startswith("/") else self.location


class EngineNodes(msgspec.Struct, frozen=True):
    """vLLM's own executor across the nodes of a cluster: this node's place in it and where the
    leader's engine holds the rendezvous (vLLM's ``nnodes``, ``node_rank``, ``master_addr``,
    ``master_port``)."""

    nnodes: int
    node_rank: int  # 0: the leader's engine; k: worker node k's headless node
    master_addr: str  # the leader's cluster address, as the other nodes reach it
    master_port: int  # torch.distributed's rendezvous on the leader (ClusterConfig.engine_port)


class WorkerLaunch(msgspec.Struct, frozen=True):
    """Everything a worker group's processes need to start (every rank reads the
    same launch; in MPI mode rank 0 reads it and sends it to the others).

    ``settings`` is the server's ``Settings``, resolved by the supervisor, written
    as a JSON object and validated again when the launch is read (``decode_worker_launch``);
    ``model_properties`` is what a handler's initialisation call receives (LMI's
    ``option.*`` text plus ``model_dir``)."""

    group: int
    socket_path: str
    ready_path: str  # rank 0 writes the incarnation here once the group is ready
    settings: Settings
    model_properties: dict[str, str]
    model_location: str  # the model's local path or Hub id (an s3:// prefix already downloaded)
    tensor_parallel_degree: int  # what option.tensor_parallel_degree (max included) means in this group
    nodes: EngineNodes | None = None  # the built-in engine spans a cluster's nodes, rank 0's part here


class HeadlessLaunch(msgspec.Struct, frozen=True):
    """A worker node's part of the built-in engine across a cluster: vLLM's headless node
    (``python -m handlers.engines.vllm_node``), started by the node's supervisor for one start
    of the leader's group."""

    settings: Settings
    model_location: str
    tensor_parallel_degree: int
    nodes: EngineNodes


def _encode_settings(value: Any) -> Any:
    if isinstance(value, Settings):
        return value.model_dump(mode="json")
    raise NotImplementedError(f"a launch file cannot hold {type(value).__name__}")


def _decode_settings(tp: type, value: Any) -> Any:
    if tp is Settings:
        return Settings.model_validate(value)
    raise NotImplementedError(f"a launch file cannot hold {tp}")


def encode_launch(launch: FrontendLaunch | WorkerLaunch | HeadlessLaunch) -> bytes:
    return msgspec.json.encode(launch, enc_hook=_encode_settings)


def decode_frontend_launch(data: bytes) -> FrontendLaunch:
    return msgspec.json.decode(data, type=FrontendLaunch)


def decode_worker_launch(data: bytes) -> WorkerLaunch:
    """The launch, its ``settings`` validated into ``Settings`` (``msgspec.ValidationError`` if not)."""
    return msgspec.json.decode(data, type=WorkerLaunch, dec_hook=_decode_settings)


def decode_headless_launch(data: bytes) -> HeadlessLaunch:
    """A headless node's launch, its ``settings`` validated (``msgspec.ValidationError`` if not)."""
    return msgspec.json.decode(data, type=HeadlessLaunch, dec_hook=_decode_settings)
