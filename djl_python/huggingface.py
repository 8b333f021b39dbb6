"""LMI's ``djl_python.huggingface``: ``HuggingFaceService`` and its ``handle``,
for ``model.py`` files that wrap LMI's default handler.

Here the service runs the model on sagelmi's built-in vLLM engine (continuous
batching, LMI and OpenAI schemas), in the worker's own loop. Call it from a
synchronous ``handle`` (as LMI's examples do). With ``option.rolling_batch=disable``
it runs sagelmi's Hugging Face Accelerate engine (``handlers.engines.accelerate``)
instead. The LoRA adapter calls are not available yet: they say so when called.
``get_pipeline`` builds a ``transformers`` pipeline.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from handlers.api import Input, Output
from handlers.api.context import current
from handlers.engines.accelerate import ARCHITECTURES_2_TASK, task_of_architecture  # noqa: F401 - LMI names it here

if TYPE_CHECKING:
    from handlers.engines.accelerate import AccelerateEngine

log = logging.getLogger(__name__)

# Model types whose transformers implementation can use flash attention 2.
FLASH_2_SUPPORTED_MODELS = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "GPTNeoXForCausalLM",
    "GPTBigCodeForCausalLM",
    "FalconForCausalLM",
    "PhiForCausalLM",
}

# The peft auto class for each task.
PEFT_MODEL_TASK_TO_CLS = {
    "text-generation": "AutoPeftModelForCausalLM",
    "text2text-generation": "AutoPeftModelForSeq2SeqLM",
    "text-classification": "AutoPeftModelForSequenceClassification",
    "token-classification": "AutoPeftModelForTokenClassification",
    "question-answering": "AutoPeftModelForQuestionAnswering",
    "feature-extraction": "AutoPeftModelForFeatureExtraction",
}

_NOT_YET = "is not available in this version of sagelmi"


def enable_flash() -> bool:
    """Whether flash attention 2 can be used here (a CUDA device and the package)."""
    try:
        import flash_attn  # noqa: F401
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def get_rolling_batch_class_from_str(rolling_batch_type: str):
    """The class that serves ``rolling_batch_type``: vLLM's engine for ``vllm``."""
    if rolling_batch_type in ("vllm", "lmi-dist", "auto"):
        from handlers.engines.vllm import VllmEngine

        return VllmEngine
    raise ValueError(f"Invalid rolling batch type: {rolling_batch_type}")


class StopWord:
    """A ``transformers`` stopping criterion: stop once the text ends with ``stop_seq``."""

    def __init__(self, tokenizer, stop_seq: str) -> None:
        self.tokenizer = tokenizer
        self.stop_seq = stop_seq

    def __call__(self, input_ids, scores, **kwargs) -> bool:
        return self.tokenizer.decode(input_ids[0]).endswith(self.stop_seq)


