"""`make bench` runs end to end (one short level) and writes its table and plot."""

import json
import subprocess

import pytest

from tests.server import REPO, clean_env, installed_venv

pytestmark = pytest.mark.slow


def test_make_bench_compares_both_servers(tmp_path):
    venv = installed_venv()
    stamp = venv / ".sagelmi-installed"
    result = subprocess.run(["make", "-o", str(stamp), "bench", f"VENV={venv}",
                             f"BENCH_ARGS=--levels 2 --out {tmp_path}"], cwd=REPO, env=clean_env(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {(r["server"], r["route"]) for r in rows} == {
        ("sagelmi", "/v1/completions"), ("sagelmi", "/invocations (LMI)"), ("vLLM", "/v1/completions")}
    assert all(r["errors"] == 0 and r["output_tokens_per_s"] > 0 for r in rows)
    assert "| sagelmi | `/v1/completions` | 2 |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "results.png").stat().st_size > 10_000
