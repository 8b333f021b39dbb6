"""Virtual environments with sagelmi's ``sdk`` extra on one major of the sagemaker SDK, for the
tests that need an environment other than the one they run in: test_install.py (what
``pip install '.[sdk]'`` gives: pip picks the newest major the extra allows, 3.x) and
test_other_major.py (the major this environment does not have).

Each is made once and kept under the user's cache directory (``$XDG_CACHE_HOME`` or
``~/.cache``, ``sagelmi/sdk-venvs/``), named after the major and a digest of what pyproject.toml
says the package installs, the test tools and Python's version (a change of the package's
dependencies makes a new one; one of its markers or entry points does not); pip's own
cache makes a rebuild quicker. A lock file keeps two test processes from building one at once; a
marker written last tells a finished one from an interrupted one (made again)."""

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from sagemaker_sdk import SDK_MAJOR
from tests.server import REPO, clean_env

SOURCES = ("container", "handlers", "djl_python", "sagemaker_sdk", "pyproject.toml", "README.md")
TOOLS = ("moto[s3,sagemaker]>=5", "pytest>=8", "pytest-timeout>=2.3")  # what the tests run with there
DEFAULT_MAJOR = 3  # pip's pick for sagemaker>=2,<4
OTHER_MAJOR = {2: 3, 3: 2}[SDK_MAJOR]  # the major this environment does not have
READY = "sagelmi-ready"


def copy_checkout(target: Path) -> Path:
    """The package's sources, copied to ``target`` (pip builds in the tree it is given)."""
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, target / name)
    return target


def _requirements(major: int) -> tuple[str, ...]:
    pin = () if major == DEFAULT_MAJOR else (f"sagemaker>={major},<{major + 1}",)
    return (*pin, *TOOLS)


def venvs_root() -> Path:
    """Where the environments are kept."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sagelmi" / "sdk-venvs"


def sdk_venv(major: int) -> Path:
    """A virtual environment made by ``pip install '<checkout>[sdk]'`` (with ``sagemaker`` held to
    ``major`` when it is not pip's own pick) and the test tools; its directory."""
    root = venvs_root()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / f"sagemaker{major}-{_digest(_installed_from(), major)}"
    with (root / f"{venv.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        named_by_the_whole_file = root / f"sagemaker{major}-{_digest((REPO / 'pyproject.toml').read_bytes(), major)}"
        if not (venv / READY).exists() and (named_by_the_whole_file / READY).exists():
            named_by_the_whole_file.rename(venv)  # made for these dependencies under its earlier name
        if not (venv / READY).exists():
            _make(venv, root / f"{venv.name}.source", major)
    return venv


def _installed_from() -> bytes:
    """What of pyproject.toml decides the environment's packages: the build system, Python's
    version range, the dependencies and the ``sdk`` extra (not its markers, scripts or tools' settings)."""
    toml = tomllib.loads((REPO / "pyproject.toml").read_text())
    project = toml["project"]
    decides = [toml.get("build-system"), project.get("requires-python"), project.get("dependencies"),
               project.get("optional-dependencies", {}).get("sdk")]
    return json.dumps(decides, sort_keys=True).encode()


def _digest(source: bytes, major: int) -> str:
    digest = hashlib.sha256(source)
    digest.update(" ".join(_requirements(major)).encode() + sys.version.encode())
    return digest.hexdigest()[:12]


def _make(venv: Path, source: Path, major: int) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    shutil.rmtree(source, ignore_errors=True)
    copy_checkout(source)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # --no-compile: the tests import a small part of what the SDK pulls in, which Python compiles as it
    # imports it; byte-compiling all of it at install costs CPU the run does not need
    install = subprocess.run([python(venv), "-m", "pip", "install", "--quiet", "--no-compile", f"{source}[sdk]",
                              *_requirements(major)],
                             env=clean_env(), capture_output=True, text=True, timeout=1800, cwd=source)
    assert install.returncode == 0, install.stderr[-3000:]
    shutil.rmtree(source)
    assert sagemaker_version(venv).split(".")[0] == str(major), sagemaker_version(venv)
    (venv / READY).write_text(" ".join(_requirements(major)) + "\n")


def python(venv: Path) -> str:
    return str(venv / "bin" / "python")


def sagemaker_version(venv: Path) -> str:
    return subprocess.run([python(venv), "-c", "from importlib.metadata import version; print(version('sagemaker'))"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def install_checkout(venv: Path, scratch: Path) -> None:
    """This checkout's sources installed into ``venv`` over the copy it was made with (its
    dependencies stay: they change only with pyproject.toml's dependencies, which name the venv)."""
    source = copy_checkout(scratch / "sagelmi")
    install = subprocess.run([python(venv), "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall",
                              str(source)], env=clean_env(), capture_output=True, text=True, timeout=600, cwd=scratch)
    assert install.returncode == 0, install.stderr[-3000:]
