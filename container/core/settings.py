"""Settings: one typed object, built by one function from the environment,
``<model-dir>/serving.properties`` and defaults. No other module reads
``os.environ`` for settings.

Names follow LMI. Precedence, weakest first:

1. defaults;
2. environment: ``OPTION_<NAME>`` (-> ``option.<name>``), ``SERVING_<KEY>``
   (-> ``<key>``), AWS's vLLM-container variables ``SM_VLLM_<ARG>``
   (``container.core.sm_vllm``) and the aliases in ``setting_keys.KEYS``
   (``HF_MODEL_ID``, ``TENSOR_PARALLEL_DEGREE``, the TGI names ...). When several
   spellings of one setting are set, the one listed first in ``KEYS`` wins (LMI's
   own name beats ``SM_VLLM_*``, which beats a Hugging Face or TGI alias; an
   ``OPTION_<NAME>`` beats the ``SM_VLLM_<ARG>`` of the same option) and a
   warning names the others;
3. ``serving.properties`` in the model directory;
4. SageMaker platform values (``SAGEMAKER_BIND_TO_PORT``, ...);
5. the command line (``--port``).

A value that does not fit stops start-up with ``SettingsError``, whose
message names the key, the value, where it came from and what is allowed.
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from container.core import sm_vllm
from container.core.lmi_options import server_entry
from container.core.logs import redacted_value
from container.core.serving_properties import read_properties
from container.core.sessions import DEFAULT_MAX_SESSIONS
from container.core.setting_keys import KEY_BY_ALIAS, KEY_BY_FIELD, KEY_BY_NAME, KEYS, option_key
from container.core.tracing import EXPORTERS, exporter_from

log = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = "/opt/ml/model"


class SettingsError(Exception):
    """A setting has a value that cannot be used; the message says which and why."""


class Settings(BaseModel):
    """The resolved settings of one server. Immutable."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_dir: str = DEFAULT_MODEL_DIR
    model_id: str | None = None
    revision: str | None = None
    task: str | None = None
    normalize: bool | None = None
    entry_point: str | None = None
    sagemaker_program: str | None = None
    default_invocations_accept: str = "application/json"
    trust_remote_code: bool = False
    quantize: str | None = None
    engine: Literal["Python", "MPI"] = "Python"
    mpi_mode: bool = False
    tensor_parallel_degree: Annotated[int, Field(ge=1)] | Literal["max"] = 1
    pipeline_parallel_degree: int = Field(default=1, ge=1)
    mpi_hostfile: str | None = None
    mpi_extra_args: str = ""
    ray_port: int = Field(default=6379, ge=1024, le=65535)  # Ray's own default for its head
    min_workers: int | None = Field(default=None, ge=1)
    max_workers: int | None = Field(default=None, ge=1)
    sync_handler_threads: int = Field(default=1, ge=1)
    rolling_batch: Literal["auto", "vllm", "lmi-dist", "disable"] = "auto"
    max_rolling_batch_size: int = Field(default=256, ge=1)
    max_rolling_batch_prefill_tokens: int | None = Field(default=None, ge=1)
    output_formatter: Literal["json", "jsonlines", "sse"] = "jsonlines"
    tgi_compat: bool = False
    adapter_roots: str = ""
    max_adapter_size_in_mb: float = Field(default=2048.0, gt=0)
    max_image_pixels: int = Field(default=50_000_000, ge=1)
    allowed_media_networks: str = ""
    trust_request_mm_kwargs: bool = False
    enable_stateful_sessions: bool = True
    sessions_path: str | None = None
    sessions_expiration: int = Field(default=1200, ge=1)
    max_sessions: int = Field(default=DEFAULT_MAX_SESSIONS, ge=1)
    port: int = Field(default=8080, ge=1, le=65535)
    batch_size: int = Field(default=1, ge=1)
    max_batch_delay: float = Field(default=100.0, ge=0)
    job_queue_size: int = Field(default=1000, ge=1)
    max_payload_in_mb: float = Field(default=6.0, gt=0)
    max_prompts_per_request: int = Field(default=1024, ge=1)  # as vLLM's VLLM_MAX_COMPLETION_PROMPTS
    max_multipart_parts: int = Field(default=1000, ge=1)
    body_read_timeout: float = Field(default=60.0, gt=0)
    header_read_timeout: float = Field(default=10.0, gt=0)
    max_connections_per_client: int | None = Field(default=None, ge=1)
    predict_timeout: float = Field(default=120.0, gt=0)
    model_loading_timeout: float = Field(default=1800.0, gt=0)
    shutdown_grace_period: float = Field(default=25.0, ge=0)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"

    cuda_visible_devices: str | None = None
    """``CUDA_VISIBLE_DEVICES`` as the server found it (None: unset)."""
    traces_exporter: Literal["none", "otlp-http", "otlp-grpc", "console"] = "none"
    """Where spans go, from OpenTelemetry's ``OTEL_*`` variables (``container.core.tracing``); none: off."""
    options: dict[str, str] = Field(default_factory=dict)
    """Every ``option.*`` as given (name without the prefix), for the handler."""
    sources: dict[str, str] = Field(default_factory=dict)
    """Where each value came from, by ``serving.properties`` key."""

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_case(cls, value):
        if isinstance(value, str):
            return {"python": "Python", "mpi": "MPI"}.get(value.strip().lower(), value)
        return value

    @field_validator("tensor_parallel_degree", "log_level", mode="before")
    @classmethod
    def _words_case(cls, value):
        if isinstance(value, str):
            word = value.strip()
            return word.lower() if word.lower() == "max" else word.upper() if word.isalpha() else word
        return value

    @field_validator("rolling_batch", "output_formatter", "log_format", mode="before")
    @classmethod
    def _lower_case(cls, value):
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("mpi_extra_args")
    @classmethod
    def _shell_words(cls, value: str) -> str:
        try:
            shlex.split(value)
        except ValueError as exc:
            raise ValueError(f"cannot split into arguments ({exc})") from None
        return value

    @field_validator("allowed_media_networks")
    @classmethod
    def _networks(cls, value: str) -> str:
        _networks(value)
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if self.min_workers and self.max_workers and self.min_workers > self.max_workers:
            raise ValueError(
                f"min_workers={self.min_workers} ({self.sources.get('min_workers')}) is larger than "
                f"max_workers={self.max_workers} ({self.sources.get('max_workers')})"
            )
        return self

    @property
    def mpi_mode_on(self) -> bool:
        """MPI mode is asked for (engine=MPI or option.mpi_mode=true). It makes worker groups mpirun
        jobs for a user's handler only: the built-in vLLM engine runs on vLLM's own executor either way
        (``handler_choice.mpirun_groups``)."""
        return self.engine == "MPI" or self.mpi_mode

    @property
    def builtin_engine(self) -> str:
        """The built-in handler's name: ``vllm``, ``lmi-dist`` (LMI's name for it under MPI mode; the same
        vLLM engine, on vLLM's executor) or ``disable``."""
        if self.rolling_batch == "auto":
            return "lmi-dist" if self.mpi_mode_on else "vllm"
        return self.rolling_batch

    @property
    def max_payload_bytes(self) -> int:
        return int(self.max_payload_in_mb * 1024 * 1024)

    @property
    def max_adapter_bytes(self) -> int:
        return int(self.max_adapter_size_in_mb * 1024 * 1024)

    @property
    def allowed_media_network_list(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        return _networks(self.allowed_media_networks)

    @property
    def connections_per_client(self) -> int:
        """``max_connections_per_client``, or when unset ``job_queue_size``: a client that sent
        that many requests at once (SageMaker's proxy) keeps every connection it used."""
        return self.max_connections_per_client or self.job_queue_size

    @property
    def priority_scheduling(self) -> bool:
        """Requests are ordered by their priority (``option.scheduling_policy=priority``, vLLM's
        engine argument; ``container.core.request_priority``), in the engine and in the worker's
        queue; else first-come, and a request naming a priority is refused."""
        return self.options.get("scheduling_policy", "").strip() == "priority"

    @property
    def mpi_extra_args_list(self) -> list[str]:
        return shlex.split(self.mpi_extra_args)

    def engine_settings(self, tensor_parallel_degree: int) -> dict[str, Any]:
        """The typed settings that are vLLM engine arguments, by engine argument
        name (the model location is the caller's); ``tensor_parallel_degree`` is
        the number a group uses (what ``max`` stands for)."""
        out: dict[str, Any] = {}
        for k in KEYS:
            value = getattr(self, k.field)
            if k.engine_arg and k.engine_arg != "model" and value is not None:
                out[k.engine_arg] = value
        out["tensor_parallel_size"] = tensor_parallel_degree
        return out

    def passthrough_options(self) -> dict[str, str]:
        """``option.*`` values that are not sagelmi settings (name without the prefix):
        handler properties, and for the built-in engine, vLLM engine arguments."""
        typed = {k.key[len("option.") :] for k in KEYS if k.key.startswith("option.")}
        return {name: value for name, value in self.options.items() if name not in typed}

    def model_properties(
        self, model_id: str | None = None, tensor_parallel_degree: int | None = None
    ) -> dict[str, str]:
        """What a handler's initialisation call receives, as LMI gives it: every
        ``option.*`` as text (name without the prefix), the other keys given in
        ``serving.properties`` (``batch_size`` ...) and ``model_dir``.
        ``model_id``: where the model really is (a downloaded ``s3://`` prefix);
        ``tensor_parallel_degree``: the number ``max`` stands for in this group."""
        properties = {
            k.key: _text(getattr(self, k.field))
            for k in KEYS
            if not k.key.startswith("option.") and self.sources.get(k.key, "").startswith("serving.properties")
        }
        properties.update(self.options)
        properties["model_dir"] = self.model_dir
        if model_id is not None:
            properties["model_id"] = model_id
        if tensor_parallel_degree is not None:
            properties["tensor_parallel_degree"] = str(tensor_parallel_degree)
        return properties


def _networks(text: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """``10.0.0.0/8, fd00::/8`` -> the networks; ValueError naming the first that is not a CIDR range."""
    networks = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item))
        except ValueError as exc:
            raise ValueError(f"{item!r} is not a CIDR range ({exc})") from None
    return networks


