"""What the container tests share: podman as this machine runs it, the image (built once per run by
docs/image.md's command, tests/container/image_build.py), and what they measured (build time, size,
start and stop times), printed at the end of every run, CI's included: docs/image.md quotes these
numbers.

The build is the run's longest single step: ``make test`` starts it before it installs the venv and
names it to the lanes (``SAGELMI_IMAGE_BUILD``); a run that was named none starts it as soon as its
tests are collected (when any container test is among them and podman is here). The ``image``
fixture waits for it."""

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.container import image_build
from tests.container.image_build import PODMAN

MEASURED: list[str] = []

RUN_LIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]
IMAGE = "localhost/sagelmi:cpu"
STOP_WITHIN = 30  # SageMaker sends SIGKILL 30 s after SIGTERM


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def logs(name: str) -> str:
    result = podman("logs", name, check=False)
    return result.stdout + result.stderr


class _Build:
    """This run's build: the one ``make test`` started, or one of its own (``owned``)."""

    record: dict | None = None
    owned = False

    @classmethod
    def start(cls) -> None:
        if cls.record is not None:
            return
        named = os.environ.get(image_build.ENV)
        if named:
            cls.record = image_build.read(named)
        else:
            cls.record, cls.owned = image_build.start(), True

    @classmethod
    def wait(cls, timeout: float) -> None:
        cls.start()
        assert cls.record is not None
        assert cls.record["command"] == image_build.command(), "the build ran another command than docs/image.md's"
        code = image_build.wait(cls.record, timeout)
        output = Path(cls.record["log"]).read_text(errors="replace")
        assert code == 0, f"the image build exited {code}:\n{output[-10000:]}"


def pytest_collection_finish(session):
    """Start the image build now if this run has a container test to give it to and none was started."""
    if session.config.option.collectonly:
        return
    if shutil.which("podman") and any(item.get_closest_marker("container") for item in session.items):
        _Build.start()


def pytest_sessionfinish(session):
    if _Build.owned and _Build.record is not None:  # the run ended before a test needed it
        image_build.stop(_Build.record)


@pytest.fixture(scope="session")
def image() -> str:
    """The CPU image, built by the README's command (cached layers make a rebuild quick)."""
    asked = time.time()
    _Build.wait(timeout=3000)
    assert _Build.record is not None
    ended = Path(_Build.record["status"]).stat().st_mtime  # the build's shell wrote its status as it ended
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    MEASURED.append(f"image: {IMAGE} built in {ended - _Build.record['started']:.0f} s, {size / 1e9:.2f} GB; the "
                    f"first container test waited {max(ended - asked, 0):.0f} s for it")
    return IMAGE


def pytest_terminal_summary(terminalreporter):
    if MEASURED:
        terminalreporter.section("container image")
        for line in MEASURED:
            terminalreporter.write_line(line)
