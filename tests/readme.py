"""What the README and the pages under docs/ tell users to run, read from them.

Only the standard library at import: ``make test`` reads the image's build command with the system's
Python, before the venv is installed (tests/container/image_build.py)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def documents() -> dict[str, str]:
    """README.md and every Markdown page under docs/, by path relative to the repository (README first)."""
    pages = sorted(path for path in (REPO / "docs").rglob("*.md"))
    return {"README.md": README, **{str(path.relative_to(REPO)): path.read_text() for path in pages}}


def _heading(title: str) -> re.Pattern[str]:
    """A heading line whose text is ``title``, at any level (``"## X"`` and ``"X"`` look up the same)."""
    return re.compile(r"^#{1,6} " + re.escape(title.lstrip("#").strip()) + r"[ \t]*$", re.M)


def section_file(title: str) -> str:
    """The one document (README.md or a page under docs/) that has the heading ``title``."""
    found = [name for name, text in documents().items() if _heading(title).search(text)]
    assert len(found) == 1, f"heading {title!r} must be in exactly one document, found in {found}"
    return found[0]


def section(title: str) -> str:
    """The text under the heading ``title`` (from the heading up to the next heading of any level),
    wherever it is: the README or a page under docs/ (a title must be in exactly one of them)."""
    text = documents()[section_file(title)]
    (match,) = _heading(title).finditer(text)
    following = re.compile(r"^#{1,6} ", re.M).search(text, match.end())
    return text[match.start():following.start() if following else len(text)]


def shell_commands(text: str = README) -> list[str]:
    """Every command line in ```bash blocks of ``text`` (the README unless given; comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                commands.append(line)
    return commands


def python_snippets(text: str = README) -> list[str]:
    """Every ```python block of ``text`` (the README unless given)."""
    return re.findall(r"```python\n(.*?)```", text, re.S)


def quick_start_curls() -> list[str]:
    return re.findall(r"^curl .*$", section("Quick start"), re.M)


def on_port(command: str, port: int) -> str:
    return command.replace("localhost:8080", f"localhost:{port}").replace("--port 8080", f"--port {port}")


def run_shell(command: str, port: int, timeout: float = 60) -> subprocess.CompletedProcess:
    from tests.server import clean_env

    env = clean_env({"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    return subprocess.run(on_port(command, port), shell=True, capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=timeout)


def serve_settings(command: str) -> tuple[dict[str, str], str]:
    """``VAR=value ... sagelmi serve --model-dir DIR --port N`` -> (the variables, DIR):
    what a test's ``Server`` needs to start the same server on its own port."""
    words = shlex.split(command)
    env = {}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[:2] == ["sagelmi", "serve"], command
    return env, words[words.index("--model-dir") + 1]
