"""vLLM's surface as sagelmi uses it: every vLLM name the product code imports, subclasses,
overrides, calls, reads, sets or replaces, one row each (``SURFACE``), for the vLLM series it was
written for (``WRITTEN_FOR``). ``missing()`` looks each up in the installed vLLM and returns
those it lacks, as ``module:attr``: a vLLM release that renames or drops one of them fails
``tests/unit/test_vllm_surface.py`` naming it, and ``sagelmi vllm-surface`` names them on any
machine (the image's included) without the tests.

A row is a module and a dotted attribute inside it (empty: the module itself); a step may be a
mapping's key, and the last step may be an instance attribute, found among the class's declared
fields or the ``self.<name> =`` of its source. ``holds`` is a value the row's value must equal
(a string), hold (a mapping or collection) or contain in its source (a function, class or module).

Rows come in two kinds. The source scan of the test (``tests/unit/test_vllm_surface.py``) sees
the rest and checks both ways (a use not listed fails, a row no longer used fails): imports,
attribute chains on imported names, ``vllm.*`` module names and ``VLLM_*`` variable names written
as strings, methods a subclass of a vLLM class overrides. ``HAND`` rows are reached where the scan
cannot see them (on an engine's objects, on a class vLLM builds by name, by vLLM calling a
stand-in) and are kept by hand: change them with the code that uses them.

Other places that know vLLM's version, referenced here rather than repeated:
``pyproject.toml``'s ``cpu``/``gpu`` extras pin it; ``container/core/vllm_engine_args.json``
records the version its engine arguments were generated from (``engine_arg_list.packaged_version``);
``container/core/known_bad.py``'s rows name the builds and versions each was found on;
``handlers/engines/vllm_platform.py`` applies its fixes to ``0.32.x`` alone; ``container/frontend/
openapi.json`` is generated from the installed request types. docs/architecture.md ("vLLM's
surface") says how to upgrade.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import ModuleType

from container.core.known_bad import installed_vllm

WRITTEN_FOR = "0.32"  # the vLLM series (major.minor) the rows were checked against
HAND = False  # a row's ``seen``: kept by hand, the source scan cannot see it


@dataclass(frozen=True)
class Symbol:
    module: str
    attr: str  # dotted, inside the module; "" for the module itself
    use: str  # what sagelmi does with it, and where
    seen: bool = True  # the test's source scan finds the use (False: HAND)
    holds: str = ""

    @property
    def name(self) -> str:
        return f"{self.module}:{self.attr}" if self.attr else self.module

    @property
    def path(self) -> str:
        """The dotted path the source scan compares with."""
        return f"{self.module}.{self.attr}" if self.attr else self.module


_ENGINES = "vllm.v1.engine"
_OPENAI = "vllm.entrypoints.openai"
_POOL = "vllm.entrypoints.pooling"
_TOK = "vllm.entrypoints.serve.tokenize"
_MEDIA = "vllm.multimodal.media"
_PUNICA = "vllm.lora.punica_wrapper.punica_cpu"
_CPU_COMM = "vllm.distributed.device_communicators.cpu_communicator"

_ROWS: tuple[tuple, ...] = (
    ("vllm", "", "imported for its version"),
    ("vllm", "__version__", "read: recorded by sagelmi engine-args, checked by the CPU platform (0.32.x only)"),
    ("vllm.config.cache", "CacheConfig.block_size", "a label of vllm:cache_config_info, read by the KV check", HAND),
    ("vllm.config.cache", "CacheConfig.num_gpu_blocks", "a label of vllm:cache_config_info (KV check)", HAND),
    ("vllm.config.model", "ModelConfig.get_pooling_task", "called: which pooling routes a model gets", HAND),
    ("vllm.config.model", "ModelConfig.get_vocab_size", "called: token ids of /detokenize checked", HAND),
    ("vllm.config.model", "ModelConfig.runner_type", "read: a pooling model gets the pooling front", HAND),
    ("vllm.connections", "HTTPConnection", "subclassed: media fetched through the address policy (vllm_media)"),
    ("vllm.connections", "HTTPConnection._headers", "called by the subclass for each media request", HAND),
    ("vllm.connections", "HTTPConnection.async_get_bytes", "overridden: a media fetch, each hop checked"),
    ("vllm.connections", "HTTPConnection.get_async_client", "overridden: a session with the policy's resolver"),
    ("vllm.connections", "HTTPConnection.get_bytes", "overridden: a media fetch, each hop checked"),
    ("vllm.connections", "HTTPResponseSizeExceededError", "raised: a media response past vLLM's size limit"),
    ("vllm.connections", "MediaDownloadSizeExceededError", "raised: a media download past vLLM's size limit"),
    (_CPU_COMM, "CpuCommunicator", "subclassed: OneMachineShmCommunicator (vllm_cpu), the CPU platform's"),
    (_CPU_COMM, "CpuCommunicator._all_group_ranks_share_shm_group_name", "overridden: one host (vllm_cpu)"),
    (_CPU_COMM, "CpuCommunicator.device_group", "read by OneMachineShmCommunicator", HAND),
    (_CPU_COMM, "CpuCommunicator.world_size", "read by OneMachineShmCommunicator", HAND),
    ("vllm.engine.arg_utils", "AsyncEngineArgs", "built from the settings; its fields are the engine-args list"),
    (
        "vllm.engine.arg_utils",
        "AsyncEngineArgs.distributed_executor_backend",
        "set on each node of a cluster (vllm_args.node_kwargs)",
        HAND,
    ),
    (
        "vllm.engine.arg_utils",
        "AsyncEngineArgs.master_addr",
        "set on each node of a cluster (vllm_args.node_kwargs)",
        HAND,
    ),
    (
        "vllm.engine.arg_utils",
        "AsyncEngineArgs.master_port",
        "set on each node of a cluster (vllm_args.node_kwargs)",
        HAND,
    ),
    ("vllm.engine.arg_utils", "AsyncEngineArgs.nnodes", "set on each node of a cluster (vllm_args.node_kwargs)", HAND),
    (
        "vllm.engine.arg_utils",
        "AsyncEngineArgs.node_rank",
        "set on each node of a cluster (vllm_args.node_kwargs)",
        HAND,
    ),
    (
        "vllm.engine.arg_utils",
        "AsyncEngineArgs.create_engine_config",
        "called by a headless node (vllm_node)",
        HAND,
    ),
    (f"{_OPENAI}.chat_completion.protocol", "ChatCompletionRequest", "validates chat bodies; in openapi.json"),
    (f"{_OPENAI}.chat_completion.protocol", "ChatCompletionResponse", "in openapi.json"),
    (f"{_OPENAI}.chat_completion.serving", "OpenAIServingChat", "built: answers OpenAI chat (vllm_openai)"),
    (f"{_OPENAI}.chat_completion.serving", "OpenAIServingChat.create_chat_completion", "called per chat", HAND),
    (f"{_OPENAI}.completion.protocol", "CompletionRequest", "validates completion bodies; in openapi.json"),
    (f"{_OPENAI}.completion.protocol", "CompletionResponse", "in openapi.json"),
    (f"{_OPENAI}.completion.serving", "OpenAIServingCompletion", "built: answers OpenAI completions"),
    (f"{_OPENAI}.completion.serving", "OpenAIServingCompletion.create_completion", "called per completion", HAND),
    (f"{_OPENAI}.models.protocol", "BaseModelPath", "built: the served model's name"),
    (f"{_OPENAI}.models.serving", "OpenAIServingModels", "built: the model and its LoRA adapters (/v1/models)"),
    (f"{_OPENAI}.models.serving", "OpenAIServingModels.lora_requests", "the adapter table sagelmi keeps", HAND),
    (f"{_OPENAI}.models.serving", "OpenAIServingModels.show_available_models", "called for /v1/models", HAND),
    ("vllm.entrypoints.anthropic.protocol", "AnthropicCountTokensRequest", "validates count_tokens; in openapi.json"),
    ("vllm.entrypoints.anthropic.protocol", "AnthropicCountTokensResponse", "in openapi.json"),
    ("vllm.entrypoints.anthropic.protocol", "AnthropicMessagesRequest", "validates /v1/messages; in openapi.json"),
    ("vllm.entrypoints.anthropic.protocol", "AnthropicMessagesResponse", "in openapi.json"),
    ("vllm.entrypoints.anthropic.serving", "AnthropicServingMessages", "subclassed and built: answers /v1/messages"),
    ("vllm.entrypoints.anthropic.serving", "AnthropicServingMessages.create_messages", "called per message", HAND),
    (
        "vllm.entrypoints.anthropic.serving",
        "AnthropicServingMessages.to_chat_completion_request",
        "overridden: the request's priority carried into the chat request",
    ),
    (f"{_OPENAI}.responses.protocol", "ResponsesRequest", "validates /v1/responses bodies; in openapi.json"),
    (f"{_OPENAI}.responses.protocol", "ResponsesResponse", "in openapi.json"),
    (f"{_OPENAI}.responses.serving", "OpenAIServingResponses", "built: answers /v1/responses"),
    (f"{_OPENAI}.responses.serving", "OpenAIServingResponses.create_responses", "called per response", HAND),
    (f"{_POOL}.classify.protocol", "ClassificationChatRequest", "in openapi.json"),
    (f"{_POOL}.classify.protocol", "ClassificationCompletionRequest", "in openapi.json"),
    (f"{_POOL}.classify.protocol", "ClassificationRequest", "validates /classify bodies"),
    (f"{_POOL}.classify.protocol", "ClassificationResponse", "in openapi.json"),
    (f"{_POOL}.classify.serving", "ServingClassification", "built and called: answers classification"),
    (f"{_POOL}.pooling.protocol", "IOProcessorRequest", "in openapi.json"),
    (f"{_POOL}.pooling.protocol", "PoolingChatRequest", "in openapi.json"),
    (f"{_POOL}.pooling.protocol", "PoolingCompletionRequest", "in openapi.json"),
    (f"{_POOL}.pooling.protocol", "PoolingRequest", "validates /pooling bodies"),
    (f"{_POOL}.pooling.protocol", "PoolingResponse", "in openapi.json"),
    (f"{_POOL}.pooling.serving", "ServingPooling", "built and called: answers /pooling"),
    ("vllm.tasks", "POOLING_TASKS", "read: whether a model gets /pooling"),
    (f"{_POOL}.embed.protocol", "EmbeddingChatRequest", "in openapi.json"),
    (f"{_POOL}.embed.protocol", "EmbeddingCompletionRequest", "built for LMI's embedding form; in openapi.json"),
    (f"{_POOL}.embed.protocol", "EmbeddingRequest", "validates /v1/embeddings bodies"),
    (f"{_POOL}.embed.protocol", "EmbeddingResponse", "in openapi.json"),
    (f"{_POOL}.embed.serving", "ServingEmbedding", "built and called: answers embeddings (vllm_pooling)"),
    (f"{_POOL}.scoring.protocol", "RerankRequest", "validates /v1/rerank bodies; in openapi.json"),
    (f"{_POOL}.scoring.protocol", "RerankResponse", "in openapi.json"),
    (f"{_POOL}.scoring.protocol", "ScoreDataRequest", "in openapi.json"),
    (f"{_POOL}.scoring.protocol", "ScoreQueriesDocumentsRequest", "in openapi.json"),
    (f"{_POOL}.scoring.protocol", "ScoreQueriesItemsRequest", "in openapi.json"),
    (f"{_POOL}.scoring.protocol", "ScoreRequest", "validates /v1/score bodies"),
    (f"{_POOL}.scoring.protocol", "ScoreResponse", "in openapi.json"),
    (f"{_POOL}.scoring.protocol", "ScoreTextRequest", "in openapi.json"),
    (f"{_POOL}.scoring.serving", "ServingScores", "built and called: answers score and rerank"),
    (f"{_POOL}.utils", "enable_scoring_api", "called: whether a pooling model scores"),
    ("vllm.entrypoints.serve", "create_error_response", "called: vLLM's refusal of a request as its envelope"),
    ("vllm.entrypoints.serve.engine.protocol", "ErrorResponse", "recognised: vLLM's refusal, re-enveloped"),
    ("vllm.entrypoints.serve.engine.protocol", "ModelList", "in openapi.json"),
    (f"{_TOK}.protocol", "DetokenizeRequest", "validates /detokenize bodies; in openapi.json"),
    (f"{_TOK}.protocol", "DetokenizeResponse", "in openapi.json"),
    (f"{_TOK}.protocol", "TokenizeChatRequest", "validates /tokenize bodies with messages; in openapi.json"),
    (f"{_TOK}.protocol", "TokenizeCompletionRequest", "validates /tokenize bodies; in openapi.json"),
    (f"{_TOK}.protocol", "TokenizeResponse", "in openapi.json"),
    (f"{_TOK}.serving", "ServingTokenization", "built: answers /tokenize and /detokenize"),
    (f"{_TOK}.serving", "ServingTokenization.create_detokenize", "called per /detokenize", HAND),
    (f"{_TOK}.serving", "ServingTokenization.create_tokenize", "called per /tokenize", HAND),
    ("vllm.envs", "", "imported: vLLM's variables read at request time"),
    ("vllm.envs", "VLLM_CPU_KVCACHE_SPACE", "read by sagelmi plan and the start-up KV check"),
    ("vllm.envs", "VLLM_CPU_OMP_THREADS_BIND", "set by the supervisor for each CPU worker group"),
    ("vllm.envs", "VLLM_HOST_IP", "set on each node of a cluster: where the other nodes' engine reaches it"),
    ("vllm.envs", "VLLM_MAX_COMPLETION_PROMPTS", "set by the supervisor to max_prompts_per_request"),
    ("vllm.envs", "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB", "read: the media download limit"),
    ("vllm.envs", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "set: how long a stop waits for the rank workers"),
    ("vllm.envs", "VLLM_MAX_STOP_STRINGS", "read: the bound on LMI's stop sequences"),
    ("vllm.envs", "VLLM_MEDIA_CONNECTOR", "read and set: picks sagelmi's media connector"),
    ("vllm.envs", "VLLM_MEDIA_FETCH_MAX_RETRIES", "read: tries of a media fetch"),
    ("vllm.exceptions", "VLLMClientError", "caught: vLLM's refusal of a request, a 400"),
    ("vllm.exceptions", "VLLMValidationError", "raised: media refused (size, unreachable)"),
    ("vllm.logger", "DEFAULT_LOGGING_CONFIG.loggers.vllm", "the logger the worker routes (logs.adopt)", HAND),
    ("vllm.logprobs", "Logprob.decoded_token", "read: LMI's token text", HAND),
    ("vllm.logprobs", "Logprob.logprob", "read: LMI's token log-probability", HAND),
    ("vllm.logprobs", "Logprob.rank", "read: LMI's top-n tokens", HAND),
    (_PUNICA, "PunicaWrapperCPU", "subclassed: BaseRowsPunicaWrapper (vllm_cpu), the CPU platform's"),
    (_PUNICA, "PunicaWrapperCPU._shrink_decode", "overridden: base-model rows get no LoRA delta"),
    (_PUNICA, "PunicaWrapperCPU._shrink_prefill", "overridden: base-model rows get no LoRA delta"),
    (_PUNICA, "PunicaWrapperCPU.add_lora_logits", "overridden: base-model rows get no LoRA delta"),
    (_PUNICA, "PunicaWrapperCPU.apply_lora_full_linear", "overridden: base-model rows get no LoRA delta"),
    (_PUNICA, "PunicaWrapperCPU.no_lora", "read by BaseRowsPunicaWrapper", HAND),
    (_PUNICA, "PunicaWrapperCPU.sampler_indices", "read: each sampled row's slot", HAND),
    (_PUNICA, "PunicaWrapperCPU.token_lora_indices", "read: each token's slot", HAND),
    ("vllm.lora.request", "LoRARequest", "built per adapter"),
    ("vllm.lora.request", "LoRARequest.lora_int_id", "read: an adapter unloaded", HAND),
    ("vllm.lora.request", "LoRARequest.lora_name", "read: an OpenAI body's model", HAND),
    ("vllm.lora.request", "LoRARequest.lora_path", "read: a registration replayed", HAND),
    ("vllm.multimodal.image", "open_image", "called: an image's size read before it is decoded"),
    (_MEDIA, "MEDIA_CONNECTOR_REGISTRY", "sagelmi's media connector registered in it"),
    (_MEDIA, "MEDIA_CONNECTOR_REGISTRY.register", "called: registers MediaConnectorWithPolicy"),
    (_MEDIA, "MediaConnector", "subclassed: media loaded through the address policy"),
    (_MEDIA, "MediaConnector.load_from_url", "overridden: the URL checked, images bounded"),
    (_MEDIA, "MediaConnector.load_from_url_async", "overridden: the URL checked, images bounded"),
    (f"{_MEDIA}.base", "MediaIO", "subclassed: an image loader bounded by max_image_pixels"),
    (f"{_MEDIA}.base", "MediaIO.get_max_bytes", "overridden by PixelBound"),
    (f"{_MEDIA}.base", "MediaIO.load_base64", "overridden by PixelBound"),
    (f"{_MEDIA}.base", "MediaIO.load_bytes", "overridden by PixelBound"),
    (f"{_MEDIA}.base", "MediaIO.load_file", "overridden by PixelBound"),
    (f"{_MEDIA}.image", "ImageMediaIO", "wrapped by PixelBound"),
    ("vllm.outputs", "CompletionOutput.finish_reason", "read: LMI's finish reason", HAND),
    ("vllm.outputs", "CompletionOutput.index", "read: tokens counted per completion", HAND),
    ("vllm.outputs", "CompletionOutput.logprobs", "read: LMI's token details", HAND),
    ("vllm.outputs", "CompletionOutput.stop_reason", "read: LMI's finish reason", HAND),
    ("vllm.outputs", "CompletionOutput.text", "read: LMI's generated text", HAND),
    ("vllm.outputs", "CompletionOutput.token_ids", "read: LMI's tokens, the usage count", HAND),
    ("vllm.outputs", "RequestOutput.finished", "read: a request's last output", HAND),
    ("vllm.outputs", "RequestOutput.outputs", "read: a request's completions", HAND),
    ("vllm.outputs", "RequestOutput.prompt_logprobs", "read: LMI's prefill details", HAND),
    ("vllm.outputs", "RequestOutput.prompt_token_ids", "read: the usage count", HAND),
    ("vllm.platforms", "current_platform", "imported: which platform vLLM runs on"),
    ("vllm.platforms", "current_platform.is_cpu", "called: CPU defaults; the CPU platform's check"),
    ("vllm.platforms", "cpu_platform_plugin", "called: sagelmi's platform activates where vLLM's CPU one would"),
    (
        "vllm.platforms",
        "PLATFORM_PLUGINS_GROUP",
        "sagelmi's platform entry point group (pyproject.toml)",
        HAND,
        "vllm.platform_plugins",
    ),
    ("vllm.platforms.cpu", "CpuPlatform", "subclassed: SagelmiCpuPlatform (vllm_platform)"),
    ("vllm.platforms.cpu", "CpuPlatform.check_and_update_config", "overridden: the worker class"),
    ("vllm.platforms.cpu", "CpuPlatform.get_device_communicator_cls", "overridden: OneMachineShmCommunicator"),
    ("vllm.platforms.cpu", "CpuPlatform.get_punica_wrapper", "overridden: BaseRowsPunicaWrapper"),
    ("vllm.config.parallel", "ParallelConfig.worker_cls", "set by SagelmiCpuPlatform: SeededCPUWorker", HAND),
    ("vllm.reasoning", "ReasoningParserManager", "looks up option.reasoning_parser"),
    ("vllm.reasoning", "ReasoningParserManager.get_reasoning_parser", "called by name (chat_setup)", HAND),
    ("vllm.reasoning", "ReasoningParserManager.list_registered", "called: the parsers named in a refusal", HAND),
    ("vllm.renderers.base", "BaseRenderer._tokenize_prompt", "called on the worker's loop for short prompts", HAND),
    ("vllm.renderers.base", "BaseRenderer._tokenize_prompt_async", "replaced per renderer (vllm_openai)", HAND),
    ("vllm.renderers.base", "BaseRenderer.model_config", "read: LMI prompts parsed", HAND),
    ("vllm.renderers.base", "BaseRenderer.render_cmpl", "called: LMI prompts rendered", HAND),
    ("vllm.renderers.base", "BaseRenderer.tokenizer", "read: inline tokenizing needs a thread-safe one", HAND),
    ("vllm.renderers.chat_utils", "ChatTemplateConfig", "built for the pooling serving classes"),
    ("vllm.renderers.inputs.preprocess", "parse_model_prompt", "called: LMI prompts parsed as vLLM's server does"),
    ("vllm.renderers.online_renderer", "OnlineRenderer", "built: the chat front's renderer"),
    ("vllm.sampling_params", "RequestOutputKind", "imported: outputs asked for as deltas or final only"),
    ("vllm.sampling_params", "RequestOutputKind.DELTA", "LMI streams; the usage count per delta"),
    ("vllm.sampling_params", "RequestOutputKind.FINAL_ONLY", "whole LMI answers"),
    ("vllm.sampling_params", "SamplingParams", "built from LMI's parameters"),
    ("vllm.sampling_params", "SamplingParams.__struct_fields__", "read: LMI parameters passed through"),
    ("vllm.sampling_params", "StructuredOutputsParams", "built from LMI's structured_outputs"),
    ("vllm.tokenizers.hf", "ThreadSafeHFTokenizerMixin", "isinstance: a tokenizer safe on the worker's loop"),
    ("vllm.tool_parsers", "ToolParserManager", "looks up option.tool_call_parser"),
    ("vllm.tool_parsers", "ToolParserManager.get_tool_parser", "called by name (chat_setup)", HAND),
    ("vllm.tool_parsers", "ToolParserManager.import_tool_parser", "called: option.tool_parser_plugin"),
    ("vllm.tool_parsers", "ToolParserManager.list_registered", "called: the parsers named in a refusal", HAND),
    ("vllm.usage.usage_lib", "UsageContext", "imported by vllm_args.usage_context"),
    ("vllm.usage.usage_lib", "UsageContext.ENGINE_CONTEXT", "the built-in engine's config, leader and headless nodes"),
    (f"{_ENGINES}.async_llm", "AsyncLLM", "the engine, subclassed: ObservedAsyncLLM (vllm_observe)"),
    (f"{_ENGINES}.async_llm", "AsyncLLM.abort", "called: a request the client left", HAND),
    (f"{_ENGINES}.async_llm", "AsyncLLM.add_lora", "called: an adapter loaded", HAND),
    (f"{_ENGINES}.async_llm", "AsyncLLM.add_request", "called by LMI's front; overridden (vllm_observe)", HAND),
    (f"{_ENGINES}.async_llm", "AsyncLLM.dead_error", "read: why the engine died", HAND),
    (f"{_ENGINES}.async_llm", "AsyncLLM.errored", "read: the health check", HAND),
    (f"{_ENGINES}.async_llm", "AsyncLLM.from_engine_args", "called on ObservedAsyncLLM: the engine built", HAND),
    (f"{_ENGINES}.async_llm", "AsyncLLM.generate", "overridden: tokens counted (vllm_observe)", HAND),
    (f"{_ENGINES}.async_llm", "AsyncLLM.get_num_unfinished_requests", "read by the unfinished-requests gauge", HAND),
    (f"{_ENGINES}.async_llm", "AsyncLLM.get_supported_tasks", "called: a pooling model's tasks", HAND),
    (f"{_ENGINES}.async_llm", "AsyncLLM.model_config", "read: runner type, vocabulary, renderer", HAND),
    (f"{_ENGINES}.async_llm", "AsyncLLM.remove_lora", "called: an adapter unloaded", HAND),
    (f"{_ENGINES}.async_llm", "AsyncLLM.renderer", "read: LMI prompts rendered; inline tokenizing", HAND),
    (f"{_ENGINES}.async_llm", "AsyncLLM.output_handler", "cancelled before AsyncLLM.shutdown: no traceback", HAND),
    (f"{_ENGINES}.async_llm", "AsyncLLM.shutdown", "called when the worker stops", HAND),
    (f"{_ENGINES}.async_llm", "AsyncLLM.tokenizer", "read: formatters, token texts, parsers", HAND),
    (f"{_ENGINES}.exceptions", "EngineDeadError", "caught and raised: the engine is dead, the group restarts"),
    (f"{_ENGINES}.output_processor", "RequestOutputCollector.get", "called: LMI's front reads outputs", HAND),
    (f"{_ENGINES}.output_processor", "RequestOutputCollector.get_nowait", "called: LMI's front", HAND),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "built: a worker node's headless node (vllm_node)"),
    (
        "vllm.v1.executor.multiproc_executor",
        "MultiprocExecutor.start_worker_monitor",
        "called inline by a headless node: it returns when an engine worker died",
        HAND,
    ),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor.shutdown", "called when a headless node ends", HAND),
    (
        "vllm.v1.metrics.loggers",
        "PrometheusStatLogger.log_metrics_info",
        "names the metric the start-up KV check reads",
        HAND,
        "vllm:cache_config_info",
    ),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", "subclassed: SeededCPUModelRunner (vllm_cpu)"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner._bookkeeping_sync", "overridden: seeded split prompts"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner._sample", "overridden: seeded split prompts"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner.discard_request_mask", "read by SeededCPUModelRunner", HAND),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner.input_batch", "read by SeededCPUModelRunner", HAND),
    ("vllm.v1.worker.cpu_worker", "CPUWorker", "subclassed: SeededCPUWorker (vllm_cpu); its name, replaced"),
    ("vllm.v1.worker.cpu_worker", "CPUWorker.init_device", "overridden: its runner made a SeededCPUModelRunner"),
    ("vllm.v1.worker.cpu_worker", "CPUWorker.model_runner", "read: the runner CPUWorker built", HAND),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.generators", "read and set by SeededCPUModelRunner", HAND),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.num_reqs", "read by SeededCPUModelRunner", HAND),
)

SURFACE: tuple[Symbol, ...] = tuple(Symbol(*row) for row in _ROWS)


def _declares(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name``: a declared field (dataclass, msgspec, pydantic)
    or an attribute its source (or a base's) assigns."""
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=")
    for klass in cls.__mro__:
        for fields in ("__dataclass_fields__", "__struct_fields__", "__pydantic_fields__"):
            if name in (getattr(klass, fields, None) or ()):
                return True
        try:
            if assigned.search(inspect.getsource(klass)):
                return True
        except (OSError, TypeError):  # a built-in class (object ...) has no source
            continue
    return False


