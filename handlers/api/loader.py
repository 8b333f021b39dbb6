"""Finding and importing the handler a worker group serves.

Which file or module serves is ``container.core.handler_choice.choose_handler``'s decision
(the rule is there and in docs/handlers.md). The imported module serves with its ``handle``;
without one, with its SageMaker inference toolkit functions (``model_fn`` ...:
``handlers/api/inference_toolkit.py``); without those, if it has (as LMI allows) only an
``@input_formatter`` and/or ``@output_formatter``, the built-in handler serves the model with
those formatters. The built-in handler is vLLM (``vllm`` and ``lmi-dist`` alike), the
Hugging Face Accelerate engine (``handlers/engines/accelerate.py``) for
``option.rolling_batch=disable`` or an ``option.task`` vLLM does not serve (logged loudly,
with the reason). Anything else stops start-up with the reason: there is no silent fallback
to another handler.

A built-in engine is a class implementing ``handlers.api.engine.Engine``; the loader
names it and the worker starts it (``Engine.start``), with a formatters-only
``model.py``'s formatters.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from container.core.handler_choice import (
    LMI_BUILTIN_NAMES,
    HandlerChoiceError,
    accelerate_reason,
    choose_handler,
    pooling_convert,
)
from container.core.settings import Settings
from container.core.vllm_surface import describe_missing
from handlers.api.engine import Engine, Formatters
from handlers.api.inference_toolkit import FUNCTIONS, ToolkitHandler, is_toolkit_script

log = logging.getLogger(__name__)

_MODULE_NAME = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


class HandlerLoadError(Exception):
    """The handler could not be found or imported; the message says why."""


BUILTIN = {  # engine name -> the module defining its Engine class, and the class
    "vllm": ("handlers.engines.vllm", "VllmEngine"),
    "lmi-dist": ("handlers.engines.vllm", "VllmEngine"),  # LMI's name for it: vLLM's executor runs the ranks
    "accelerate": ("handlers.engines.accelerate", "AccelerateEngine"),
}
_BUILTIN_MODULES = {module: cls for module, cls in BUILTIN.values()}


@dataclass(frozen=True)
class Handler:
    """What serves the group: a ``model.py``'s ``handle`` (``fn``), or a built-in engine (``engine``,
    started by the worker) with the ``model.py``'s formatters; ``kind`` says how to call it."""

    origin: str
    kind: str  # "sync", "async", "generator" or "async_generator"
    fn: Callable[..., Any] | None = None
    engine: type[Engine] | None = None
    shutdown: Callable[[], Any] | None = None  # a model.py's optional shutdown(), called when the worker stops
    formatters: Formatters = Formatters()

    @property
    def builtin(self) -> bool:
        return self.engine is not None


def _kind(fn: Callable[..., Any]) -> str:
    if inspect.isasyncgenfunction(fn):
        return "async_generator"
    if inspect.iscoroutinefunction(fn):
        return "async"
    if inspect.isgeneratorfunction(fn):
        return "generator"
    return "sync"


