"""The rules a tool checks hold as the tools are configured: `make lint` (which `make test` runs
first) runs ruff, lint-imports and mypy over the product packages; here, that the layers'
contracts catch an import that crosses them, and that no product module grows past one job."""

import re
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


MAX_MODULE_LINES = 500


def test_every_product_module_does_one_job_in_at_most_500_lines():
    long = {
        str(path.relative_to(ROOT)): lines
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"split these along their jobs: {long}"


# An issue or the benchmark diary cited in a product module's comment or docstring: comments say what
# the code does and why now; history belongs in commit messages, figures in docs/benchmarks/.
HISTORY = re.compile(r"\b[Ii]ssue #?\d+|docs/benchmarks/README\.md")


def test_no_product_comment_cites_an_issue_or_the_benchmark_diary():
    cited = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for package in PACKAGES
             for path in (ROOT / package).rglob("*.py")
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if HISTORY.search(line)]
    assert cited == [], "\n".join(cited)