def _text(value) -> str:
    """A setting's value as ``serving.properties`` text (``100``, not ``100.0``)."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _canonical(key: str) -> str:
    return option_key(key[len("option.") :]) if key.lower().startswith("option.") else key


def _nearest(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


class _Layers:
    """Raw values by key with their source; later layers overwrite earlier ones."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[str, str]] = {}

    def set(self, key: str, value: str, source: str) -> None:
        self.values[key] = (value, source)


def _read_env(env: Mapping[str, str], layers: _Layers) -> None:
    env = _read_sm_vllm(env, layers)
    spelled: set[str] = set()
    for k in KEYS:
        found = [(name, env[name]) for name in k.env if env.get(name, "") != ""]
        spelled.update(k.env)
        if not found:
            continue
        name, value = found[0]
        layers.set(k.key, value, f"env {name}")
        for other, other_value in found[1:]:
            if other_value != value:
                log.warning(
                    "%s=%s is ignored: %s=%s sets %s",
                    other,
                    redacted_value(other, other_value),
                    name,
                    redacted_value(name, value),
                    k.key,
                )
    for name, value in env.items():
        if name in spelled or value == "":
            continue
        if name.startswith("OPTION_") and len(name) > len("OPTION_"):
            key = option_key(name[len("OPTION_") :])
            _warn_if_overriding_sm_vllm(layers, key, name, value)
            layers.set(key, value, f"env {name}")
        elif name.startswith("SERVING_") and len(name) > len("SERVING_"):
            entry = server_entry(name[len("SERVING_") :])  # LMI: <key> -> SERVING_<KEY>
            if entry is not None and entry.warning(value):
                log.warning("environment variable %s: %s", name, entry.warning(value))
                continue
            known = [n for k in KEYS for n in k.env if n.startswith("SERVING_")]
            log.warning(
                "environment variable %s is not a sagelmi setting and is ignored%s", name, _nearest(name, known)
            )