def _import_file(path: Path) -> Any:
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise HandlerLoadError(f"cannot import {path.name}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _builtin(settings: Settings) -> tuple[str, None, str]:
    engine = settings.builtin_engine
    if not settings.model_id and not (Path(settings.model_dir) / "config.json").is_file():
        raise HandlerLoadError(
            "nothing to serve: the model directory has neither model.py nor a model (config.json), "
            "and option.model_id (HF_MODEL_ID) is not set"
        )
    reason = accelerate_reason(settings)
    if reason is None:
        convert = pooling_convert(settings)
        pooling = f", option.task={settings.task}: vLLM's pooling runner, convert={convert}" if convert else ""
        return (
            f"the built-in {engine} handler (option.rolling_batch={settings.rolling_batch}{pooling})",
            None,
            BUILTIN[engine][0],
        )
    log.warning("ENGINE: the Hugging Face Accelerate engine (transformers) serves this model, because %s", reason)
    return f"the built-in Hugging Face Accelerate handler ({reason})", None, BUILTIN["accelerate"][0]


def _locate(settings: Settings) -> tuple[str, Path | None, str | None]:
    """Return ``(description, file, module)``: at most one of file and module (neither: a
    built-in engine, named by the module)."""
    try:
        choice = choose_handler(settings, Path(settings.model_dir))
    except HandlerChoiceError as exc:
        raise HandlerLoadError(str(exc)) from None
    if choice.builtin:
        return _builtin(settings)
    if choice.module is not None and not _MODULE_NAME.match(choice.module):
        raise HandlerLoadError(f"option.entryPoint={choice.module!r} is neither a .py file nor a Python module name")
    return choice.origin, choice.path, choice.module


def load_handler(settings: Settings) -> Handler:
    """Import the handler module and return its ``handle``.

    Raises ``HandlerLoadError`` with a message a person can act on."""
    root = Path(settings.model_dir)
    if not root.is_dir() and not settings.model_id:  # option.model_id names the model without one
        raise HandlerLoadError(f"model directory {settings.model_dir} does not exist")
    origin, path, module_name = _locate(settings)
    # A model.py may import modules that sit next to it, as in LMI (an inference.py those in code/).
    for folder in {root, *([path.parent] if path is not None else [])}:
        if folder.is_dir() and str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    log.info("loading handler from %s", origin)
    try:
        if path is not None:
            module = _import_file(path)
        else:
            assert module_name is not None  # _locate: exactly one of file and module
            module = importlib.import_module(module_name)
    except HandlerLoadError:
        raise
    except BaseException as exc:  # SystemExit from a module is a failed import too
        log.exception("importing the handler (%s) failed", origin)
        message = f"importing {origin} failed: {type(exc).__name__}: {exc}"
        if module_name in _BUILTIN_MODULES and isinstance(exc, ImportError) and (exc.name or "").startswith("vllm"):
            hint = describe_missing()  # a vLLM without a name the built-in engines use: all such names
            message += f"; {hint}" if hint else ""
        raise HandlerLoadError(message) from exc
    formatters = Formatters(_decorated(module, "is_input_formatter"), _decorated(module, "is_output_formatter"))
    if module.__name__ in _BUILTIN_MODULES:
        return _engine(module, origin, Formatters())
    fn = getattr(module, "handle", None)
    if fn is None and is_toolkit_script(module):
        return _toolkit(module, origin, settings)
    if fn is None and formatters:
        named = (("@input_formatter", formatters.input), ("@output_formatter", formatters.output))
        found = " and ".join(name for name, f in named if f)
        origin, _, module_name = _builtin(settings)
        log.info("%s has no handle() but %s: serving with %s and those formatters", path or module_name, found, origin)
        return _engine(importlib.import_module(module_name), f"{origin} with the {found} of model.py", formatters)
    if fn is None and settings.entry_point in LMI_BUILTIN_NAMES:  # as LMI: the service it names serves
        origin, _, module_name = _builtin(settings)
        log.info("%s has no handle() and no formatters: serving with %s", path, origin)
        return _engine(importlib.import_module(module_name), origin, Formatters())
    if fn is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise HandlerLoadError(
            f"{origin} defines no function 'handle', no @input_formatter/@output_formatter and no "
            f"SageMaker inference toolkit function (model_fn ...) "
            f"(callables found: {', '.join(public) or 'none'})"
        )
    if not callable(fn):
        raise HandlerLoadError(f"{origin}: 'handle' is a {type(fn).__name__}, not a function")
    shutdown = getattr(module, "shutdown", None)
    handler = Handler(origin=origin, kind=_kind(fn), fn=fn, shutdown=shutdown if callable(shutdown) else None)
    log.info("handler %s loaded (%s handle)", origin, handler.kind.replace("_", " "))
    return handler


def _toolkit(module: Any, origin: str, settings: Settings) -> Handler:
    try:
        toolkit = ToolkitHandler(module, settings.model_dir, settings.default_invocations_accept, settings.task)
    except ValueError as exc:
        raise HandlerLoadError(f"{origin}: {exc}") from None
    found = ", ".join(name for name in FUNCTIONS if callable(getattr(module, name, None)))
    log.info("handler %s loaded (SageMaker inference toolkit script: %s)", origin, found)
    return Handler(origin=origin, kind="sync", fn=toolkit.handle)


def _engine(module: Any, origin: str, formatters: Formatters) -> Handler:
    engine = getattr(module, _BUILTIN_MODULES[module.__name__])
    log.info("handler %s loaded (engine %s)", origin, engine.__name__)
    return Handler(origin=origin, kind=_kind(engine.handle), engine=engine, formatters=formatters)


def _decorated(module: Any, marker: str) -> Callable | None:
    """The first function (by name, as LMI looks) marked by a djl_python decorator."""
    for name in sorted(dir(module)):
        value = getattr(module, name, None)
        if callable(value) and getattr(value, marker, False) is True:
            return value
    return None