def _holds(value: object, holds: str) -> bool:
    if isinstance(value, str):
        return value == holds
    if isinstance(value, (Mapping, Collection)):
        return holds in value
    return holds in inspect.getsource(value)  # type: ignore[arg-type]


def _present(symbol: Symbol) -> bool:
    value: object = importlib.import_module(symbol.module)
    steps = symbol.attr.split(".") if symbol.attr else []
    for i, step in enumerate(steps):
        if isinstance(value, Mapping) and step in value:
            value = value[step]
        elif hasattr(value, step):
            value = getattr(value, step)
        elif isinstance(value, ModuleType) and importlib.util.find_spec(f"{value.__name__}.{step}") is not None:
            value = importlib.import_module(f"{value.__name__}.{step}")  # a submodule ``from`` imports
        else:
            return i == len(steps) - 1 and isinstance(value, type) and _declares(value, step) and not symbol.holds
    return not symbol.holds or _holds(value, symbol.holds)


def missing(surface: tuple[Symbol, ...] = SURFACE) -> list[str]:
    """The rows of ``surface`` the installed vLLM lacks, each as ``module:attr`` (imports vLLM:
    seconds). A row whose lookup raises counts as missing."""
    lacking = []
    for symbol in surface:
        try:
            found = _present(symbol)
        except Exception:
            found = False
        if not found:
            lacking.append(symbol.name)
    return lacking


def describe_missing(surface: tuple[Symbol, ...] = SURFACE, limit: int = 8) -> str:
    """One line naming what the installed vLLM lacks of ``surface`` ("" when it lacks nothing,
    or vLLM is not installed at all: an import error says that already). For a failed import of
    a built-in engine; imports vLLM, so never on the path of a start-up that works."""
    if importlib.util.find_spec("vllm") is None:
        return ""
    lacking = missing(surface)
    if not lacking:
        return ""
    build, version = installed_vllm() or ("vllm", "?")
    shown = ", ".join(lacking[:limit]) + (f" and {len(lacking) - limit} more" if len(lacking) > limit else "")
    return (
        f"the installed {build} {version} lacks {len(lacking)} of the vLLM names sagelmi uses (written for vLLM "
        f"{WRITTEN_FOR}.x; container/core/vllm_surface.py): {shown}"
    )
