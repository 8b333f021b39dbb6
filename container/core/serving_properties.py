"""Reading ``serving.properties`` (Java properties syntax, as LMI writes it)."""

from __future__ import annotations

import re
from pathlib import Path

_SEPARATOR = re.compile(r"(?<!\\)[=:]|(?<!\\)\s")


def parse_properties(text: str) -> dict[str, tuple[str, int]]:
    """Return ``{key: (value, line_number)}``.

    Supports ``key=value``, ``key: value`` and ``key value``; ``#`` and ``!``
    comment lines; a trailing backslash continues the value on the next line.
    A key given twice keeps its last value, as Java does.
    """
    result: dict[str, tuple[str, int]] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        start = i + 1
        line = lines[i].strip()
        i += 1
        if not line or line[0] in "#!":
            continue
        while line.endswith("\\") and not line.endswith("\\\\") and i < len(lines):
            line = line[:-1] + lines[i].strip()
            i += 1
        match = _SEPARATOR.search(line)
        if match is None:
            key, value = line, ""
        else:
            key = line[: match.start()]
            value = line[match.end() :].strip()
            if match.group().isspace() and value[:1] in ("=", ":"):
                value = value[1:].strip()
        result[key.strip().replace("\\", "")] = (value, start)
    return result


def read_properties(path: Path) -> dict[str, tuple[str, int]]:
    """Parse the file at ``path``; an absent file gives an empty dict."""
    if not path.is_file():
        return {}
    return parse_properties(path.read_text(encoding="utf-8"))