class HuggingFaceService:
    def __init__(self) -> None:
        # LMI's attributes: a model.py may read or set them (the model's objects, any class)
        self.hf_pipeline: Any = None
        self.hf_pipeline_unwrapped: Any = None
        self.initialized = False
        self.model: Any = None
        self.tokenizer: Any = None
        self.rolling_batch: Any = None  # the engine serving the model (sagelmi's VllmEngine), once initialized
        self.accelerate: AccelerateEngine | None = None  # the Accelerate engine, with option.rolling_batch=disable
        self.model_config: Any = None
        self.peft_config: Any = None
        self.stopping_criteria_list: list[StopWord] | None = None
        self.adapter_registry: dict = {}
        self.hf_configs: dict[str, Any] = {}
        self.input_format_args: dict = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def _run(self, coroutine):
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        loop = self._loop
        if running is loop:
            coroutine.close()
            raise RuntimeError(
                "HuggingFaceService is synchronous: call it from a plain `def handle`, not from `async def handle`"
            )
        if loop is None:  # called from another loop's thread before initialize()
            coroutine.close()
            raise RuntimeError("HuggingFaceService is not initialized: call initialize(properties) first")
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result()

    def initialize(self, properties: dict) -> None:
        """Start the model's engine (sagelmi's vLLM engine) with the server's settings."""
        running = current()
        context, self._loop = running.context, running.loop
        self.hf_configs = dict(properties)
        rolling_batch = str(properties.get("rolling_batch", context.settings.rolling_batch))
        if rolling_batch == "disable":
            from handlers.engines.accelerate import AccelerateEngine

            log.warning(
                "ENGINE: HuggingFaceService runs the Hugging Face Accelerate engine (option.rolling_batch=disable)"
            )
            self.accelerate = AccelerateEngine.load(context)
            self.model, self.tokenizer = self.accelerate.model, self.accelerate.tokenizer
            self.model_config = self.model.config
            self.initialized = True
            return
        service_class = get_rolling_batch_class_from_str(rolling_batch)
        self.rolling_batch = self._run(service_class.start(context, running.formatters))
        self.tokenizer = self.rolling_batch.engine.tokenizer
        self.model_config = self.rolling_batch.engine.model_config
        if properties.get("stop_sequence"):
            self.stopping_criteria_list = self.load_stopping_criteria_list(properties["stop_sequence"])
        self.input_format_args = self.get_input_format_args()
        self.initialized = True

    def get_input_format_args(self) -> dict:
        return {
            "configs": self.hf_configs,
            "tokenizer": self.tokenizer,
            "adapter_registry": self.adapter_registry,
            "model_config": self.model_config,
            "peft_config": self.peft_config,
            "rolling_batch": self.rolling_batch,
            "image_placeholder_token": self.get_image_token(),
            "is_mistral_tokenizer": False,
        }

    @staticmethod
    def parse_stop_sequence_input(stop_sequence: str) -> list[str]:
        """``"[a, b]"`` -> ``["a", "b"]``."""
        text = stop_sequence.strip()
        if text.startswith("["):
            try:
                return [str(s) for s in json.loads(text)]
            except json.JSONDecodeError:
                text = text[1:-1]
        return [s.strip() for s in text.split(",") if s.strip()]

    def load_stopping_criteria_list(self, stop_sequence: str) -> list[StopWord]:
        return [StopWord(self.tokenizer, s) for s in self.parse_stop_sequence_input(stop_sequence)]

    def inference(self, inputs: Input) -> Output:
        """Answer ``inputs`` (one request, or a batch: one answer per item)."""
        if self.accelerate is not None:
            return self.accelerate.answer(inputs)
        if not inputs.is_batch():
            return self._run(self.rolling_batch.handle(inputs))
        outputs = Output()
        for i, item in enumerate(inputs.get_batches()):
            try:
                answer = self._run(self.rolling_batch.handle(item))
                outputs.add(answer.body(), key="data", batch_index=i)
            except Exception as exc:  # as LMI: the item's answer is its error text
                outputs.add(str(exc), key="data", batch_index=i)
        return outputs

    def add_lora(self, lora_name: str, lora_alias: str, lora_path: str) -> bool:
        raise NotImplementedError(f"LoRA adapters {_NOT_YET}")

    def remove_lora(self, lora_name: str, lora_alias: str) -> bool:
        raise NotImplementedError(f"LoRA adapters {_NOT_YET}")

    def pin_lora(self, lora_name: str, lora_alias: str) -> bool:
        raise NotImplementedError(f"LoRA adapters {_NOT_YET}")

    def get_pipeline(self, task: str, model_id_or_path: str, kwargs: dict):
        """A ``transformers`` pipeline for ``task`` (text generation wrapped to LMI's answer)."""
        from transformers import pipeline

        # transformers types ``task`` as one of its Literal task names; LMI's callers pass any
        self.hf_pipeline_unwrapped = pipeline(task=task, model=model_id_or_path, **kwargs)  # type: ignore[call-overload]
        self.model = self.hf_pipeline_unwrapped.model
        self.tokenizer = self.hf_pipeline_unwrapped.tokenizer
        if task == "text-generation":
            return self.wrap_text_generation_pipeline(self.hf_pipeline_unwrapped)
        return self.hf_pipeline_unwrapped

    @staticmethod
    def wrap_text_generation_pipeline(hf_pipeline):
        """A text-generation pipeline that answers ``[{"generated_text": ...}]`` per input."""

        def wrapped(text_inputs, **kwargs):
            results = hf_pipeline(text_inputs, **kwargs)
            if isinstance(text_inputs, str):
                results = [results]
            return [r[0] if isinstance(r, list) else r for r in results]

        return wrapped

    def infer_task_from_model_architecture(self, model_config_path: str | None = None) -> str:
        from transformers import AutoConfig

        path = model_config_path or self.hf_configs.get("model_id") or self.hf_configs.get("model_dir")
        if path is None:  # an OSError, as transformers' for a model it cannot find
            raise OSError("no model to infer the task from: pass model_config_path, or initialize() first")
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        architecture = (getattr(config, "architectures", None) or [""])[0]
        task = task_of_architecture(architecture)
        if task is not None:
            return task
        raise ValueError(f"Task couldn't be inferred from {architecture}. Please manually set `task` option.")

    def get_image_token(self) -> str | None:
        config = getattr(self.model_config, "hf_config", None)
        token_index = getattr(config, "image_token_index", None)
        if token_index is None or self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_index])


_service = HuggingFaceService()


def _adapter_answer(inputs: Input, verb: str) -> Output:
    name = inputs.get_property("name") or "?"
    return Output().error(
        f"cannot {verb} adapter {name}: LoRA adapters {_NOT_YET}", code=501, message="not implemented"
    )


def register_adapter(inputs: Input) -> Output:
    return _adapter_answer(inputs, "register")


def update_adapter(inputs: Input) -> Output:
    return _adapter_answer(inputs, "update")


def unregister_adapter(inputs: Input) -> Output:
    return _adapter_answer(inputs, "unregister")


def handle(inputs: Input) -> Output | None:
    """LMI's default handler: start the service on the first call, then answer."""
    if not _service.initialized:
        _service.initialize(inputs.get_properties())
    if inputs.is_empty():
        return None
    return _service.inference(inputs)
