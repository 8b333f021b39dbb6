"""Settings -> vLLM engine arguments.

The typed LMI settings that are engine arguments (``max_rolling_batch_size`` ->
``max_num_seqs``, ``tensor_parallel_degree`` -> ``tensor_parallel_size`` ...) come
from the settings schema (``container.core.setting_keys.KEYS``, each with its
``engine_arg``). Of the other ``option.x`` values, LMI's names for engine
arguments are translated (``dtype`` words, ``cpu_offload_gb_per_gpu``, the
speculative-decoding names -> ``speculative_config``), and any name that is a vLLM
engine argument passes through, its text converted to the argument's type. LMI's
names that vLLM does not take (``lmi_options.json``: other engines' options, the
chat front's) are accepted, the ignored ones with one WARNING line. A name that
is none of these stops start-up, naming the nearest valid names.

Which names are vLLM engine arguments is read from the packaged list
(``container.core.engine_arg_list``: name -> a simple kind of value), generated
from the installed vLLM's ``AsyncEngineArgs`` by ``sagelmi engine-args --write``. The
list lets ``check_engine_option`` run without vLLM: the container runs it
before building the engine, and the SDK (``sagemaker_sdk``) runs it on a laptop
before anything reaches AWS, with the same message.
"""

from __future__ import annotations

import difflib
import json
import logging
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from container.core.chat_options import ChatOptionError, chat_options, chat_template
from container.core.dtypes import vllm_dtype
from container.core.engine_arg_list import packaged_engine_args
from container.core.handler_choice import uses_builtin_engine
from container.core.known_bad import KnownBadCombination, check_known_bad
from container.core.lmi_options import lmi_options, option_entry
from container.core.setting_keys import KEYS
from container.core.settings import Settings

log = logging.getLogger(__name__)

# LMI name -> vLLM engine argument, for LMI options that are not sagelmi settings
RENAMED = {"cpu_offload_gb_per_gpu": "cpu_offload_gb"}
# LMI's speculative-decoding options (lmi-dist's and vLLM 0.6's names): name -> (speculative_config field, kind)
SPECULATIVE = {
    "speculative_draft_model": ("model", "str"),
    "speculative_model": ("model", "str"),
    "draft_model_id": ("model", "str"),
    "speculative_length": ("num_speculative_tokens", "int"),
    "num_speculative_tokens": ("num_speculative_tokens", "int"),
    "spec_length": ("num_speculative_tokens", "int"),
    "draft_model_tp_size": ("draft_tensor_parallel_size", "int"),
    "speculative_draft_tensor_parallel_size": ("draft_tensor_parallel_size", "int"),
    "speculative_model_quantization": ("quantization", "str"),
    "speculative_max_model_len": ("max_model_len", "int"),
    "ngram_prompt_lookup_max": ("prompt_lookup_max", "int"),
    "ngram_prompt_lookup_min": ("prompt_lookup_min", "int"),
}
# LMI options the worker groups get as environment variables, read by a library vLLM loads
ENVIRONMENT = {"lmcache_config_file": "LMCACHE_CONFIG_FILE"}
# Engine arguments taking a mapping that LMI documents as "key=value,key=value" (vLLM 0.32 takes JSON only)
KEY_VALUE_LISTS = {"limit_mm_per_prompt"}


class EngineOptionError(ValueError):
    """An option cannot become an engine argument; the message says why."""


def convert_option(name: str, raw: str, target: str, tp: Any) -> Any:
    """Text -> the engine argument's type ``tp`` (JSON accepted for structured values)."""
    candidates: list[Any] = [raw]
    try:
        candidates.append(json.loads(raw))
    except ValueError:
        pass
    try:
        adapter = TypeAdapter(tp)
    except Exception:  # a type pydantic cannot build (forward references, classes): pass as given
        return candidates[-1]
    errors = []
    for candidate in candidates:
        try:
            return adapter.validate_python(candidate)
        except ValidationError as exc:
            errors.append(exc.errors()[0]["msg"])
    raise EngineOptionError(f"option.{name}={raw!r} is not a valid value for vLLM's {target}: {errors[-1]}")


