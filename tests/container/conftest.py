"""What the container tests share: podman as this machine runs it, the image (built once per run by
docs/image.md's command), and what they measured (build time, size, start and stop times), printed
at the end of every run, CI's included: docs/image.md quotes these numbers."""

import shlex
import subprocess
import time
from pathlib import Path

import pytest

from tests.readme import section, shell_commands
from tests.server import REPO

MEASURED: list[str] = []

README_COMMANDS = shell_commands(section("Test the image locally"))  # docs/image.md

PODMAN = ["podman", "--runtime", "runc"]  # the default runtime refuses this machine's cgroups
RUN_LIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]
BASE_IMAGE = "localhost/sagelmi-base:bookworm"
BUILD_VARIABLES = {
    "CONTAINER": " ".join(PODMAN),
    "BASE_IMAGE": BASE_IMAGE,
    "IMAGE_BUILD_FLAGS": "--pull=never --network=host -v /opt/wheels:/opt/wheels:ro --build-arg PIP_FIND_LINKS=/opt/wheels",
}
IMAGE = "localhost/sagelmi:cpu"
STOP_WITHIN = 30  # SageMaker sends SIGKILL 30 s after SIGTERM


def readme_command(start: str) -> str:
    """The command of this README section that is ``start`` or starts with it (there must be one)."""
    found = [c for c in README_COMMANDS if c == start] or [c for c in README_COMMANDS if c.startswith(start)]
    assert len(found) == 1, (start, README_COMMANDS)
    return found[0]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def logs(name: str) -> str:
    result = podman("logs", name, check=False)
    return result.stdout + result.stderr


@pytest.fixture(scope="session")
def image() -> str:
    """The CPU image, built by the README's command (cached layers make a rebuild quick)."""
    subprocess.run([str(Path(__file__).parent / "base_image.sh"), BASE_IMAGE], check=True, timeout=900)
    command = shlex.split(readme_command("make image")) + [f"{k}={v}" for k, v in BUILD_VARIABLES.items()]
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=2400)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    MEASURED.append(f"{IMAGE}: built in {time.monotonic() - started:.0f} s, {size / 1e9:.2f} GB")
    return IMAGE


def pytest_terminal_summary(terminalreporter):
    if MEASURED:
        terminalreporter.section("container image")
        for line in MEASURED:
            terminalreporter.write_line(line)
