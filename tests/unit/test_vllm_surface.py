"""vLLM's surface as sagelmi uses it (container/core/vllm_surface.py): every listed name is in the
installed vLLM, a missing one is named, and a source scan of the product packages finds no use of
vLLM the list leaves out (nor a listed use the code no longer makes).

The installed vLLM is imported once, in one subprocess for the whole module (about 13 s of CPU)."""

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

from container.core import vllm_surface
from container.core.engine_arg_list import packaged_version
from container.core.known_bad import installed_vllm
from container.core.vllm_surface import HAND, SURFACE, WRITTEN_FOR, Symbol

ROOT = Path(__file__).resolve().parents[2]
LIST = Path(vllm_surface.__file__).resolve()
PACKAGES = ("container", "handlers", "djl_python", "sagemaker_sdk")  # not tests/, not benchmarks/
MODULE_NAME = re.compile(r"^vllm(\.\w+)+$")  # a vLLM module named in a string (imported by name)
VARIABLE = re.compile(r"^VLLM_[A-Z0-9_]+$")  # one of vLLM's environment variables (vllm.envs)

# Names no vLLM has, each of another kind of row: the check must name every one
FAKES = (
    Symbol("vllm.sampling_params", "NoSuchParams", "a class"),
    Symbol("vllm.no_such_module", "", "a module"),
    Symbol("vllm.outputs", "CompletionOutput.no_such_field", "an instance field", HAND),
    Symbol("vllm.plugins", "DEFAULT_PLUGINS_GROUP", "a value", HAND, "vllm.no_such_group"),
    Symbol("vllm.envs", "VLLM_NO_SUCH_VARIABLE", "a variable"),
)

# Run in the subprocess: the listed names looked up, the fakes, which of the scan's override
# candidates vLLM has, ``sagelmi vllm-surface``, and the loader's message when a built-in engine's
# vLLM import fails (last: it removes a vLLM module).
CHECK = """
import contextlib, io, json, sys, tempfile
from pathlib import Path
from container.cli import main
from container.core import vllm_surface as s
from container.core.settings import resolve_settings
from handlers.api.loader import HandlerLoadError, load_handler
given = json.load(sys.stdin)
fakes = tuple(s.Symbol(*row) for row in given["fakes"])
out = {"missing": s.missing(), "fakes": s.missing(fakes), "described": s.describe_missing(fakes)}
out["overrides"] = [n for n in given["candidates"] if not s.missing((s.Symbol(*n.split(":"), ""),))]
with contextlib.redirect_stdout(io.StringIO()) as printed:
    out["cli"] = [main(["vllm-surface"]), printed.getvalue()]
sys.modules["vllm.v1.engine.async_llm"] = None  # as if vLLM had dropped the module
with tempfile.TemporaryDirectory() as model:
    (Path(model) / "config.json").write_text("{}")
    try:
        load_handler(resolve_settings({}, model))
    except HandlerLoadError as exc:
        out["load_error"] = str(exc)
print(json.dumps(out))
"""


def _chain(node: ast.Attribute) -> tuple[ast.expr, list[str]]:
    """The name an attribute chain starts from and its steps, up to the first dunder (what follows
    one, ``__version__.startswith``, is a plain value's)."""
    steps: list[str] = []
    while isinstance(node, ast.Attribute):
        steps.insert(0, node.attr)
        node = node.value  # type: ignore[assignment]
    for i, step in enumerate(steps):
        if step.startswith("__"):
            return node, steps[: i + 1]
    return node, steps


