"""The rules a tool checks: the layers (import-linter's contracts in pyproject.toml), lint and
format (ruff) and types (mypy, its [tool.mypy] files) over the product packages. Each runs as
the test command runs it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PACKAGES = ["container", "handlers", "djl_python", "sagemaker_sdk"]


def _run(tool: str, *args: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(cwd), "HOME": str(cwd)}
    return subprocess.run([str(BIN / tool), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_layers_hold():
    result = _run("lint-imports")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("handlers/api/loader.py", "import container.worker.runtime", "handlers-not-runtime"),
        ("djl_python/huggingface.py", "import container.worker.requests", "handlers-not-runtime"),
        ("container/frontend/router.py", "import handlers.engines.vllm_args", "runtime-not-engines"),
        ("sagemaker_sdk/env.py", "import handlers.api", "sdk-over-core"),
        ("container/core/settings.py", "import handlers.api", "layers"),
    ],
)
def test_a_forbidden_import_breaks_a_contract(tmp_path, module, line, contract):
    """A copy of the tree with one import that crosses a layer fails lint-imports, naming it."""
    for name in [*PACKAGES, "pyproject.toml"]:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "*.json"))
        else:
            shutil.copy(source, tmp_path / name)
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # crosses a layer\n")
    result = _run("lint-imports", "--contract", contract, cwd=tmp_path)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "BROKEN" in result.stdout and line.split()[-1] in result.stdout


def test_ruff_lint_and_format_are_clean():
    lint = _run("ruff", "check", *PACKAGES)
    assert lint.returncode == 0, lint.stdout[-4000:]
    fmt = _run("ruff", "format", "--check", *PACKAGES)
    assert fmt.returncode == 0, fmt.stdout[-4000:] + "\nrun: ruff format " + " ".join(PACKAGES)


@pytest.mark.timeout(900)
def test_mypy_is_clean():
    """The types of the product packages check (pyproject.toml's [tool.mypy]: its files, the
    third-party packages followed silently). A first run without mypy's cache takes minutes."""
    result = _run("mypy", timeout=840)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


MAX_MODULE_LINES = 500


def test_every_product_module_does_one_job_in_at_most_500_lines():
    long = {
        str(path.relative_to(ROOT)): lines
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"split these along their jobs: {long}"
