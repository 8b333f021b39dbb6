"""``SagelmiModel``: the sagelmi image as a SageMaker model, with the container's settings as
typed keyword arguments, on either major of the ``sagemaker`` SDK (``sagemaker_sdk.sdk_major``:
a ``sagemaker.model.Model`` with 2.x, the ``sagemaker-core`` resources with 3.x)."""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from container.core.devices import resolve_tensor_parallel
from container.core.instances import INSTANCES
from container.core.setting_keys import option_key
from container.core.settings import SettingsError
from sagemaker_sdk import sizing
from sagemaker_sdk.component import InferenceComponentConfig
from sagemaker_sdk.env import ContainerEnv, build_container_env, env_name, env_text
from sagemaker_sdk.predictor import SagelmiPredictor
from sagemaker_sdk.sdk_major import ModelBase

log = logging.getLogger(__name__)

# SagelmiModel keyword -> the serving.properties key it sets. The names DJLModel shares
# (sagemaker.djl_inference) mean what they mean there; docs/sdk.md compares the two.
TYPED_SETTINGS = {
    "model_id": "option.model_id",
    "task": "option.task",
    "engine": "engine",
    "tensor_parallel_degree": "option.tensor_parallel_degree",
    "pipeline_parallel_degree": "option.pipeline_parallel_degree",
    "max_rolling_batch_size": "option.max_rolling_batch_size",
    "dtype": "option.dtype",
    "mpi_mode": "option.mpi_mode",
    "rolling_batch": "option.rolling_batch",
    "min_workers": "min_workers",
    "max_workers": "max_workers",
    "job_queue_size": "job_queue_size",
    "parallel_loading": "option.parallel_loading",
    "model_loading_timeout": "option.model_loading_timeout",
    "prediction_timeout": "option.predict_timeout",
}
# Arguments of sagemaker's Model or DJLModel that have no meaning for the sagelmi image, and why.
_REFUSED = {
    **dict.fromkeys(
        ("entry_point", "source_dir", "dependencies", "git_config"),
        "the container reads its handler from the model directory; pass handler_dir= (a directory with model.py)",
    ),
    **dict.fromkeys(
        ("djl_version", "djl_framework"),
        "they pick one of AWS's DJL images; the sagelmi image is image_uri= (your ECR repository)",
    ),
}
_LOCAL = ("local", "local_gpu")


def _model_data_source(model_data: Any) -> Any:
    """``s3://.../`` (a prefix: the model's files as they are) -> an uncompressed
    ``ModelDataSource``, which SageMaker copies to /opt/ml/model; a ``.tar.gz`` or
    a dict is passed on as it is."""
    if isinstance(model_data, str) and model_data.startswith("s3://") and model_data.endswith("/"):
        return {"S3DataSource": {"S3Uri": model_data, "S3DataType": "S3Prefix", "CompressionType": "None"}}
    return model_data


def _gb(size: float | None) -> str:
    return "unknown" if size is None else f"{size:.3g}"


