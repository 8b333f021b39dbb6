"""The chat options (``container.core.chat_options``) made real for vLLM, at engine start: the
tool and reasoning parsers found (a tool parser plugin imported first) and tried on the
tokenizer. Anything that cannot work stops start-up with one line naming the option."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from container.core.chat_options import ChatOptionError, ChatOptions

log = logging.getLogger("sagelmi.vllm")


def check_parsers(options: ChatOptions, tokenizer: Any, model_dir: str) -> None:
    """Find the tool and reasoning parsers the options name, and build each once on the
    tokenizer (a reasoning parser needs its tokens in the vocabulary)."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    if options.tool_parser_plugin:
        plugin = Path(options.tool_parser_plugin)
        plugin = plugin if plugin.is_absolute() else Path(model_dir) / plugin
        if not plugin.is_file():
            raise ChatOptionError(f"option.tool_parser_plugin={options.tool_parser_plugin}: no such file")
        ToolParserManager.import_tool_parser(str(plugin))
    for name, value, manager, get in (
        ("tool_call_parser", options.tool_call_parser, ToolParserManager, "get_tool_parser"),
        ("reasoning_parser", options.reasoning_parser, ReasoningParserManager, "get_reasoning_parser"),
    ):
        if not value:
            continue
        try:
            parser = getattr(manager, get)(value)
        except KeyError:
            known = ", ".join(manager.list_registered())
            raise ChatOptionError(f"option.{name}={value} is not one of vLLM's parsers ({known})") from None
        try:
            parser(tokenizer)
        except Exception as exc:  # e.g. a reasoning parser whose tokens the vocabulary lacks
            raise ChatOptionError(f"option.{name}={value} cannot work with this model's tokenizer: {exc}") from None
        log.info("%s: %s", name, value)