def lmi_value(name: str, raw: str) -> str:
    """The text vLLM takes for ``option.<name>``: LMI's ``image=2,video=1`` for the options of
    ``KEY_VALUE_LISTS`` becomes ``{"image": 2, "video": 1}``; anything else (JSON) is unchanged.
    Raises ``EngineOptionError`` for a pair without a whole number."""
    if name not in KEY_VALUE_LISTS or raw.lstrip().startswith("{"):
        return raw
    pairs = {}
    for item in raw.split(","):
        key, _, value = (part.strip() for part in item.partition("="))
        if not key or not value.isdigit():
            raise EngineOptionError(
                f'option.{name}={raw!r}: expected JSON ({{"image": 2}}) or LMI\'s form image=2,video=1, '
                f"a whole number for each kind of media"
            )
        pairs[key] = int(value)
    return json.dumps(pairs)


def _unknown(name: str, engine_args: typing.Iterable[str]) -> EngineOptionError:
    valid = (
        set(engine_args)
        | set(RENAMED)
        | set(SPECULATIVE)
        | set(ENVIRONMENT)
        | {"dtype"}
        | {e.name[len("option.") :] for e in lmi_options() if e.is_option and e.handling != "warn"}
        | {k.key[len("option.") :] for k in KEYS if k.key.startswith("option.")}
    )
    close = difflib.get_close_matches(name, sorted(valid), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join('option.' + c for c in close)}?" if close else ""
    return EngineOptionError(
        f"option.{name} is neither an LMI option nor a vLLM engine argument{hint} "
        f"(vLLM's engine arguments are listed at https://docs.vllm.ai/en/latest/configuration/engine_args.html)"
    )


# -- checking a value against the packaged list's kind ---------------------------------

# The kinds of value the list knows; a list of values instead of a kind means "one of these".
SIMPLE_KINDS = {bool: "bool", int: "int", float: "float", str: "str"}
KIND_TYPES = {"bool": bool, "int": int, "float": float}


def _check_value(name: str, raw: str, target: str, kind: str | list) -> None:
    if isinstance(kind, list):
        convert_option(name, raw, target, Literal[tuple(kind)])
    elif kind in KIND_TYPES:
        convert_option(name, raw, target, KIND_TYPES[kind])
    elif kind == "json":
        try:
            json.loads(raw)
        except ValueError:
            raise EngineOptionError(
                f"option.{name}={raw!r} is not a valid value for vLLM's {target}: expected JSON (an object or a list)"
            ) from None


def is_engine_argument(name: str) -> bool:
    """Whether ``option.<name>`` (not a sagelmi setting) becomes one of vLLM's engine
    arguments: not an LMI name that vLLM's engine never sees (``warn`` and ``front``
    entries of ``lmi_options.json``, but ``reasoning_parser``, which is both)."""
    entry = option_entry(name)
    if entry is None or entry.handling not in ("warn", "front"):
        return name not in ENVIRONMENT
    return entry.handling == "front" and name in packaged_engine_args()


def check_engine_option(name: str, raw: str | None = None) -> None:
    """Refuse ``option.<name>`` (an option that is not a sagelmi setting) for the
    built-in engine unless it is an LMI option or a vLLM engine argument in the
    packaged list; with ``raw``, also check its text against the argument's kind
    (the container converts to vLLM's real type afterwards).

    The one check the container (``build_engine_kwargs``) and the SDK run.
    Raises ``EngineOptionError``."""
    engine_args = packaged_engine_args()
    if not is_engine_argument(name):
        # the chat front's, ignored ones (check_engine_options says so), or a file
        # engine_environment checks at start-up
        return
    kind: str | list  # a kind of KIND_TYPES, or the choices
    if name in SPECULATIVE:
        target, kind = SPECULATIVE[name]
        target = f"speculative_config.{target}"
    elif name == "dtype":
        target, kind = "dtype", engine_args.get("dtype", "any")
        raw = raw if raw is None else vllm_dtype(raw)
    else:
        target = RENAMED.get(name, name)
        if target not in engine_args:
            raise _unknown(name, engine_args)
        kind = engine_args[target]
    if raw is not None:
        _check_value(name, lmi_value(name, raw), target, kind)