class Scan:
    """What the source in ``paths`` uses of vLLM: ``uses`` (a dotted path -> where), ``names`` (a
    dotted path -> ``module:attr``), and ``candidates`` (``module:Class.method`` -> where, for each
    method a subclass of a vLLM class defines: an override if vLLM has the method)."""

    def __init__(self, paths: list[Path]) -> None:
        self.uses: dict[str, list[str]] = defaultdict(list)
        self.names: dict[str, str] = {}
        self.candidates: dict[str, str] = {}
        for path in paths:
            self._file(path)

    def _use(self, module: str, attr: str, where: str) -> None:
        symbol = Symbol(module, attr, "")
        self.uses[symbol.path].append(where)
        self.names.setdefault(symbol.path, symbol.name)

    def _file(self, path: Path) -> None:
        tree = ast.parse(path.read_text(), str(path))
        where = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
        bound: dict[str, tuple[str, str]] = {}  # a name imported from vLLM -> (module, attr)
        chains: set[int] = set()  # attribute nodes inside a longer chain
        for node in ast.walk(tree):
            line = f"{where}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "vllm" or alias.name.startswith("vllm."):
                        self._use(alias.name, "", line)
                        bound[alias.asname or "vllm"] = (alias.name if alias.asname else "vllm", "")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
                for alias in node.names:
                    self._use(str(node.module), alias.name, line)
                    bound[alias.asname or alias.name] = (str(node.module), alias.name)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if MODULE_NAME.match(node.value):
                    self._use(node.value, "", line)
                elif VARIABLE.match(node.value):
                    self._use("vllm.envs", node.value, line)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                chains.add(id(node.value))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and id(node) not in chains:
                start, steps = _chain(node)
                if isinstance(start, ast.Name) and start.id in bound:
                    module, attr = bound[start.id]
                    self._use(module, ".".join(p for p in (attr, *steps) if p), f"{where}:{node.lineno}")
            elif isinstance(node, ast.ClassDef):
                self._subclass(node, bound, where)

    def _subclass(self, node: ast.ClassDef, bound: dict[str, tuple[str, str]], where: str) -> None:
        for base in node.bases:
            base = base.value if isinstance(base, ast.Subscript) else base  # MediaIO[Any]
            start, steps = _chain(base) if isinstance(base, ast.Attribute) else (base, [])
            if not (isinstance(start, ast.Name) and start.id in bound):
                continue
            module, attr = bound[start.id]
            attr = ".".join(p for p in (attr, *steps) if p)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("__"):
                    self.candidates[f"{module}:{attr}.{item.name}"] = f"{where}:{item.lineno}"


