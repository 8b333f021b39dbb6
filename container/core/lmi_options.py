"""Every option name of LMI's configuration pages, and what sagelmi does with it.

The list is data (``lmi_options.json`` next to this module): per name, as
``serving.properties`` spells it, the djl-serving pages it comes from, the
engines LMI applies it to, an example value and sagelmi's handling:

- ``setting``: a sagelmi setting (``container.core.setting_keys.KEYS``);
- ``engine_arg``: becomes a vLLM engine argument (under its name, renamed, or
  folded into ``speculative_config``; ``lmcache_config_file``: an environment variable);
- ``front``: read by vLLM's OpenAI chat serving (tool calls, reasoning, chat template);
  never an engine argument, except ``reasoning_parser``, which is one too;
- ``warn``: accepted, with one WARNING line saying what sagelmi does instead
  (``text``), unless the value is one of ``silent_values``.

``container.core.engine_args`` (``option.*`` names) and ``container.core.settings``
(server-level names) read it; ``sagelmi lmi-options --write`` renders it as
``docs/lmi_options.md``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

OPTIONS_FILE = Path(__file__).with_name("lmi_options.json")
HANDLINGS = ("setting", "engine_arg", "front", "warn")
GITHUB = "https://github.com"


@dataclass(frozen=True)
class Page:
    """One source of names: files of a repository at a commit."""

    code: str
    repository: str
    commit: str
    paths: tuple[str, ...]
    note: str = ""

    def urls(self) -> tuple[str, ...]:
        return tuple(f"{GITHUB}/{self.repository}/blob/{self.commit}/{path}" for path in self.paths)


@dataclass(frozen=True)
class LmiOption:
    """One LMI option name and sagelmi's handling of it."""

    name: str  # as serving.properties spells it: option.max_model_len, minWorkers
    pages: tuple[Page, ...]
    engines: str  # the engines LMI applies it to
    example: str
    handling: str  # one of HANDLINGS
    text: str  # what sagelmi does; for "warn", the WARNING line's reason
    silent_values: tuple[str, ...] = ()  # "warn" values that need no warning

    @property
    def is_option(self) -> bool:
        return self.name.startswith("option.")

    def warning(self, value: str | None = None) -> str | None:
        """The WARNING line for this name set to ``value`` (None: nothing to say)."""
        if self.handling != "warn" or (value is not None and value.strip().lower() in self.silent_values):
            return None
        return f"{self.name} is ignored: {self.text}"


@functools.cache
def _document() -> dict:
    return json.loads(OPTIONS_FILE.read_text())


@functools.cache
def pages() -> dict[str, Page]:
    """The sources of the list by code, as ``lmi_options.json`` names them."""
    doc = _document()
    return {
        code: Page(
            code,
            page.get("repository", doc["repository"]),
            page.get("commit", doc["commit"]),
            tuple(page["paths"]),
            page.get("note", ""),
        )
        for code, page in doc["pages"].items()
    }


@functools.cache
def lmi_options() -> tuple[LmiOption, ...]:
    """Every LMI option name in the list, in its order."""
    by_code = pages()
    return tuple(
        LmiOption(
            name=entry["name"],
            pages=tuple(by_code[code] for code in entry["pages"]),
            engines=entry["engines"],
            example=entry["example"],
            handling=entry["handling"],
            text=entry["text"],
            silent_values=tuple(entry.get("silent_values", ())),
        )
        for entry in _document()["options"]
    )


@functools.cache
def _by_key() -> dict[str, LmiOption]:
    return {entry.name.lower(): entry for entry in lmi_options()}


def option_entry(name: str) -> LmiOption | None:
    """The entry of the ``option.*`` name ``name`` (without the prefix, any case)."""
    return _by_key().get(f"option.{name.lower()}")


def server_entry(key: str) -> LmiOption | None:
    """The entry of a server-level ``serving.properties`` key (no ``option.``), any case."""
    entry = _by_key().get(key.lower())
    return entry if entry is not None and not entry.is_option else None


def reference_page() -> str:
    """``docs/lmi_options.md``: the list as a Markdown table."""
    doc = _document()
    counts = {h: sum(1 for e in lmi_options() if e.handling == h) for h in HANDLINGS}
    lines = [
        "# LMI's option names in sagelmi",
        "",
        "<!-- generated from container/core/lmi_options.json by `sagelmi lmi-options --write`; do not edit -->",
        "",
        f"Every option name in LMI's configuration pages and properties code ({len(lmi_options())} names, read "
        f"in [{doc['repository']}]({GITHUB}/{doc['repository']}/tree/{doc['commit']}) at `{doc['commit'][:8]}`) "
        "is accepted. What sagelmi does with each:",
        "",
        f"- **setting** ({counts['setting']}): a sagelmi setting "
        "(see the table in [configuration.md](configuration.md#every-setting));",
        f"- **vLLM** ({counts['engine_arg']}): passed to vLLM's engine, under its name or translated;",
        f"- **chat** ({counts['front']}): read by vLLM's OpenAI chat serving (tool calls, reasoning, chat template);",
        f"- **ignored** ({counts['warn']}): accepted with one WARNING line in the log, `<name> is ignored: <why>`, "
        "whose reason is the text below. `option.*` names are checked when the built-in vLLM engine serves; "
        "a `model.py` gets them all as they are.",
        "",
        "| name | sagelmi | what sagelmi does | LMI page |",
        "|---|---|---|---|",
    ]
    label = {"setting": "setting", "engine_arg": "vLLM", "front": "chat", "warn": "ignored"}
    for entry in lmi_options():
        links = ", ".join(
            f"[{Path(path).name}{' (old)' if page.commit != doc['commit'] else ''}]({url})"
            for page in entry.pages
            for path, url in zip(page.paths, page.urls(), strict=True)
        )
        silent = f" Silent for {', '.join(entry.silent_values)}." if entry.silent_values else ""
        lines.append(f"| `{entry.name}` | {label[entry.handling]} | {entry.text}.{silent} | {links} |")
    return "\n".join(lines) + "\n"