def check_engine_options(settings: Settings, handler_dir: Path | None, known_bad: bool = True) -> None:
    """Refuse, before anything starts or downloads, an ``option.*`` the built-in engine would
    refuse: the one check ``sagelmi config``, ``sagelmi serve`` and the SDK run on resolved
    settings. An LMI name sagelmi ignores is accepted with one WARNING line saying what
    sagelmi does instead (here only: the worker skips it silently). Nothing is checked when
    a ``model.py`` or the Accelerate engine serves (their options are theirs). Raises
    ``EngineOptionError`` naming the option and the nearest names."""
    if not uses_builtin_engine(settings, handler_dir):
        return
    try:
        if known_bad:  # the installed vLLM's rows (container.core.known_bad); the SDK cannot know the image's
            check_known_bad(settings)
    except KnownBadCombination as exc:
        raise EngineOptionError(str(exc)) from None
    _check_batch_limits(settings)
    try:
        chosen = chat_options(settings)
        if handler_dir is not None:  # the SDK without a handler directory cannot see the model's files
            chat_template(chosen.chat_template, str(handler_dir))
    except ChatOptionError as exc:
        raise EngineOptionError(str(exc)) from None
    for name, raw in settings.passthrough_options().items():
        entry = option_entry(name)
        if entry is not None and entry.handling == "warn":
            warning = entry.warning(raw)
            if warning:
                log.warning("%s", warning)
            continue
        try:
            check_engine_option(name, raw)
        except EngineOptionError as exc:
            raise _named_by_variable(exc, settings.sources.get(f"option.{name}", "")) from None


def _named_by_variable(exc: EngineOptionError, source: str) -> EngineOptionError:
    """The refusal of an option set by an ``SM_VLLM_*`` variable starts with the variable's name
    (the message names the option, which the user spelled otherwise)."""
    variable = source.removeprefix("env ")
    return EngineOptionError(f"{variable}: {exc}") if variable.startswith("SM_VLLM_") else exc


def _check_batch_limits(settings: Settings) -> None:
    """vLLM's scheduler needs room for every sequence's step in one batch (max_num_batched_tokens
    >= max_num_seqs); it says so only once the model is loading."""
    prefill = settings.max_rolling_batch_prefill_tokens
    options = settings.passthrough_options()
    if prefill is None and options.get("max_num_batched_tokens", "").isdigit():
        prefill = int(options["max_num_batched_tokens"])
    if prefill is not None and prefill < settings.max_rolling_batch_size:
        raise EngineOptionError(
            f"option.max_rolling_batch_prefill_tokens={prefill} is less than option.max_rolling_batch_size="
            f"{settings.max_rolling_batch_size}: vLLM needs a batch of at least one token per sequence "
            f"(max_num_batched_tokens >= max_num_seqs); raise the first or lower the second"
        )


def engine_environment(settings: Settings) -> dict[str, str]:
    """Environment variables the worker groups get from LMI options (``ENVIRONMENT``):
    ``option.lmcache_config_file`` -> ``LMCACHE_CONFIG_FILE``, a relative path being in
    the model directory, as LMI resolves it. Raises ``EngineOptionError`` for a file that
    does not exist (LMI stops too)."""
    out = {}
    options = settings.passthrough_options()
    for name, variable in ENVIRONMENT.items():
        if name not in options:
            continue
        path = Path(settings.model_dir) / options[name]  # an absolute value stays itself
        if not path.is_file():
            raise EngineOptionError(f"option.{name}={options[name]!r}: no such file ({path})")
        out[variable] = str(path.absolute())
    return out