@pytest.fixture(scope="module")
def scan() -> Scan:
    """The product packages (the list itself left out: it names them all)."""
    return Scan([path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py")) if path != LIST])


@pytest.fixture(scope="module")
def installed(scan) -> dict:
    """The installed vLLM checked once, in a subprocess (vLLM's import is heavy and leaves state)."""
    given = {"fakes": [list(vars(f).values()) for f in FAKES], "candidates": sorted(scan.candidates)}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", CHECK], input=json.dumps(given), env=env, cwd=ROOT,
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _listed() -> set[str]:
    return {symbol.path for symbol in SURFACE}


def test_the_installed_vllm_has_every_listed_name(installed):
    build = " ".join(installed_vllm() or ("vLLM",))
    assert installed["missing"] == [], (
        f"the installed {build} lacks what sagelmi uses: {', '.join(installed['missing'])} "
        f"(container/core/vllm_surface.py says what sagelmi does with each)"
    )


def test_a_name_vllm_lacks_is_named(installed):
    names = [fake.name for fake in FAKES]
    assert installed["fakes"] == names
    assert all(name in installed["described"] for name in names), installed["described"]
    assert f"written for vLLM {WRITTEN_FOR}.x" in installed["described"]


def test_sagelmi_vllm_surface_checks_the_installed_vllm(installed):
    status, printed = installed["cli"]
    assert status == 0 and f"{len(SURFACE)} of the {len(SURFACE)} vLLM names sagelmi uses are in" in printed, printed


def test_a_failed_vllm_import_of_the_built_in_engine_names_what_vllm_lacks(installed):
    """The worker's start-up failure (``/ping``'s detail, the log) names the listed names vLLM lacks."""
    error = installed["load_error"]
    assert error.startswith("importing the built-in vllm handler"), error
    assert re.search(r"; the installed vllm\S* \S+ lacks \d+ of the vLLM names sagelmi uses", error), error
    assert "vllm.v1.engine.async_llm:AsyncLLM," in error, error


def test_the_scan_sees_every_kind_of_use(tmp_path):
    source = tmp_path / "uses.py"
    source.write_text(
        "import vllm.a as va\n"
        "from vllm.b import C\n"
        "from vllm import envs\n"
        "va.x.y\n"
        "C.method().z\n"
        "envs.VLLM_Q\n"
        "ENGINE, VARIABLE = 'vllm.c.d', 'VLLM_R'\n"
        "class S(C):\n"
        "    def __init__(self): ...\n"
        "    def m(self): ...\n"
        "def f():\n"
        "    import vllm\n"
        "    return vllm.__version__.startswith('0')\n"
    )
    scan = Scan([source])
    assert sorted(scan.uses) == [
        "vllm", "vllm.__version__", "vllm.a", "vllm.a.x.y", "vllm.b.C", "vllm.b.C.method", "vllm.c.d", "vllm.envs",
        "vllm.envs.VLLM_Q", "vllm.envs.VLLM_R",
    ]
    assert list(scan.candidates) == ["vllm.b:C.m"]


def test_every_use_of_vllm_in_the_product_code_is_listed(scan):
    unlisted = {path: where for path, where in scan.uses.items() if path not in _listed()}
    assert not unlisted, "list these in container/core/vllm_surface.py (module, attr, what sagelmi does): " + "; ".join(
        f"{scan.names[path]} ({', '.join(where[:3])})" for path, where in sorted(unlisted.items())
    )


def test_every_override_of_a_vllm_method_is_listed(scan, installed):
    unlisted = [name for name in installed["overrides"] if name.replace(":", ".") not in _listed()]
    assert not unlisted, "list these overrides in container/core/vllm_surface.py: " + "; ".join(
        f"{name} ({scan.candidates[name]})" for name in unlisted
    )


def test_every_row_the_scan_can_see_is_still_used(scan, installed):
    used = set(scan.uses) | {name.replace(":", ".") for name in installed["overrides"]}
    stale = [symbol.name for symbol in SURFACE if symbol.seen and symbol.path not in used]
    assert not stale, f"no longer used: remove from container/core/vllm_surface.py: {', '.join(stale)}"


def test_every_vllm_entry_point_group_sagelmi_registers_in_is_listed():
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    listed = {symbol.holds for symbol in SURFACE}
    unlisted = [group for group in groups if group.startswith("vllm.") and group not in listed]
    assert not unlisted, f"list vLLM's constant for these entry point groups: {unlisted}"


def test_the_list_is_for_the_vllm_that_is_pinned_and_installed():
    """An upgrade moves these together: the pins, the engine-args list, the rows checked."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = [pin for extra in ("cpu", "gpu") for pin in extras[extra] if pin.startswith("vllm")]
    assert pins and all(pin.split("==")[1].startswith(f"{WRITTEN_FOR}.") for pin in pins), pins
    assert packaged_version().startswith(f"{WRITTEN_FOR}."), "regenerate it: sagelmi engine-args --write"
    installed_build = installed_vllm()
    assert installed_build is None or installed_build[1].startswith(f"{WRITTEN_FOR}."), (
        f"vLLM {installed_build[1]} is installed; check the rows of container/core/vllm_surface.py against it "
        f"and set WRITTEN_FOR (docs/architecture.md, vLLM's surface)"
    )


def test_each_row_says_what_sagelmi_does_with_it_once():
    assert all(symbol.use for symbol in SURFACE)
    names = [symbol.name for symbol in SURFACE]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    assert vllm_surface.missing(()) == []
