"""tests.lanes: each lane's closing block (its failures and final line, short enough for a CI page's tail),
and which lane starts the shared vllm_server."""

import ast
from pathlib import Path

from tests import lanes
from tests.lanes import _summary
from tests.server import REPO


def test_a_lane_s_summary_is_its_failures_and_its_final_line():
    lines = ["tests/a.py ....F\n", "engine servers: 2 started, 90 s until ready in all\n",
             "===== short test summary info =====\n",
             "FAILED tests/a.py::test_x - AssertionError: 1\n", "  rank 1| a server's log, printed as it stops\n",
             "ERROR tests/b.py::test_y - TimeoutError\n", "===== 1 failed, 1 error, 4 passed in 9.00s =====\n"]
    assert _summary(lines) == [lines[1], lines[3], lines[5], lines[6]]


def test_a_lane_without_a_summary_shows_its_last_line():
    assert _summary(["===== 4 passed in 9.00s =====\n"]) == ["===== 4 passed in 9.00s =====\n"]


def _asks_for(path: Path, fixture: str) -> bool:
    """Whether a function of the module at ``path`` (a test or a fixture) takes ``fixture``."""
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.FunctionDef) and fixture in [a.arg for a in node.args.args]
               for node in ast.walk(tree))


def test_only_the_engines_lane_starts_the_shared_vllm_server():
    """Each lane is a pytest process of its own: a module asking for vllm_server in another lane would start
    a second one (an engine start, about a minute of a core)."""
    for name, args in lanes.lanes([]).items():
        if name in ("engines", "rest"):
            continue
        modules = [m for a in args if not a.startswith("-") for m in ([REPO / a] if a.endswith(".py") else
                                                                       (REPO / a).rglob("test_*.py"))]
        assert modules, name
        assert [str(m) for m in modules if _asks_for(m, "vllm_server")] == [], name
    rest = [REPO / a.split("=", 1)[1] for a in lanes.lanes([])["rest"] if a.startswith("--ignore=")]
    ignored = {m for m in rest if m.suffix == ".py"}
    slow_users = [m for m in (REPO / "tests").rglob("test_*.py") if m not in ignored and _asks_for(m, "vllm_server")]
    assert slow_users == [], "modules in lane rest that ask for vllm_server"


def test_the_caches_line_counts_what_earlier_runs_left(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("SAGELMI_TEST_CACHE", raising=False)
    assert lanes.kept_caches() == ("caches kept from earlier runs: offline vLLM answers 0; tiny models 0; "
                                   "SDK environments 0; vLLM compiled models 0")
    venvs = tmp_path / ".cache" / "sagelmi" / "sdk-venvs"
    (venvs / "sagemaker3-abc").mkdir(parents=True)
    (venvs / "sagemaker3-abc.lock").touch()  # not an environment
    references = tmp_path / ".cache" / "sagelmi-tests" / "vllm-references"
    references.mkdir(parents=True)
    (references / "a.json").touch()
    (references / "b.json").touch()
    (tmp_path / ".cache" / "sagelmi-tests" / "models" / "tiny-model-abc").mkdir(parents=True)
    (tmp_path / ".cache" / "sagelmi-tests" / "models" / "tiny-model-abc.lock").touch()  # not a model
    line = lanes.kept_caches()
    assert "offline vLLM answers 2, the oldest from " in line and "SDK environments 1, the oldest from " in line
    assert "tiny models 1, the oldest from " in line
    assert line.endswith("vLLM compiled models 0")
