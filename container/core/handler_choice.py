"""Which handler serves a model: one answer for the supervisor, the worker's loader, ``sagelmi
config``, the start-up plan and the SDK (``choose_handler``).

Three families (docs/handlers.md): an LMI ``model.py`` with ``handle``; a SageMaker inference
toolkit script (``code/inference.py``, or the file ``SAGEMAKER_PROGRAM`` names, with
``model_fn`` ...); the built-in engine: vLLM (``lmi-dist``, LMI's name under MPI mode), or the Hugging Face
Accelerate engine for ``option.rolling_batch=disable`` or an ``option.task`` vLLM does not serve.
The rule, first match wins:

1. ``option.entryPoint`` naming a file or module: that handler.
2. ``option.entryPoint`` naming one of LMI's built-in services: ``model.py``'s ``handle`` if it
   has one (LMI's custom handler), else the built-in engine.
3. ``SAGEMAKER_PROGRAM``: that toolkit script (in ``code/``, or in the model directory).
4. ``model.py`` and ``code/inference.py`` both present: start-up fails, naming both.
5. ``model.py``: its ``handle``, or with only ``@input_formatter``/``@output_formatter``, the
   built-in engine with them. 6. ``code/inference.py``. 7. The built-in engine.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from container.core.settings import DEFAULT_MODEL_DIR, Settings

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
    "djl_python.lmi_dist",
    "djl_python.rolling_batch.lmi_dist_rolling_batch",
    "djl_python.transformers_neuronx",
    "djl_python.tensorrt_llm",
    "djl_python.lmi_trtllm.trtllm_async_service",
}
TOOLKIT_SCRIPT = "code/inference.py"  # where SageMaker's framework containers look for one


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


class HandlerChoiceError(ValueError):
    """The model directory does not say which handler serves (or names one that is missing)."""


@dataclass(frozen=True)
class Choice:
    """A handler to import (``path`` or ``module``), or the built-in engine (neither)."""

    origin: str  # in words, for the log and ``sagelmi config``
    path: Path | None = None
    module: str | None = None
    formatters_only: bool = False  # a model.py without handle: the built-in engine with its formatters

    @property
    def builtin(self) -> bool:
        return self.path is None and self.module is None


def _program(settings: Settings, root: Path) -> Path:
    name = str(settings.sagemaker_program)
    name = name if name.endswith(".py") else f"{name}.py"
    for candidate in (root / "code" / name, root / name):
        if candidate.is_file():
            return candidate
    raise HandlerChoiceError(
        f"SAGEMAKER_PROGRAM={settings.sagemaker_program}: no code/{name} nor {name} in the model directory"
    )


def choose_handler(settings: Settings, handler_dir: Path | None) -> Choice:
    """The handler that serves, by the rule above, without importing anything.

    Raises ``HandlerChoiceError`` when the directory is ambiguous or names a missing file."""
    root = handler_dir or Path(settings.model_dir)
    entry_point = settings.entry_point
    model_py, script = root / "model.py", root / TOOLKIT_SCRIPT
    if entry_point in LMI_BUILTIN_NAMES:
        if model_py.is_file() and _defines_handle(model_py):
            return Choice(
                f"model.py's handle, in place of option.entryPoint={entry_point} (as LMI's custom handler)", model_py
            )
        return (
            Choice("model.py", model_py, formatters_only=True)
            if model_py.is_file()
            else Choice(f"option.entryPoint={entry_point}")
        )
    if entry_point is not None:
        if not entry_point.endswith(".py"):
            return Choice(f"option.entryPoint={entry_point}", module=entry_point)
        path = Path(entry_point) if Path(entry_point).is_absolute() else root / entry_point
        if not path.is_file():
            raise HandlerChoiceError(f"option.entryPoint={entry_point}: no such file in the model directory")
        return Choice(f"option.entryPoint={entry_point}", path)
    if settings.sagemaker_program:
        return Choice(f"SAGEMAKER_PROGRAM={settings.sagemaker_program}", _program(settings, root))
    if model_py.is_file() and script.is_file():
        raise HandlerChoiceError(
            f"the model directory has both model.py (LMI's handler) and {TOOLKIT_SCRIPT} (the SageMaker "
            "inference toolkit's): set option.entryPoint (OPTION_ENTRYPOINT) or SAGEMAKER_PROGRAM to choose one"
        )
    if model_py.is_file():
        return Choice("model.py", model_py, formatters_only=not _defines_handle(model_py))
    if script.is_file():
        return Choice(TOOLKIT_SCRIPT, script)
    return Choice("the built-in engine")


def _builtin_choice(settings: Settings, handler_dir: Path | None) -> Choice | None:
    """The choice when it is the built-in engine (a formatters-only model.py included), else None."""
    try:
        choice = choose_handler(settings, handler_dir)
    except HandlerChoiceError:
        return None
    if choice.builtin or choice.formatters_only:
        return choice
    return None


def uses_builtin_engine(settings: Settings, handler_dir: Path | None) -> bool:
    """Whether the container will serve with its built-in vLLM engine (vLLM or lmi-dist), as
    ``handlers.api.loader`` decides it: ``choose_handler`` picks the built-in engine (or a
    formatters-only ``model.py``) and it is not the Accelerate engine (``accelerate_reason``)."""
    return _builtin_choice(settings, handler_dir) is not None and accelerate_reason(settings) is None


def mpirun_groups(settings: Settings, handler_dir: Path | None = None) -> bool:
    """Whether each worker group is one ``mpirun`` job of tp x pp ranks: MPI mode (engine=MPI or
    option.mpi_mode=true) for a handler other than the built-in vLLM engine. The built-in engine
    (``vllm`` or ``lmi-dist``) always runs in one worker process whose vLLM starts its own ranks
    (its multiprocessing executor, or Ray)."""
    return settings.mpi_mode_on and not uses_builtin_engine(settings, handler_dir)


def describe_handler(settings: Settings, handler_dir: Path | None) -> str:
    """Which handler will serve, in words (``sagelmi config``): the loader's decision, read
    without importing anything."""
    mode = " in MPI mode (mpirun)" if settings.mpi_mode_on else ""
    missing = missing_model(settings)
    if missing is not None:
        return f"none: serve stops: {missing}"
    try:
        choice = choose_handler(settings, handler_dir)
    except HandlerChoiceError as exc:
        return f"none: start-up fails: {exc}"
    if not choice.builtin and not choice.formatters_only:
        where = " in the model directory" if choice.origin == "model.py" else ""
        kind = "its handle function"
        if choice.path is not None and choice.path.name != "model.py":
            kind = "its handle function, or else its SageMaker inference toolkit functions"
        return f"{choice.origin}{where} ({kind}){mode}"
    reason = accelerate_reason(settings)
    if reason is not None:
        return f"the built-in Hugging Face Accelerate handler, because {reason}"
    formatters = " with model.py's formatters" if choice.formatters_only else ""
    return f"the built-in {settings.builtin_engine} handler (option.rolling_batch={settings.rolling_batch}){formatters}"


def missing_model(settings: Settings) -> str | None:
    """What to set when there is nothing to serve: no ``option.model_id`` and no model directory
    (``serve`` outside the image, where nothing is at /opt/ml/model); None when there is a model."""
    if settings.model_id or Path(settings.model_dir).is_dir():
        return None
    return (
        f"nothing to serve: there is no model directory {settings.model_dir} and option.model_id (HF_MODEL_ID) "
        f"is not set; set HF_MODEL_ID (a Hub id, a local directory or an s3:// prefix), give --model-dir DIR "
        f"(a model, or a model.py), or mount the model at {DEFAULT_MODEL_DIR}"
    )
