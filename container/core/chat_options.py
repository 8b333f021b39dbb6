"""The options of the OpenAI chat front (vLLM's own server flags, LMI's names for them): chat
template, tool calling and reasoning. They are not engine arguments: the built-in engine hands
them to vLLM's chat serving classes (``handlers.engines.vllm_openai``), except
``reasoning_parser``, which vLLM's engine takes too (structured output starts after the
reasoning ends).

Read and checked here, without vLLM, so that ``sagelmi config``, ``sagelmi serve`` (before any
download) and the SDK refuse a combination that cannot work, or a template that is missing or
does not compile, with the same line; whether a parser name exists the engine checks when it
starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from container.core.settings import Settings

CONTENT_FORMATS = ("auto", "string", "openai")
# option names (without "option.") this module reads
NAMES = (
    "chat_template",
    "chat_template_content_format",
    "enable_auto_tool_choice",
    "tool_call_parser",
    "tool_parser_plugin",
    "reasoning_parser",
    "enable_reasoning",
)
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")

log = logging.getLogger(__name__)


class ChatOptionError(ValueError):
    """A chat option that cannot work; the message says why and what to set."""


@dataclass(frozen=True)
class ChatOptions:
    chat_template: str | None = None  # a file (in the model directory, or absolute) or the template's text
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    tool_parser_plugin: str | None = None  # a Python file registering a tool parser (vLLM's plugin form)
    reasoning_parser: str | None = None
    trust_request_mm_kwargs: bool = False  # a request's media_io_kwargs / mm_processor_kwargs taken (vLLM's flag)


def _flag(name: str, raw: str | None) -> bool:
    if raw is None:
        return False
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ChatOptionError(f"option.{name}={raw!r} is not true or false")


def chat_options(settings: Settings) -> ChatOptions:
    """The chat front's options from the settings; ``ChatOptionError`` for a combination that
    cannot work (as vLLM's server and LMI refuse it)."""
    given = settings.passthrough_options()

    def text(name: str) -> str | None:
        value = given.get(name)
        return value.strip() or None if value is not None else None

    content_format = (text("chat_template_content_format") or "auto").lower()
    if content_format not in CONTENT_FORMATS:
        raise ChatOptionError(
            f"option.chat_template_content_format={given['chat_template_content_format']!r} "
            f"is not one of {', '.join(CONTENT_FORMATS)}"
        )
    auto_tools = _flag("enable_auto_tool_choice", given.get("enable_auto_tool_choice"))
    tool_parser = text("tool_call_parser")
    if auto_tools and tool_parser is None:
        raise ChatOptionError(
            "option.enable_auto_tool_choice=true needs option.tool_call_parser, the parser of the model's "
            "tool-call format (e.g. hermes, llama3_json, mistral)"
        )
    reasoning_parser = text("reasoning_parser")
    if _flag("enable_reasoning", given.get("enable_reasoning")) and reasoning_parser is None:
        raise ChatOptionError(
            "option.enable_reasoning=true needs option.reasoning_parser, the parser of the model's "
            "reasoning format (e.g. deepseek_r1, qwen3)"
        )
    return ChatOptions(
        chat_template=given.get("chat_template") or None,
        chat_template_content_format=cast(Literal["auto", "string", "openai"], content_format),
        enable_auto_tool_choice=auto_tools,
        tool_call_parser=tool_parser,
        tool_parser_plugin=text("tool_parser_plugin"),
        reasoning_parser=reasoning_parser,
        trust_request_mm_kwargs=settings.trust_request_mm_kwargs,
    )


def chat_template(value: str | None, model_dir: str) -> str | None:
    """``option.chat_template``'s template text: a file in the model directory, an absolute
    path, or the template itself (text with ``{{`` or ``{%``); None for the tokenizer's own.
    ``ChatOptionError`` for a missing file or a template that does not compile (checked with
    Jinja, which renders chat templates; skipped where Jinja is not installed, as in the SDK's
    light install)."""
    if value is None:
        return None
    if "{{" in value or "{%" in value:
        text, origin = value, "the template given"
    else:
        path = Path(value) if Path(value).is_absolute() else Path(model_dir) / value
        if not path.is_file():
            raise ChatOptionError(
                f"option.chat_template={value}: no such file (a file in the model directory, an absolute path, "
                f"or the template's text)"
            )
        text, origin = path.read_text(encoding="utf-8"), path.name
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return text
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatOptionError(
            f"option.chat_template ({origin}) does not compile: {exc.message} (line {exc.lineno})"
        ) from None
    return text
