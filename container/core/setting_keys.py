"""The settings' names: for every setting of ``Settings``, its ``serving.properties``
key, its environment spellings (LMI's, then AWS's vLLM container's ``SM_VLLM_<ARG>``
for a setting that is a vLLM argument, then Hugging Face's and TGI's, strongest
first), the SageMaker platform variables that override it, the other spellings
LMI accepts in ``serving.properties``, and the vLLM engine argument it becomes.
``container.core.settings`` reads the environment and ``serving.properties``
through this table; the SDK (``sagemaker_sdk``) writes a container's environment
with it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Key:
    """One setting: its ``serving.properties`` key and every other spelling."""

    field: str  # attribute of Settings
    key: str  # serving.properties key
    env: tuple[str, ...]  # environment names, strongest first
    allowed: str  # what values are accepted, for error messages
    doc: str
    sagemaker: tuple[str, ...] = ()  # SageMaker platform overrides, strongest first
    engine_arg: str | None = None  # the vLLM engine argument it becomes (built-in engine only)
    aliases: tuple[str, ...] = ()  # other serving.properties spellings LMI accepts


KEYS: tuple[Key, ...] = (
    # -- model
    Key(
        "model_id",
        "option.model_id",
        ("OPTION_MODEL_ID", "SM_VLLM_MODEL", "HF_MODEL_ID"),
        "a Hub model id, a local path or s3:// URI",
        "The model: a Hugging Face Hub id, a local directory or an s3:// prefix. Unset: the model directory.",
        engine_arg="model",
    ),
    Key(
        "revision",
        "option.revision",
        ("OPTION_REVISION", "SM_VLLM_REVISION", "HF_REVISION"),
        "a Hub revision (branch, tag, commit)",
        "Revision of a Hub model.",
        engine_arg="revision",
    ),
    Key("task", "option.task", ("OPTION_TASK", "HF_TASK"), "a task name such as text-generation", "The model's task."),
    Key(
        "normalize",
        "option.normalize",
        ("OPTION_NORMALIZE",),
        "true or false",
        "Embedding models: whether vectors are L2-normalised (vLLM's use_activation) when a request does not say. "
        "Unset: LMI's /invocations form normalises, /v1/embeddings follows the model's pooler.",
    ),
    Key(
        "entry_point",
        "option.entryPoint",
        ("OPTION_ENTRYPOINT",),
        "a .py file in the model directory or a module name",
        "The handler. Unset: model.py in the model directory.",
    ),
    Key(
        "sagemaker_program",
        "option.sagemaker_program",
        ("OPTION_SAGEMAKER_PROGRAM",),
        "a .py file name (in code/ of the model directory, or in it)",
        "The SageMaker inference toolkit's script (model_fn, input_fn ...). Unset: code/inference.py when present.",
        ("SAGEMAKER_PROGRAM",),
    ),
    Key(
        "default_invocations_accept",
        "option.default_invocations_accept",
        ("OPTION_DEFAULT_INVOCATIONS_ACCEPT",),
        "a media type",
        "The answer type of an inference-toolkit script when a request's Accept is missing or */*.",
        ("SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT",),
    ),
    Key(
        "trust_remote_code",
        "option.trust_remote_code",
        ("OPTION_TRUST_REMOTE_CODE", "SM_VLLM_TRUST_REMOTE_CODE", "HF_TRUST_REMOTE_CODE", "HF_MODEL_TRUST_REMOTE_CODE"),
        "true or false",
        "Allow model code from the Hub.",
        engine_arg="trust_remote_code",
    ),
    Key(
        "quantize",
        "option.quantize",
        ("OPTION_QUANTIZE", "SM_VLLM_QUANTIZATION", "HF_MODEL_QUANTIZE"),
        "a quantization method name",
        "Quantization method (awq, gptq, fp8, ...).",
        engine_arg="quantization",
    ),
    # -- parallelism and workers
    Key(
        "engine",
        "engine",
        ("OPTION_ENGINE",),
        "Python or MPI",
        "How worker groups start: Python (one process each) or MPI (one mpirun job of tp x pp ranks each).",
    ),
    Key(
        "mpi_mode",
        "option.mpi_mode",
        ("OPTION_MPI_MODE",),
        "true or false",
        "Run each worker group of a model.py as MPI ranks (same as engine=MPI); the built-in engine runs on "
        "vLLM's own executor either way.",
    ),
    Key(
        "tensor_parallel_degree",
        "option.tensor_parallel_degree",
        ("OPTION_TENSOR_PARALLEL_DEGREE", "SM_VLLM_TENSOR_PARALLEL_SIZE", "TENSOR_PARALLEL_DEGREE", "SM_NUM_GPUS"),
        "a whole number >= 1, or max",
        "Tensor parallel degree: accelerators per pipeline stage; max uses all devices a group sees.",
        engine_arg="tensor_parallel_size",
    ),
    Key(
        "pipeline_parallel_degree",
        "option.pipeline_parallel_degree",
        ("OPTION_PIPELINE_PARALLEL_DEGREE", "SM_VLLM_PIPELINE_PARALLEL_SIZE", "PIPELINE_PARALLEL_DEGREE"),
        "a whole number >= 1",
        "Pipeline stages per model copy; a worker group has tensor x pipeline parallel degree devices.",
        engine_arg="pipeline_parallel_size",
    ),
    Key(
        "mpi_hostfile",
        "option.mpi_hostfile",
        ("OPTION_MPI_HOSTFILE",),
        "a path to an Open MPI hostfile",
        "MPI mode: spread each group's ranks over these machines (this machine first: rank 0 answers).",
    ),
    Key(
        "mpi_extra_args",
        "option.mpi_extra_args",
        ("OPTION_MPI_EXTRA_ARGS",),
        "mpirun arguments, shell-quoted",
        "MPI mode: more mpirun arguments, e.g. --mca btl_tcp_if_include eth0.",
    ),
    Key(
        "ray_port",
        "option.ray_port",
        ("OPTION_RAY_PORT",),
        "a port number from 1024 to 65535",
        "A cluster with option.distributed_executor_backend=ray: the port of Ray's head on the leader, which the "
        "worker nodes join (docs/cluster.md).",
    ),
    Key(
        "min_workers",
        "min_workers",
        ("SERVING_MIN_WORKERS",),
        "a whole number >= 1",
        "Worker groups to start when there are no accelerators.",
        ("SAGEMAKER_MODEL_SERVER_WORKERS", "SAGEMAKER_NUM_MODEL_WORKERS"),
        aliases=("minWorkers",),
    ),
    Key(
        "max_workers",
        "max_workers",
        ("SERVING_MAX_WORKERS",),
        "a whole number >= 1",
        "Upper bound on worker groups (with accelerators: devices / tensor_parallel_degree).",
        ("SAGEMAKER_MODEL_SERVER_WORKERS", "SAGEMAKER_NUM_MODEL_WORKERS"),
        aliases=("maxWorkers",),
    ),
    Key(
        "sync_handler_threads",
        "option.sync_handler_threads",
        ("OPTION_SYNC_HANDLER_THREADS",),
        "a whole number >= 1",
        "How many calls of a synchronous handle() one worker runs at once (1: one at a time, as LMI).",
    ),
    # -- engine
    Key(
        "rolling_batch",
        "option.rolling_batch",
        ("OPTION_ROLLING_BATCH",),
        "auto, vllm, lmi-dist or disable",
        "Continuous batching backend of the built-in handler: vLLM, whose executor starts a process per "
        "rank; lmi-dist (LMI's name under MPI mode, which auto picks there) is the same engine.",
    ),
    Key(
        "max_rolling_batch_size",
        "option.max_rolling_batch_size",
        ("OPTION_MAX_ROLLING_BATCH_SIZE", "SM_VLLM_MAX_NUM_SEQS", "MAX_BATCH_SIZE"),
        "a whole number >= 1",
        "Most sequences the engine runs at once.",
        engine_arg="max_num_seqs",
    ),
    Key(
        "max_rolling_batch_prefill_tokens",
        "option.max_rolling_batch_prefill_tokens",
        ("OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS", "SM_VLLM_MAX_NUM_BATCHED_TOKENS", "MAX_BATCH_PREFILL_TOKENS"),
        "a whole number >= 1",
        "Most prompt tokens prefilled in one engine step.",
        engine_arg="max_num_batched_tokens",
    ),
    Key(
        "output_formatter",
        "option.output_formatter",
        ("OPTION_OUTPUT_FORMATTER",),
        "json, jsonlines or sse",
        "Built-in handler: how LMI-schema streams are framed (json means jsonlines for streams).",
    ),
    Key(
        "tgi_compat",
        "option.tgi_compat",
        ("OPTION_TGI_COMPAT",),
        "true or false",
        "Built-in handler: answer in TGI's forms (lists, details on, server-sent events).",
    ),
    Key(
        "adapter_roots",
        "option.adapter_roots",
        ("OPTION_ADAPTER_ROOTS",),
        "directories, comma-separated",
        "LoRA adapters: more directories an adapter's source may be in (always allowed: the model directory "
        "and the download cache); anything outside them, through .. or a symbolic link too, is refused.",
    ),
    Key(
        "max_adapter_size_in_mb",
        "max_adapter_size_in_mb",
        ("SERVING_MAX_ADAPTER_SIZE_IN_MB",),
        "a number of MiB > 0",
        "LoRA adapters registered from an s3:// prefix: the most its objects may add up to; a larger "
        "one is refused (413) from the listing's sizes, before anything is downloaded.",
    ),
    # -- media in chat messages (vision and audio models on the built-in engine)
    Key(
        "max_image_pixels",
        "max_image_pixels",
        ("SERVING_MAX_IMAGE_PIXELS",),
        "a whole number >= 1",
        "Largest image a request may send, in pixels (width x height), read from the image's header before it "
        "is decoded; a larger one gets 400.",
    ),
    Key(
        "allowed_media_networks",
        "option.allowed_media_networks",
        ("OPTION_ALLOWED_MEDIA_NETWORKS",),
        "CIDR ranges, comma-separated (10.0.0.0/8, fd00::/8)",
        "Media URLs of these non-public addresses are fetched too (by default only public addresses are: "
        "docs/vision.md). An address of this container is allowed only when named alone (/32, /128).",
    ),
    Key(
        "trust_request_mm_kwargs",
        "option.trust_request_mm_kwargs",
        ("OPTION_TRUST_REQUEST_MM_KWARGS", "SM_VLLM_TRUST_REQUEST_MM_KWARGS"),
        "true or false",
        "Accept a request's media_io_kwargs and mm_processor_kwargs (vLLM's flag); false: such a request gets 400.",
    ),
    # -- dynamic batching (handlers that batch: model.py)
    Key(
        "batch_size",
        "batch_size",
        ("SERVING_BATCH_SIZE", "OPTION_BATCH_SIZE"),
        "a whole number >= 1",
        "Dynamic batching for a model.py handler: up to this many requests in one Input "
        "(get_batches()); 1: one request per call. The built-in engines batch continuously instead.",
        aliases=("max_dynamic_batch_size", "option.batch_size"),
    ),
    Key(
        "max_batch_delay",
        "max_batch_delay",
        ("SERVING_MAX_BATCH_DELAY", "OPTION_MAX_BATCH_DELAY"),
        "milliseconds >= 0",
        "Dynamic batching: how long a batch waits for more requests after its first.",
        aliases=("option.max_batch_delay",),
    ),
    # -- stateful sessions (SageMaker's sticky sessions)
    Key(
        "enable_stateful_sessions",
        "option.enable_stateful_sessions",
        ("OPTION_ENABLE_STATEFUL_SESSIONS", "SAGEMAKER_ENABLE_STATEFUL_SESSIONS"),
        "true or false",
        "SageMaker's stateful sessions: X-Amzn-SageMaker-Session-Id routes a session's requests to the "
        "worker group that created it; the built-in engine opens and closes sessions on "
        '{"requestType": "NEW_SESSION"} / {"requestType": "CLOSE"}. false: the header is refused (400).',
    ),
    Key(
        "sessions_path",
        "option.sessions_path",
        ("OPTION_SESSIONS_PATH", "SAGEMAKER_SESSIONS_PATH"),
        "a directory",
        "Where sessions keep their files. Unset: /dev/shm/djl_sessions (the temporary directory without /dev/shm).",
    ),
    Key(
        "sessions_expiration",
        "option.sessions_expiration",
        ("OPTION_SESSIONS_EXPIRATION", "SAGEMAKER_SESSIONS_EXPIRATION"),
        "seconds >= 1",
        "How long a session lives after it is created; then its requests get 400, and its files are removed.",
    ),
    Key(
        "max_sessions",
        "option.max_sessions",
        ("OPTION_MAX_SESSIONS",),
        "a whole number >= 1",
        "Sessions open at once in each worker group (its SessionManager, the built-in engine's or a model.py's); "
        "beyond it a new session is refused with 429 until one is closed or expires.",
    ),
    # -- server
    Key(
        "port",
        "port",
        ("SERVING_PORT", "SM_VLLM_PORT"),
        "a port number 1-65535",
        "HTTP port.",
        ("SAGEMAKER_BIND_TO_PORT",),
    ),
    Key(
        "job_queue_size",
        "job_queue_size",
        ("SERVING_JOB_QUEUE_SIZE", "MAX_CONCURRENT_REQUESTS"),
        "a whole number >= 1",
        "Requests accepted at once (running or waiting); beyond it: 503.",
    ),
    Key(
        "max_payload_in_mb",
        "max_payload_in_mb",
        ("SERVING_MAX_PAYLOAD_IN_MB",),
        "a number of MiB > 0",
        "Largest request body; larger bodies get 413.",
        ("SAGEMAKER_MAX_PAYLOAD_IN_MB",),
    ),
    Key(
        "max_prompts_per_request",
        "max_prompts_per_request",
        ("SERVING_MAX_PROMPTS_PER_REQUEST",),
        "a whole number >= 1",
        "Most prompts one request may hold, each an engine request (a list in LMI's 'inputs', OpenAI's "
        "'prompt', embeddings' 'input', score and rerank documents); more get 400. The built-in engine's "
        "VLLM_MAX_COMPLETION_PROMPTS is set to it unless given.",
    ),
    Key(
        "max_multipart_parts",
        "max_multipart_parts",
        ("SERVING_MAX_MULTIPART_PARTS",),
        "a whole number >= 1",
        "Most parts of a multipart/form-data body a model.py handler is given; more get 400 before the body "
        "is parsed. The built-in engines take no multipart bodies (415).",
    ),
    Key(
        "header_read_timeout",
        "header_read_timeout",
        ("SERVING_HEADER_READ_TIMEOUT",),
        "seconds > 0",
        "Longest time a client may take to send a request's head (request line and headers), from the "
        "connection's opening or, on a kept-alive connection, from the request's first bytes; then 408 "
        "and the connection is closed. Until its head is whole a connection holds no request thread.",
    ),
    Key(
        "body_read_timeout",
        "body_read_timeout",
        ("SERVING_BODY_READ_TIMEOUT",),
        "seconds > 0",
        "Longest time a client may take to send a request body; a body still incomplete then gets 408, "
        "one cut short by the client 400, and neither is run.",
    ),
    Key(
        "max_connections_per_client",
        "max_connections_per_client",
        ("SERVING_MAX_CONNECTIONS_PER_CLIENT",),
        "a whole number >= 1",
        "Connections one client address may hold waiting: idle between requests, or still sending a "
        "request head. Past it, that address's oldest waiting connection is closed (408 if it had sent "
        "part of a head); new connections and requests being served are never refused, so /ping always "
        "goes through. Unset: job_queue_size (SageMaker's traffic comes from a few proxy addresses, "
        "each keeping as many connections as requests it sent at once).",
    ),
    Key(
        "predict_timeout",
        "option.predict_timeout",
        ("OPTION_PREDICT_TIMEOUT",),
        "seconds > 0",
        "Longest wait for an answer (for a stream: for its start and between chunks); then 504.",
        ("SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS", "SAGEMAKER_MODEL_SERVER_TIMEOUT"),
    ),
    Key(
        "model_loading_timeout",
        "option.model_loading_timeout",
        ("OPTION_MODEL_LOADING_TIMEOUT",),
        "seconds > 0",
        "Longest model load before start-up fails.",
        ("SAGEMAKER_STARTUP_TIMEOUT",),
    ),
    Key(
        "shutdown_grace_period",
        "shutdown_grace_period",
        ("SERVING_SHUTDOWN_GRACE_PERIOD",),
        "seconds >= 0",
        "On SIGTERM, how long in-flight requests may take to finish.",
    ),
    Key("log_level", "log_level", ("SERVING_LOG_LEVEL",), "DEBUG, INFO, WARNING or ERROR", "Log level."),
    Key(
        "log_format",
        "log_format",
        ("SAGELMI_LOG_FORMAT",),
        "text or json",
        "Log lines as text, or one JSON object per line (docs/observability.md).",
    ),
)

KEY_BY_NAME = {k.key: k for k in KEYS}
KEY_BY_FIELD = {k.field: k for k in KEYS}
KEY_BY_ALIAS = {alias: k for k in KEYS for alias in k.aliases}


def option_key(name: str) -> str:
    """``model_id`` or ``option.model_id`` -> ``option.model_id``, as the container spells an
    ``OPTION_*`` variable's key (lower case; LMI spells one option in camel case: ``entryPoint``)."""
    name = name.lower().removeprefix("option.")
    return "option.entryPoint" if name == "entrypoint" else f"option.{name}"
