"""`make bench` runs end to end (one short level, two trials) and writes its tables and plot."""

import json
import subprocess

import pytest

from tests.server import REPO, clean_env, installed_venv

pytestmark = pytest.mark.slow

ROUTES = {"/v1/completions", "/v1/chat/completions", "/invocations (LMI)"}


def test_make_bench_compares_both_servers(tmp_path):
    venv = installed_venv()
    stamp = venv / ".sagelmi-installed"
    result = subprocess.run(["make", "-o", str(stamp), "bench", f"VENV={venv}",
                             f"BENCH_ARGS=--levels 2 --trials 2 --out {tmp_path}"], cwd=REPO, env=clean_env(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert all(data["startup_s"][name] > 0 for name in ("sagelmi", "vLLM"))
    assert {(r["route"], r["concurrency"]) for r in data["results"]} == {(route, 2) for route in ROUTES}
    for level in data["results"]:
        assert [t["server"] for t in level["trials"]] == ["sagelmi", "vLLM", "vLLM", "sagelmi"]
        for server in level["servers"].values():
            assert server["errors"] == 0 and server["tokens_per_s"] > 0 and server["cpu_s_per_1k_tokens"] > 0
        ratio, low, high = level["ratios"]["tokens_per_s"]
        assert low <= ratio <= high
    assert "### `/v1/chat/completions`" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "results.png").stat().st_size > 10_000
