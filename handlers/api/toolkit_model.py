"""The model a SageMaker inference toolkit script gets when it defines no ``model_fn``, as the
toolkits load it (``handlers/api/inference_toolkit.py`` calls ``default_model_loader``).

- ``option.task`` (``HF_TASK``) set: a ``transformers`` pipeline for that task on the model
  directory, as the Hugging Face toolkit's ``HuggingFaceHandlerService.load`` builds it.
- ``model.pt``, or the one ``.pt``/``.pth`` file of the model directory: ``torch.jit.load``
  (TorchScript), as the PyTorch toolkit's ``default_model_fn`` loads it.
- ``config.json``: a pipeline for the task its first architecture names (``...ForSequenceClassification``
  is ``text-classification`` ...), as the Hugging Face toolkit infers it.
- Nothing of these: start-up fails, naming what was looked for.

The choice is made when the handler is built (start-up); the loading itself runs in the worker's
initialisation call, as a ``model_fn`` would. ``torch`` and ``transformers`` are imported by name
then, as the loader imports engines: the worker, which imports this module, never imports them.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

TORCHSCRIPT_NAME = "model.pt"  # the PyTorch toolkit's DEFAULT_MODEL_FILENAME
# The ends of architecture names and the pipeline task each means (the Hugging Face toolkit's table).
ARCHITECTURE_TASKS = (
    ("TapasForQuestionAnswering", "table-question-answering"),
    ("ForQuestionAnswering", "question-answering"),
    ("ForTokenClassification", "token-classification"),
    ("ForSequenceClassification", "text-classification"),
    ("ForMultipleChoice", "multiple-choice"),
    ("ForMaskedLM", "fill-mask"),
    ("ForCausalLM", "text-generation"),
    ("ForConditionalGeneration", "text2text-generation"),
    ("MTModel", "text2text-generation"),
    ("EncoderDecoderModel", "text2text-generation"),
    ("GPT2LMHeadModel", "text-generation"),
    ("T5WithLMHeadModel", "text2text-generation"),
)


def task_of_architecture(config_path: Path) -> str:
    """The pipeline task of ``config.json``'s first architecture; ``ValueError`` if none fits."""
    architectures = json.loads(config_path.read_text()).get("architectures") or [""]
    for end, task in ARCHITECTURE_TASKS:
        if architectures[0].endswith(end):
            return task
    raise ValueError(
        f"the task cannot be inferred from the architecture {architectures[0] or '(none)'} in config.json: "
        "set HF_TASK (option.task)"
    )


def _torchscript_file(model_dir: Path) -> Path | None:
    """``model.pt``, else the only ``.pt``/``.pth`` file; ``ValueError`` when there are several."""
    if (model_dir / TORCHSCRIPT_NAME).is_file():
        return model_dir / TORCHSCRIPT_NAME
    found = sorted(p for p in model_dir.iterdir() if p.is_file() and p.suffix in (".pt", ".pth"))
    if len(found) > 1:
        raise ValueError(
            f"exactly one .pt or .pth file is needed to load it without model_fn, found {[p.name for p in found]}"
        )
    return found[0] if found else None


def _pipeline(task: str) -> Callable[..., Any]:
    def load(directory: str, context: Any = None) -> Any:
        transformers = importlib.import_module("transformers")
        return transformers.pipeline(task=task, model=directory, tokenizer=directory, device=_device(context))

    load.__doc__ = f"the Hugging Face toolkit's default: a transformers pipeline for {task}"
    return load


def _torchscript(path: Path) -> Callable[..., Any]:
    def load(directory: str, context: Any = None) -> Any:
        torch = importlib.import_module("torch")
        device = _device(context)
        where = torch.device("cpu" if device < 0 else f"cuda:{device}")
        try:
            return torch.jit.load(str(path), map_location=where)
        except RuntimeError as exc:
            raise ValueError(f"cannot load {path.name}: the default model_fn loads TorchScript models only") from exc

    load.__doc__ = f"the PyTorch toolkit's default: TorchScript from {path.name}"
    return load


def _device(context: Any) -> int:
    gpu = context.system_properties.get("gpu_id") if context is not None else None
    return int(gpu) if gpu is not None else -1


def default_model_loader(model_dir: str, task: str | None) -> Callable[..., Any]:
    """A ``model_fn(model_dir, context)`` loading what the toolkits would, chosen now.

    Raises ``ValueError`` (one line) when the model directory has nothing they could load."""
    root = Path(model_dir)
    if task:
        return _pipeline(task)
    torchscript = _torchscript_file(root)
    if torchscript is not None:
        return _torchscript(torchscript)
    if (root / "config.json").is_file():
        return _pipeline(task_of_architecture(root / "config.json"))
    raise ValueError(
        "the inference script defines no model_fn, and there is nothing to load without one: no HF_TASK "
        f"(a transformers pipeline), no {TORCHSCRIPT_NAME} or other .pt/.pth file (TorchScript) and no config.json "
        "in the model directory"
    )