def _read_sm_vllm(env: Mapping[str, str], layers: _Layers) -> dict[str, str]:
    """AWS's vLLM-container variables: ``env`` with their values as that container passes them
    (``sm_vllm.read_environment``), and ``layers`` given those that are not a spelling of a
    sagelmi setting as ``option.<arg>``. Raises ``SettingsError`` for a name vLLM has no
    argument for (before anything is downloaded), whatever its value."""
    spelled = {name for k in KEYS for name in k.env}
    try:
        env, left_out = sm_vllm.read_environment(env)
        for name in sorted(n for n in env if n.startswith(sm_vllm.PREFIX) and n not in spelled):
            layers.set(sm_vllm.option_key(name, spelled), env[name], f"env {name}")
        for name in left_out:
            if name.upper() not in spelled:
                sm_vllm.option_key(name.upper(), spelled)
            log.warning(
                "%s is left out, as AWS's vLLM container leaves out the flag of a false or [] value: its "
                "argument keeps its default (to give it false, use OPTION_%s=false)",
                name,
                sm_vllm.argument(name).upper(),
            )
    except sm_vllm.SmVllmError as exc:
        raise SettingsError(str(exc)) from None
    return env


def _warn_if_overriding_sm_vllm(layers: _Layers, key: str, name: str, value: str) -> None:
    earlier = layers.values.get(key)
    if earlier is not None and earlier[1].startswith(f"env {sm_vllm.PREFIX}") and earlier[0] != value:
        other = earlier[1].removeprefix("env ")
        log.warning(
            "%s=%s is ignored: %s=%s sets %s",
            other,
            redacted_value(other, earlier[0]),
            name,
            redacted_value(name, value),
            key,
        )


