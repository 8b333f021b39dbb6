"""Which handler serves a model: one answer for the supervisor, the worker's loader, ``sagelmi
config``, the start-up plan and the SDK.

``model.py`` (or ``option.entryPoint``) defining ``handle`` serves it; otherwise a built-in
engine does: vLLM (``lmi-dist`` in MPI mode), or the Hugging Face Accelerate engine for
``option.rolling_batch=disable`` or an ``option.task`` vLLM does not serve.
"""

from __future__ import annotations

import ast
from pathlib import Path

from container.core.settings import Settings

# option.task values vLLM serves with its pooling runner, and the conversion (vLLM's ``convert``)
# each asks for: LMI's names (djl_python's vllm_rb_properties maps text-embedding and
# feature-extraction to embed, classify to classify) and vLLM's own task names.
POOLING_TASKS = {
    "text-embedding": "embed",
    "feature-extraction": "embed",
    "embed": "embed",
    "embedding": "embed",
    "classify": "classify",
    "score": "classify",
}
# The tasks vLLM serves; any other option.task goes to the Accelerate engine.
VLLM_TASKS = {"text-generation", "generate", *POOLING_TASKS}
# LMI's names for its built-in handlers, served here by the built-in vLLM handler.
LMI_BUILTIN_NAMES = {
    "djl_python.huggingface",
    "djl_python.lmi_vllm.vllm_async_service",
    "djl_python.vllm",
    "djl_python.rolling_batch.vllm_rolling_batch",
}


def accelerate_reason(settings: Settings) -> str | None:
    """Why the built-in handler is the Hugging Face Accelerate engine rather than vLLM
    (None: vLLM or lmi-dist serves). The SDK asks this too: vLLM's option names are
    then not checked."""
    if settings.builtin_engine == "disable":
        return "option.rolling_batch=disable"
    if settings.task and settings.task not in VLLM_TASKS and settings.rolling_batch == "auto":
        return f"option.task={settings.task}, which vLLM does not serve"
    return None


def pooling_convert(settings: Settings) -> str | None:
    """vLLM's ``convert`` for the pooling task ``option.task`` names (None: not a pooling task)."""
    return POOLING_TASKS.get(settings.task or "")


def _defines_handle(model_py: Path) -> bool:
    """Whether ``model.py`` defines (or imports) ``handle`` at module level. A file
    with only ``@input_formatter``/``@output_formatter`` runs on the built-in engine."""
    try:
        tree = ast.parse(model_py.read_text(), str(model_py))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return True  # not ours to judge: the container reports it
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "handle":
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "handle" for t in node.targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (alias.asname or alias.name) == "handle" for alias in node.names
        ):
            return True
    return False


def uses_builtin_engine(settings: Settings, handler_dir: Path | None) -> bool:
    """Whether the container will serve with its built-in vLLM engine (vLLM or
    lmi-dist), as ``handlers.api.loader`` decides it: no ``option.entryPoint`` (or one
    naming LMI's built-in handlers), no ``model.py`` defining ``handle`` in the
    handler directory, and not the Accelerate engine (``accelerate_reason``)."""
    if settings.entry_point is not None:
        return settings.entry_point in LMI_BUILTIN_NAMES and accelerate_reason(settings) is None
    if accelerate_reason(settings) is not None:
        return False
    model_py = handler_dir / "model.py" if handler_dir else None
    return not (model_py and model_py.is_file() and _defines_handle(model_py))


def describe_handler(settings: Settings, handler_dir: Path | None) -> str:
    """Which handler will serve, in words (``sagelmi config``): the loader's decision, read
    without importing anything."""
    mode = " in MPI mode (mpirun)" if settings.use_mpi else ""
    if settings.entry_point is not None and settings.entry_point not in LMI_BUILTIN_NAMES:
        return f"option.entryPoint={settings.entry_point} (its handle function){mode}"
    model_py = handler_dir / "model.py" if handler_dir else None
    if settings.entry_point is None and model_py is not None and model_py.is_file() and _defines_handle(model_py):
        return f"model.py in the model directory (its handle function){mode}"
    reason = accelerate_reason(settings)
    if reason is not None:
        return f"the built-in Hugging Face Accelerate handler, because {reason}"
    formatters = " with model.py's formatters" if model_py is not None and model_py.is_file() else ""
    return f"the built-in {settings.builtin_engine} handler (option.rolling_batch={settings.rolling_batch}){formatters}"
