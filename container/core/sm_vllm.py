"""AWS's vLLM-container convention: ``SM_VLLM_<ARG>`` environment variables as vLLM arguments.

AWS's SageMaker vLLM container (its entrypoint, in aws/deep-learning-containers) starts vLLM's
server with one argument per ``SM_VLLM_<ARG>`` variable: the name after the prefix in lower case,
underscores as dashes (``SM_VLLM_MAX_MODEL_LEN=300`` -> ``--max-model-len 300``), and by value:

- ``true`` (any case) or empty: the flag alone; ``false``: the flag left out, so the argument
  keeps its default;
- a JSON array: one word per element, an empty array leaves the flag out;
- JSON objects separated by white space: one word per object;
- anything else, a single JSON object too: the value as one word.

sagelmi reads the same variables as settings (``container.core.settings``), the same way: a
variable whose argument is a sagelmi setting is one of that setting's spellings in
``setting_keys.KEYS`` (``SM_VLLM_TENSOR_PARALLEL_SIZE`` is ``option.tensor_parallel_degree``,
``SM_VLLM_MODEL`` is ``option.model_id``); any other names ``option.<arg>``, for one of vLLM's
engine arguments or of the chat options vLLM's server takes (``CHAT_ARGUMENTS``), whose value
becomes the argument as an ``option.*`` value does. A flag alone is ``true``; several words are
one JSON array. A name that is neither is refused: sagelmi's own server stands in for vLLM's
API server (its host, TLS, CORS, API keys ...).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping

from container.core.engine_arg_list import packaged_engine_args, packaged_version

PREFIX = "SM_VLLM_"
# Arguments of vLLM's API server (not of its engine) that LMI names as options and sagelmi's
# chat front reads (lmi_options.json: "front").
CHAT_ARGUMENTS = frozenset(
    {
        "chat_template",
        "chat_template_content_format",
        "enable_auto_tool_choice",
        "tool_call_parser",
        "tool_parser_plugin",
    }
)
DOCS = "docs/moving_from_aws.md"


class SmVllmError(ValueError):
    """An ``SM_VLLM_*`` variable names no argument sagelmi takes; the message says which."""


def argument(variable: str) -> str:
    """``SM_VLLM_MAX_MODEL_LEN`` -> ``max_model_len``: vLLM's name of the argument (its parser
    reads ``--max-model-len`` as ``max_model_len``)."""
    return variable[len(PREFIX) :].lower()


def value_text(value: str) -> str | None:
    """The text sagelmi reads for an ``SM_VLLM_*`` value, as AWS's container passes it to vLLM:
    ``true`` for a flag alone (``true``, ``TRUE``, empty), a JSON array for several words (JSON
    objects separated by white space), the value unchanged otherwise; None for a flag left out
    (``false``, ``[]``)."""
    word = value.strip()
    if word.lower() == "false":
        return None
    if word.lower() in ("true", ""):
        return "true"
    if word.startswith("[") and word.endswith("]"):
        try:
            return None if json.loads(word) == [] else value
        except ValueError:
            return value  # not JSON: vLLM judges the word as given
    if word.startswith("{") and word.endswith("}"):
        objects = _json_objects(word)
        if len(objects) > 1:
            return json.dumps(objects)
    return value


def _json_objects(text: str) -> list[dict]:
    """``{...} {...}`` -> its objects; [] when ``text`` is anything else (a chat template ...)."""
    decoder = json.JSONDecoder()
    objects: list[dict] = []
    index = 0
    while index < len(text):
        try:
            parsed, index = decoder.raw_decode(text, index)
        except ValueError:
            return []
        if not isinstance(parsed, dict):
            return []
        objects.append(parsed)
        while index < len(text) and text[index].isspace():
            index += 1
    return objects


def read_environment(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """``env`` with every ``SM_VLLM_*`` variable as sagelmi reads it: its name in upper case (AWS's
    container lower-cases the whole name) and its value as ``value_text`` gives it, and the
    variables whose flag is left out (``false``, ``[]``), removed from it. Raises ``SmVllmError``
    for a flag alone (``true``, empty) of an engine argument that takes a value."""
    out: dict[str, str] = {}
    left_out: list[str] = []
    for name, value in env.items():
        if not name.startswith(PREFIX):
            out[name] = value
            continue
        text = value_text(value)
        if text is None:
            left_out.append(name)
            continue
        if text == "true":
            _check_flag_alone(name)
        out[PREFIX + name[len(PREFIX) :].upper()] = text
    return out, sorted(left_out)


def _check_flag_alone(variable: str) -> None:
    """Raise ``SmVllmError`` when ``variable`` gives its flag alone and the engine argument takes a value
    (vLLM's parser would stop AWS's container)."""
    name = argument(variable)
    kind = packaged_engine_args().get(name, "bool")
    if kind not in ("bool", "any"):
        flag = "--" + name.replace("_", "-")
        raise SmVllmError(
            f"{variable} is true or empty, which AWS's vLLM container passes as {flag} alone, but {flag} "
            f"takes a value ({' | '.join(kind) if isinstance(kind, list) else kind})"
        )


def option_key(variable: str, spelled: Iterable[str] = ()) -> str:
    """The ``option.*`` key of an ``SM_VLLM_*`` variable that is not a spelling of a sagelmi setting
    (``SM_VLLM_MAX_MODEL_LEN`` -> ``option.max_model_len``); ``spelled``: the ``SM_VLLM_*`` names
    that are (for the hint). Raises ``SmVllmError`` for a name that is neither one of the packaged
    vLLM's engine arguments nor of ``CHAT_ARGUMENTS``."""
    name = argument(variable)
    if name in packaged_engine_args() or name in CHAT_ARGUMENTS:
        return f"option.{name}"
    known = [PREFIX + n.upper() for n in (*packaged_engine_args(), *CHAT_ARGUMENTS)]
    known += [n for n in spelled if n.startswith(PREFIX)]
    close = difflib.get_close_matches(variable, sorted(known), n=2, cutoff=0.75)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    flag = "--" + name.replace("_", "-") if name else "no argument"
    raise SmVllmError(
        f"{variable} names {flag}, which is not an engine argument of vLLM {packaged_version()} nor a chat "
        f"option{hint}; sagelmi takes SM_VLLM_* for vLLM's engine arguments and chat options, and its own "
        f"server stands in for the rest of vLLM's server arguments ({DOCS} lists the equivalents)"
    )
