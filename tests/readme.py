"""What the README tells users to run, read from the README itself."""

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.server import REPO, clean_env

README = (REPO / "README.md").read_text()


def shell_commands() -> list[str]:
    """Every command line in the README's ```bash blocks (comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                commands.append(line)
    return commands


def python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def quick_start_curls() -> list[str]:
    section = README[README.index("## Quick start"):README.index("## Configuration")]
    return [c for c in re.findall(r"^curl .*$", section, re.M)]


def on_port(command: str, port: int) -> str:
    return command.replace("localhost:8080", f"localhost:{port}").replace("--port 8080", f"--port {port}")


def run_shell(command: str, port: int, timeout: float = 60) -> subprocess.CompletedProcess:
    env = clean_env({"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    return subprocess.run(on_port(command, port), shell=True, capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=timeout)
