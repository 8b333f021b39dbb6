"""What the container tests share: podman as this machine runs it, the image (built once per run by
docs/image.md's command), and what they measured (build time, size, start and stop times), printed
at the end of every run, CI's included: docs/image.md quotes these numbers.

The build is the run's longest single step and mostly waits on downloads: it starts in the background
as soon as the run's tests are collected (when any container test is among them and podman is here),
and the ``image`` fixture waits for it."""

import shlex
import shutil
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


BUILD_LOG = REPO / "build" / "image-build.log"


class _Build:
    """The base image and then the image, built by a shell in the background (docs/image.md's command)."""

    process: subprocess.Popen | None = None
    started = 0.0

    @classmethod
    def start(cls) -> None:
        if cls.process is not None:
            return
        command = shlex.split(readme_command("make image")) + [f"{k}={v}" for k, v in BUILD_VARIABLES.items()]
        script = f"{shlex.quote(str(Path(__file__).parent / 'base_image.sh'))} {shlex.quote(BASE_IMAGE)} && " \
                 f"{shlex.join(command)}"
        BUILD_LOG.parent.mkdir(exist_ok=True)
        cls.started = time.monotonic()
        with open(BUILD_LOG, "wb") as log:
            cls.process = subprocess.Popen(["bash", "-c", script], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)

    @classmethod
    def wait(cls, timeout: float) -> None:
        cls.start()
        assert cls.process is not None
        code = cls.process.wait(timeout)
        output = BUILD_LOG.read_text(errors="replace")
        assert code == 0, f"the image build exited {code}:\n{output[-10000:]}"


def pytest_collection_finish(session):
    """Start the image build now if this run has a container test to give it to."""
    if session.config.option.collectonly:
        return
    if shutil.which("podman") and any(item.get_closest_marker("container") for item in session.items):
        _Build.start()


def pytest_sessionfinish(session):
    if _Build.process is not None and _Build.process.poll() is None:  # the run ended before a test needed it
        _Build.process.terminate()
        _Build.process.wait(60)


@pytest.fixture(scope="session")
def image() -> str:
    """The CPU image, built by the README's command (cached layers make a rebuild quick)."""
    asked = time.monotonic()
    _Build.wait(timeout=3000)
    # the build ended when its log was last written (its last line is the image's tag)
    ended = time.monotonic() - max(time.time() - BUILD_LOG.stat().st_mtime, 0)
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    MEASURED.append(f"image: {IMAGE} built in {ended - _Build.started:.0f} s, {size / 1e9:.2f} GB; the first "
                    f"container test waited {max(ended - asked, 0):.0f} s for it")
    return IMAGE


def pytest_terminal_summary(terminalreporter):
    if MEASURED:
        terminalreporter.section("container image")
        for line in MEASURED:
            terminalreporter.write_line(line)