def _read_file(model_dir: Path, layers: _Layers) -> None:
    for raw_key, (value, line) in read_properties(model_dir / "serving.properties").items():
        key = _canonical(raw_key)
        key = KEY_BY_ALIAS[key].key if key in KEY_BY_ALIAS else key
        source = f"serving.properties line {line}"
        entry = server_entry(key)
        if key.startswith("option.") or key in KEY_BY_NAME:
            layers.set(key, value, source)
        elif entry is not None and entry.handling == "warn":
            log.warning("%s (%s)", entry.warning(), source)  # LMI's name: say what sagelmi does instead
        else:
            log.warning(
                "%s=%s (%s) is not a sagelmi setting and is ignored%s",
                raw_key,
                redacted_value(raw_key, value),
                source,
                _nearest(raw_key, [k.key for k in KEYS if not k.key.startswith("option.")]),
            )


def _read_sagemaker(env: Mapping[str, str], layers: _Layers) -> None:
    for k in KEYS:
        for name in k.sagemaker:
            if env.get(name, "") != "":
                layers.set(k.key, env[name], f"SageMaker {name}")
                break


def _explain(exc: ValidationError, layers: _Layers) -> SettingsError:
    err = exc.errors()[0]
    loc = err.get("loc") or ()
    field = str(loc[0]) if loc else ""
    spec = KEY_BY_FIELD.get(field)
    if spec is None:  # a cross-field check: its message names the values
        return SettingsError(f"invalid settings: {err['msg'].removeprefix('Value error, ')}")
    value, source = layers.values.get(spec.key, (None, "default"))
    return SettingsError(
        f"invalid setting {spec.key}={value!r} (from {source}): {err['msg']}. Allowed: {spec.allowed}."
    )


def resolve_settings(
    env: Mapping[str, str], model_dir: str | Path = DEFAULT_MODEL_DIR, port: int | None = None
) -> Settings:
    """Build the settings from ``env``, ``<model_dir>/serving.properties``,
    SageMaker's variables and an optional command-line ``port``.

    Raises ``SettingsError`` for a value that does not fit."""
    model_dir = Path(model_dir).absolute()
    layers = _Layers()
    _read_env(env, layers)
    _read_file(model_dir, layers)
    _read_sagemaker(env, layers)
    if port is not None:
        layers.set("port", str(port), "command line --port")

    # raw text by field name: Settings' validation converts it (a value that does not fit is a SettingsError)
    typed: dict[str, Any] = {
        KEY_BY_NAME[key].field: value for key, (value, _) in layers.values.items() if key in KEY_BY_NAME
    }
    options = {key[len("option.") :]: value for key, (value, _) in layers.values.items() if key.startswith("option.")}
    sources = {k.key: layers.values.get(k.key, (None, "default"))[1] for k in KEYS}
    sources.update({key: source for key, (_, source) in layers.values.items()})
    typed["traces_exporter"] = traces_exporter = exporter_from(env)
    if traces_exporter not in EXPORTERS:
        raise SettingsError(
            f"OTEL_TRACES_EXPORTER / OTEL_EXPORTER_OTLP_*PROTOCOL ask for the span exporter {traces_exporter!r}; "
            f"sagelmi exports spans with otlp (http/protobuf or grpc), console or none"
        )
    try:
        return Settings(
            model_dir=str(model_dir),
            cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
            options=options,
            sources=sources,
            **typed,
        )
    except ValidationError as exc:
        raise _explain(exc, layers) from None


def describe_settings(settings: Settings) -> list[tuple[str, str, str]]:
    """Rows of ``(key, value, source)`` for every setting and passthrough option, to log or
    print: a secret's value (``option.hf_token`` ...) is ``***``."""
    rows = []
    for k in KEYS:
        value = getattr(settings, k.field)
        rows.append(
            (k.key, "" if value is None else str(redacted_value(k.key, value)), settings.sources.get(k.key, "default"))
        )
    typed = {k.key for k in KEYS}
    for name, value in sorted(settings.options.items()):
        key = f"option.{name}"
        if key not in typed:
            rows.append((key, redacted_value(key, value), settings.sources.get(key, "?") + " (passed to the handler)"))
    return rows


def reference_table() -> str:
    """The configuration reference as a Markdown table (docs/configuration.md embeds it)."""
    lines = [
        "| setting | environment | SageMaker override | default | allowed | meaning |",
        "|---|---|---|---|---|---|",
    ]
    defaults = Settings()
    for k in KEYS:
        default = getattr(defaults, k.field)
        env = ", ".join(f"`{n}`" for n in k.env)
        sagemaker = ", ".join(f"`{n}`" for n in k.sagemaker)
        lines.append(
            f"| `{k.key}` | {env} | {sagemaker} | {'' if default in (None, '') else f'`{default}`'} | "
            f"{k.allowed} | {k.doc} |"
        )
    return "\n".join(lines)
