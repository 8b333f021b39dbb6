"""The image the container tests run, built by docs/image.md's command in the background.

The build is the run's longest single step (a Debian base made with debootstrap when missing, then
the image, 4.5 GB). ``make test`` starts it before it installs the venv, with the system's Python:
``python3 -m tests.container.image_build start`` (standard library only), so that it overlaps the
install instead of the tests' first engine starts; the lanes are told where its record is
(``SAGELMI_IMAGE_BUILD``) and the ``image`` fixture waits for it. A pytest run that was told of no
build starts its own once its tests are collected (tests/container/conftest.py).

The record, ``build/image-build.json``: the build's process (a session of its own), when it started
(wall clock) and the command. The build's shell writes its exit status to ``build/image-build.rc``
and its output to ``build/image-build.log``.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.readme import REPO, section, shell_commands

PODMAN = ["podman", "--runtime", "runc"]  # the default runtime refuses this machine's cgroups
BASE_IMAGE = "localhost/sagelmi-base:bookworm"
BUILD_VARIABLES = {
    "CONTAINER": " ".join(PODMAN),
    "BASE_IMAGE": BASE_IMAGE,
    "IMAGE_BUILD_FLAGS": "--pull=never --network=host -v /opt/wheels:/opt/wheels:ro "
                         "--build-arg PIP_FIND_LINKS=/opt/wheels",
}
RECORD = REPO / "build" / "image-build.json"
STATUS = REPO / "build" / "image-build.rc"
LOG = REPO / "build" / "image-build.log"
ENV = "SAGELMI_IMAGE_BUILD"  # names the record of a build the run's tests are to wait for


@functools.cache
def readme_commands() -> tuple[str, ...]:
    """docs/image.md's commands ("Test the image locally"), which the container tests run (read once)."""
    return tuple(shell_commands(section("Test the image locally")))


def readme_command(start: str) -> str:
    """docs/image.md's command that is ``start`` or starts with it (there must be one)."""
    commands = readme_commands()
    found = [c for c in commands if c == start] or [c for c in commands if c.startswith(start)]
    assert len(found) == 1, (start, commands)
    return found[0]


def command() -> str:
    """The shell command that builds the base image when missing, then the image."""
    make = shlex.split(readme_command("make image")) + [f"{k}={v}" for k, v in BUILD_VARIABLES.items()]
    base = Path(__file__).parent / "base_image.sh"
    return f"{shlex.quote(str(base))} {shlex.quote(BASE_IMAGE)} && {shlex.join(make)}"


def start(folder: Path = REPO / "build", script: str | None = None) -> dict:
    """Start the build (or ``script``) in the background and write its record in ``folder`` (an
    older record and status there go)."""
    record_path, status_path, log_path = (folder / RECORD.name, folder / STATUS.name, folder / LOG.name)
    for path in (record_path, status_path):
        path.unlink(missing_ok=True)
    folder.mkdir(exist_ok=True)
    script = script or command()
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # not make test's
    with open(log_path, "wb") as log:
        process = subprocess.Popen(["bash", "-c", f"( {script} ); echo $? > {shlex.quote(str(status_path))}"], cwd=REPO,
                                   env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    record = {"pid": process.pid, "started": time.time(), "command": script, "status": str(status_path),
              "log": str(log_path)}
    record_path.write_text(json.dumps(record))
    return record


def read(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def status(record: dict) -> int | None:
    """The build's exit status; None while it runs. A build whose process is gone without one failed."""
    written = Path(record["status"])
    for _ in range(2):  # again after finding the process gone: it writes its status as it ends
        try:
            return int(written.read_text())
        except (FileNotFoundError, ValueError):
            pass
        if _running(record["pid"]):
            return None
    return -1


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, left for the process that started it to reap, does not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, IndexError):
        return False
    return fields[0] != "Z"


def wait(record: dict, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while (code := status(record)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the image build (pid {record['pid']}) still ran after {timeout:.0f} s")
        time.sleep(1)
    return code


def stop(record: dict) -> None:
    """End a build still running (its whole session)."""
    if status(record) is None:
        try:
            os.killpg(record["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass


def main(argv: list[str]) -> int:
    if argv != ["start"]:
        print("usage: python3 -m tests.container.image_build start", file=sys.stderr)
        return 2
    if shutil.which("podman") is None:
        print("image build: podman is not installed; the container tests will be skipped")
        RECORD.unlink(missing_ok=True)
        return 0
    record = start()
    print(f"image build: started in the background (pid {record['pid']}, output in {LOG.relative_to(REPO)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
