"""What the supervisor tells the frontend process at start (written as JSON)."""

from __future__ import annotations

import msgspec


class GroupSpec(msgspec.Struct, frozen=True):
    index: int
    socket_path: str
    devices: str | None = None


class FrontendSpec(msgspec.Struct, frozen=True):
    listen_fd: int
    groups: list[GroupSpec]
    job_queue_size: int
    max_payload_bytes: int
    predict_timeout: float
    grace_period: float
    log_level: str = "INFO"


def encode_spec(spec: FrontendSpec) -> bytes:
    return msgspec.json.encode(spec)


def decode_spec(data: bytes) -> FrontendSpec:
    return msgspec.json.decode(data, type=FrontendSpec)
