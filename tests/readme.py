"""What the README tells users to run, read from the README itself."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.server import REPO, clean_env

README = (REPO / "README.md").read_text()


def section(title: str) -> str:
    """The README's text under the heading ``title`` (up to the next heading of any level)."""
    start = README.index(title)
    following = re.search(r"^#{2,3} ", README[start + len(title):], re.M)
    return README[start:start + len(title) + (following.start() if following else len(README))]


def shell_commands(text: str = README) -> list[str]:
    """Every command line in ```bash blocks of ``text`` (the README; comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                commands.append(line)
    return commands


def python_snippets(text: str = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def quick_start_curls() -> list[str]:
    section = README[README.index("## Quick start"):README.index("## Configuration")]
    return [c for c in re.findall(r"^curl .*$", section, re.M)]


def on_port(command: str, port: int) -> str:
    return command.replace("localhost:8080", f"localhost:{port}").replace("--port 8080", f"--port {port}")


def run_shell(command: str, port: int, timeout: float = 60) -> subprocess.CompletedProcess:
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
