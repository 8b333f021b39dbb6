"""The background build of the container tests' image (tests/container/image_build.py): what make
test starts before the venv exists, and what the lanes wait for."""

import subprocess
import sys
import time

from tests.container import image_build
from tests.server import REPO


def test_make_test_can_start_it_with_the_standard_library_alone():
    # -S: no site-packages, as the system's Python before the install; -E: nothing from the environment
    script = "import tests.container.image_build as build; build.command()"
    result = subprocess.run([sys.executable, "-S", "-E", "-c", script], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_command_is_docs_image_mds_and_builds_the_base_first():
    command = image_build.command()
    assert command.split(" && ")[0].endswith("base_image.sh localhost/sagelmi-base:bookworm")
    assert image_build.readme_command("make image") in command


def test_a_build_is_waited_for_and_its_status_is_what_its_shell_ended_with(tmp_path):
    record = image_build.start(tmp_path, "sleep 0.5; echo building; exit 3")
    assert image_build.status(record) is None  # still running
    assert image_build.wait(record, 30) == 3
    assert image_build.read(tmp_path / image_build.RECORD.name) == record
    assert "building" in (tmp_path / image_build.LOG.name).read_text()


def test_a_build_killed_before_its_status_failed_and_a_stopped_one_ends(tmp_path):
    record = image_build.start(tmp_path, "sleep 60")
    time.sleep(0.2)
    image_build.stop(record)
    assert image_build.wait(record, 30) != 0  # killed: its shell wrote no status of its own, or a failing one