def pack_directory(directory: Path) -> bytes:
    """``directory``'s files as a gzipped tar with the files at its root (what
    SageMaker unpacks into /opt/ml/model); the same files give the same bytes."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for path in sorted(directory.rglob("*")):
            relative = path.relative_to(directory)
            if "__pycache__" in relative.parts or not (path.is_file() or path.is_dir()):
                continue
            info = tar.gettarinfo(str(path), arcname=str(relative))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if path.is_file():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return gzip.compress(raw.getvalue(), mtime=0)


def _with_token(env: dict[str, Any], token: str | None) -> dict[str, Any]:
    """``env`` with ``HF_TOKEN`` set to ``token`` (refused when ``env`` has another)."""
    if token is None:
        return env
    if env.get("HF_TOKEN") not in (None, token):
        raise ValueError("HF_TOKEN is given twice: huggingface_hub_token= and env['HF_TOKEN'] differ; give it once")
    return {**env, "HF_TOKEN": token}


class DoesNotFit(ValueError):
    """The model cannot run on the instance type with these settings; the message gives the numbers."""


class SagelmiModel(ModelBase):
    """The sagelmi image on SageMaker, with the container's settings as arguments.

    The model: ``model_id`` (the first positional argument, as DJLModel's: a Hub
    id, or an ``s3://`` prefix the container downloads), ``model_data`` (S3 data
    SageMaker puts in /opt/ml/model: a ``model.tar.gz``, or a prefix ending in
    ``/`` copied as it is), and/or ``handler_dir`` (a local directory with
    ``model.py``, ``serving.properties``, ``requirements.txt`` ..., packed and
    uploaded to the session's default bucket as the model data).

    Settings, named as ``sagemaker.djl_inference.DJLModel`` names them where it has
    them: ``task``, ``engine`` (``"Python"`` / ``"MPI"``), ``dtype``,
    ``tensor_parallel_degree`` (a number or ``"max"``), ``min_workers``,
    ``max_workers``, ``job_queue_size``, ``parallel_loading``,
    ``model_loading_timeout``, ``prediction_timeout`` (seconds),
    ``huggingface_hub_token`` (``HF_TOKEN``: the container downloads a gated or
    private Hub model with it, and ``deploy()`` reads the model's config with it);
    sagelmi's own: ``pipeline_parallel_degree``, ``max_rolling_batch_size``,
    ``mpi_mode``, ``rolling_batch`` (``"vllm"`` / ``"lmi-dist"``), ``options``
    (any other ``option.<name>``: engine arguments such as ``max_model_len``, or
    your handler's properties) and ``env`` (more variables, passed as they are).
    They become the variables the container reads (``OPTION_*``, ``SERVING_*``)
    and are checked here as the container checks them: a value it would refuse
    raises ``SettingsError``, an engine option it does not know
    ``EngineOptionError``, with the container's message, before any AWS call; a
    setting given twice (an argument and ``env``) is refused too, where DJLModel
    keeps ``env``'s. Engine options are checked when the built-in engine serves
    (no ``model.py`` with ``handle`` in ``handler_dir``, no ``option.entryPoint``; a
    ``model_data`` that holds a ``model.py`` should say ``options={"entryPoint": "model.py"}``).

    ``model_size_gb`` sizes the deploy timeouts (``sagemaker_sdk.sizing``); the
    other keyword arguments are ``sagemaker.model.Model``'s with sagemaker 2.x (``image_uri``,
    ``role``, ``name``, ``sagemaker_session``, ``vpc_config`` ...), and those of them that
    apply with 3.x (``sagemaker_sdk.sdk_v3.ModelBase``). Script mode
    (``entry_point``, ``source_dir`` ...) and DJLModel's image choice
    (``djl_version``, ``djl_framework``) are refused with a ``TypeError`` saying what to use."""

    model_data: Any  # set by the SDK's model; a handler directory's upload replaces None

    def __init__(
        self,
        model_id: str | None = None,
        *,
        model_data: Any = None,
        handler_dir: str | Path | None = None,
        task: str | None = None,
        engine: str | None = None,
        tensor_parallel_degree: int | str | None = None,
        pipeline_parallel_degree: int | None = None,
        max_rolling_batch_size: int | None = None,
        dtype: str | None = None,
        mpi_mode: bool | None = None,
        rolling_batch: str | None = None,
        min_workers: int | None = None,
        max_workers: int | None = None,
        job_queue_size: int | None = None,
        parallel_loading: bool = False,
        model_loading_timeout: int | None = None,
        prediction_timeout: int | None = None,
        huggingface_hub_token: str | None = None,
        options: dict[str, Any] | None = None,
        env: dict[str, Any] | None = None,
        model_size_gb: float | None = None,
        image_uri: str | None = None,
        role: str | None = None,
        predictor_cls=SagelmiPredictor,
        **kwargs,
    ) -> None:
        for name, why in _REFUSED.items():
            if kwargs.get(name) is not None:
                raise TypeError(f"SagelmiModel takes no {name}=: {why}")
        if handler_dir is not None and model_data is not None:
            raise ValueError(
                "give handler_dir or model_data, not both: both become /opt/ml/model. Put the handler "
                "files into the model data, or give the weights as model_id='s3://...'"
            )
        if model_id is not None and model_data is not None:
            raise ValueError(
                "give model_id or model_data, not both: model_id names where the weights are, "
                "model_data what SageMaker puts in /opt/ml/model (use handler_dir for handler files)"
            )
        self.handler_dir = Path(handler_dir).absolute() if handler_dir is not None else None
        self.model_size_gb = model_size_gb
        typed = dict(
            model_id=model_id,
            task=task,
            engine=engine,
            tensor_parallel_degree=tensor_parallel_degree,
            pipeline_parallel_degree=pipeline_parallel_degree,
            max_rolling_batch_size=max_rolling_batch_size,
            dtype=dtype,
            mpi_mode=mpi_mode,
            rolling_batch=rolling_batch,
            min_workers=min_workers,
            max_workers=max_workers,
            job_queue_size=job_queue_size,
            parallel_loading=parallel_loading or None,  # False is LMI's default: not set, as DJLModel
            model_loading_timeout=model_loading_timeout,
            prediction_timeout=prediction_timeout,
        )
        self.container = self._container_env(typed, options or {}, _with_token(env or {}, huggingface_hub_token))
        if not self.container.settings.model_id and model_data is None and self.handler_dir is None:
            raise ValueError("nothing to serve: give model_id (a Hub id or s3:// prefix), model_data or handler_dir")
        # Checked before this: the SDK's model may read config files and sessions.
        super().__init__(
            image_uri=image_uri,
            model_data=_model_data_source(model_data),
            role=role,
            predictor_cls=predictor_cls,
            env=dict(self.container.env),
            **kwargs,
        )

    def _container_env(self, typed: dict[str, Any], options: dict[str, Any], env: dict[str, Any]) -> ContainerEnv:
        settings = {TYPED_SETTINGS[name]: value for name, value in typed.items() if value is not None}
        for name, value in options.items():
            key = option_key(name)
            if key in settings:
                given = next((n for n, k in TYPED_SETTINGS.items() if k == key), None)
                first = f"{given}={settings[key]!r}" if given else f"options[...]={settings[key]!r}"
                raise SettingsError(f"{key} is given twice: {first} and options[{name!r}]={value!r}; give it once")
            settings[key] = value
        return build_container_env(settings, env, self.handler_dir)

    @property
    def settings(self):
        """The settings the container will resolve (``container.core.settings.Settings``)."""
        return self.container.settings

    # -- model data --------------------------------------------------------------------

    def _prepare_model_data(self) -> None:
        """Before the model is created: a ``handler_dir`` becomes the model data."""
        if self.handler_dir is not None and self.model_data is None:
            self.model_data = self._upload_handler_dir()

    def _upload_handler_dir(self) -> str:
        """Pack ``handler_dir`` and upload it to the session's default bucket (or
        ``code_location``); the S3 URI of the ``model.tar.gz``."""
        assert self.handler_dir is not None  # _prepare_model_data uploads a handler_dir only
        packed = pack_directory(self.handler_dir)
        digest = hashlib.sha256(packed).hexdigest()[:12]
        with tempfile.TemporaryDirectory(prefix="sagelmi-sdk-") as tmp:
            archive = Path(tmp) / "model.tar.gz"
            archive.write_bytes(packed)
            uri = self._upload_archive(archive, f"handler-{digest}")
        log.info("uploaded %s (%d bytes) to %s", self.handler_dir, len(packed), uri)
        return uri

    # -- deploy ------------------------------------------------------------------------

    def model_data_size(self) -> float | None:
        """The size of what SageMaker copies to /opt/ml/model, in GB (None: unknown)."""
        data = self.model_data
        if isinstance(data, dict):
            data = data.get("S3DataSource", {}).get("S3Uri")
        if self.settings.model_id is None and self.model_size_gb is not None:
            return float(self.model_size_gb)  # the model is the model data
        if isinstance(data, str) and data.startswith("s3://"):
            return sizing.s3_gb(self._s3_client(), data)
        if self.handler_dir is not None:
            return sizing.directory_gb(self.handler_dir)
        return None

    def model_size(self) -> float | None:
        """The model's size in GB (None: unknown): ``model_size_gb``, else the S3
        objects of an ``s3://`` ``model_id``, else a Hub model's files (the Hub API,
        with the model's ``HF_TOKEN``), else the model data when the model is in it."""
        model_id = self.settings.model_id
        if self.model_size_gb is not None:
            return float(self.model_size_gb)
        if model_id is None:
            return self.model_data_size()
        if model_id.startswith("s3://"):
            return sizing.s3_gb(self._s3_client(), model_id)
        if Path(model_id).is_absolute():  # a path inside the container (the model data's)
            return self.model_data_size()
        return sizing.hub_gb(model_id, self.settings.revision, self.hub_token)

    @property
    def hub_token(self) -> str | bool:
        """The token the Hub is asked with: the model's ``HF_TOKEN``, which the container
        will download with; without one, False (no token: the container has none either)."""
        return self.env.get("HF_TOKEN") or False

    def deploy(
        self,
        initial_instance_count: int | None = 1,
        instance_type: str | None = None,
        *args,
        model_data_download_timeout: int | None = None,
        container_startup_health_check_timeout: int | None = None,
        check_fit: bool = True,
        inference_component: InferenceComponentConfig | bool | None = None,
        **kwargs,
    ):
        """Create the model, the endpoint configuration and the endpoint; returns a
        ``SagelmiPredictor`` on it. With sagemaker 2.x this is ``sagemaker.model.Model.deploy``
        and takes its arguments; with 3.x the arguments ``sagemaker_sdk.sdk_v3`` lists.
        ``container_startup_health_check_timeout`` and ``model_data_download_timeout`` are
        set from the model's size unless given (see ``sagemaker_sdk.sizing``); the
        container's ``option.model_loading_timeout``, unless set, follows a startup
        timeout longer than its default.

        ``inference_component`` (an ``InferenceComponentConfig``, or True for its defaults)
        deploys the model as a SageMaker inference component: an endpoint without a model,
        then the model placed on it with the accelerators, memory and copies asked for; the
        predictor's requests name the component. With 3.x ``deploy()`` waits for the endpoint
        before it adds the component (``wait=False`` does not wait for the component).

        With ``check_fit`` (the default), a model whose ``config.json`` can be read
        (``handler_dir``, or a Hub ``model_id``) is planned on ``instance_type`` (on one
        component's accelerators) as ``sagelmi plan`` does, and a configuration that cannot
        fit raises ``DoesNotFit`` before anything is created in AWS; ``check_fit=False`` goes ahead.

        ``instance_type="local"`` (SageMaker's local mode) is refused: run the model on
        this machine with ``sagemaker_sdk.local.LocalEndpoint`` (docs/sdk.md says why)."""
        if instance_type in _LOCAL:
            raise ValueError(
                f"deploy(instance_type={instance_type!r}) is not supported: SageMaker's local mode runs the "
                "image without the shared memory and limits vLLM needs and cannot stream. Use "
                "sagemaker_sdk.local.LocalEndpoint(model, mode='docker' | 'podman' | 'process') instead"
            )
        if not self.image_uri:
            raise ValueError(
                "image_uri is required: the sagelmi image in your ECR registry "
                "(<account>.dkr.ecr.<region>.amazonaws.com/<repository>:<tag>)"
            )
        component = self.component_config(inference_component, instance_type)
        if check_fit:
            self.check_fit(instance_type, component.accelerators if component else None)
        self._ensure_session(instance_type)
        if kwargs.get("serverless_inference_config") is None:
            model_gb = data_gb = None
            if container_startup_health_check_timeout is None:
                model_gb = self.model_size()
                container_startup_health_check_timeout = sizing.startup_timeout(model_gb)
            if model_data_download_timeout is None and (self.model_data is not None or self.handler_dir is not None):
                data_gb = self.model_data_size()
                model_data_download_timeout = sizing.download_timeout(data_gb)
            log.info(
                "container_startup_health_check_timeout=%s (model: %s GB), model_data_download_timeout=%s "
                "(model data: %s GB)",
                container_startup_health_check_timeout,
                _gb(model_gb),
                model_data_download_timeout,
                _gb(data_gb),
            )
            self._follow_startup_timeout(container_startup_health_check_timeout)
        kwargs["model_data_download_timeout"] = model_data_download_timeout
        kwargs["container_startup_health_check_timeout"] = container_startup_health_check_timeout
        return self._deploy_on_sdk(initial_instance_count, instance_type, *args, component=component, **kwargs)

    def component_config(
        self, inference_component: InferenceComponentConfig | bool | None, instance_type: str | None
    ) -> InferenceComponentConfig | None:
        """``deploy()``'s ``inference_component`` with its accelerators resolved: unless given,
        the tensor x pipeline parallel degree (``"max"``: the instance's GPUs). None: not asked for.

        Raises ``DoesNotFit`` for more accelerators than the instance has, ``ValueError`` for
        ``tensor_parallel_degree="max"`` on an instance type sagelmi does not know."""
        if inference_component is None or inference_component is False:
            return None
        component = InferenceComponentConfig() if inference_component is True else inference_component
        if not isinstance(component, InferenceComponentConfig):
            raise TypeError(
                f"inference_component must be an InferenceComponentConfig or True, not {type(component).__name__}"
            )
        instance = INSTANCES.get(instance_type or "")
        if component.accelerators is None:
            settings = self.settings
            if settings.tensor_parallel_degree == "max" and instance is None:
                raise ValueError(
                    f"tensor_parallel_degree='max' on {instance_type!r}, an instance type sagelmi does not know: "
                    "give the GPUs of each copy as InferenceComponentConfig(accelerators=...)"
                )
            tp = resolve_tensor_parallel(settings, instance.gpus if instance else 0)
            component = component.with_accelerators(tp * settings.pipeline_parallel_degree)
        if instance is not None and (component.accelerators or 0) > instance.gpus:
            raise DoesNotFit(
                f"each copy of the inference component asks for {component.accelerators} accelerators; "
                f"{instance_type} has {instance.gpus}"
            )
        return component

    def plan(self, instance_type: str, accelerators: int | None = None):
        """``container.core.plan``'s plan of this model on ``instance_type`` with its settings
        (one split: the tensor and pipeline parallel degrees asked for), on ``accelerators`` of
        its GPUs when given (one inference component's); None when the instance is not a known
        GPU instance or the model's config cannot be read."""
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

        from container.core.plan import INSTANCES, PlanError, hardware_of, plan_from_settings, read_model

        if instance_type not in INSTANCES:
            return None
        settings = self.settings
        try:
            model = read_model(self.handler_dir, settings.model_id, settings.revision, self.hub_token)
        except (GatedRepoError, RepositoryNotFoundError) as exc:  # the container cannot download it either
            log.warning(
                "cannot read Hub model %s (%s): %s; deploying unchecked",
                settings.model_id,
                type(exc).__name__,
                "HF_TOKEN was refused" if self.hub_token else "a gated or private model needs huggingface_hub_token=",
            )
            return None
        except Exception as exc:  # S3 model data, an unreachable Hub, a custom model: nothing to check with
            log.info(
                "no plan for %s on %s (%s); deploying unchecked",
                settings.model_id or self.handler_dir,
                instance_type,
                exc,
            )
            return None
        gpus, memory, hardware = hardware_of(instance_type, None, None)
        if accelerators is not None and gpus is not None:
            gpus, hardware = min(gpus, accelerators), f"{accelerators} GPU(s) of {hardware}"
        try:
            tp = resolve_tensor_parallel(settings, gpus or 0)
            return plan_from_settings(
                model,
                settings.options,
                gpus=gpus,
                gpu_memory_gib=memory,
                tp=tp,
                pp=settings.pipeline_parallel_degree,
                hardware=hardware,
            )
        except (PlanError, SettingsError) as exc:
            log.info("no plan for %s on %s (%s); deploying unchecked", model[0], instance_type, exc)
            return None

    def check_fit(self, instance_type: str | None, accelerators: int | None = None) -> None:
        """Raise ``DoesNotFit`` when the plan on ``instance_type`` (on ``accelerators`` of its
        GPUs when given) says the model cannot run there."""
        plan = self.plan(instance_type, accelerators) if instance_type is not None else None  # no instance: no check
        if plan is None:
            return
        (split,) = plan.splits
        if split.tp * split.pp > plan.gpus:
            raise DoesNotFit(
                f"tensor x pipeline parallel degree {split.tp} x {split.pp} needs {split.tp * split.pp} "
                f"GPUs; {plan.hardware} has {plan.gpus}"
            )
        if not split.fits:
            raise DoesNotFit(
                f"{plan.model} does not fit on {plan.hardware}: {split.why_not} (sagelmi plan shows "
                f"every split; deploy(check_fit=False) goes ahead anyway)"
            )
        log.info(
            "%s fits on %s at tp=%d pp=%d: %d KV tokens", plan.model, plan.hardware, split.tp, split.pp, split.kv_tokens
        )

    def _follow_startup_timeout(self, startup: int) -> None:
        key = "option.model_loading_timeout"
        if self.settings.sources.get(key) != "default" or startup <= self.settings.model_loading_timeout:
            return
        self.env[env_name(key)] = env_text(startup)
        self.container = build_container_env({}, self.env, self.handler_dir)
        log.info("%s=%s follows the startup timeout", key, startup)
