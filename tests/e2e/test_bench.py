"""`make bench` runs end to end (short levels, two trials) and writes its tables and plots: the
serving benchmark against vLLM's own server, the same with vLLM on both sides (the A/A control),
then the relay benchmark with no engine, loading from S3, and one stream round by round.

The engine benchmarks measure two servers already running (``--attach``): the session's sagelmi
server on the tiny model and one vLLM server on the same model, which is also both sides of the A/A
control. Starting them is what ``make bench`` does by itself (eight cold engine starts, minutes on
two cores); what this test checks is the benchmarks' machinery and what they write."""

import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import ENGINE_READY_TIMEOUT, VLLM_CPU_ENV
from tests.server import REPO, clean_env, free_port, installed_venv, wait_healthy

pytestmark = pytest.mark.slow

ROUTES = {"/v1/completions", "/v1/chat/completions", "/invocations (LMI)"}


@pytest.fixture(scope="module")
def vllm_api_server(tiny_model, tmp_path_factory):
    """vLLM's own OpenAI server on the tiny model (float32 and eager, as the session's sagelmi server): port and pid."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-api") / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
             "--served-model-name", "bench", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "64",
             "--gpu-memory-utilization", "0.5", "--disable-uvicorn-access-log"],
            env=clean_env(VLLM_CPU_ENV), stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        wait_healthy(port, ENGINE_READY_TIMEOUT)
        yield f"{port}:{process.pid}"
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.timeout(900)
def test_make_bench_compares_both_servers(tmp_path, tiny_model, vllm_server, vllm_api_server):
    venv = installed_venv()
    stamp = venv / ".sagelmi-installed"
    sagelmi = f"{vllm_server.port}:{vllm_server.process.pid}"
    pair = f"{sagelmi},{vllm_api_server}"
    result = subprocess.run(["make", "-o", str(stamp), "bench", f"VENV={venv}",
                             f"BENCH_ARGS=--levels 2 --trials 2 --requests 8 --attach {pair} --out {tmp_path}",
                             f"CONTROL_ARGS=--attach {vllm_api_server},{vllm_api_server}",
                             f"RELAY_ARGS=--levels 1,8 --trials 2 --tokens 64 --out {tmp_path}",
                             f"S3_ARGS=--shards 8 --shard-mib 2 --mib-per-s 8 --trials 1 --out {tmp_path}",
                             f"ROUNDS_ARGS=--rounds 2 --requests 3 --attach {pair} --out {tmp_path}"],
                            cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["startup_s"] == {"sagelmi": None, "vLLM": None}  # attached: not started by the run
    assert data["meta"]["priming_s"] is None
    assert data["meta"]["requests_per_trial"] == 8
    assert {(r["route"], r["concurrency"]) for r in data["results"]} == {(route, 2) for route in ROUTES}
    for level in data["results"]:
        assert [t["server"] for t in level["trials"]] == ["sagelmi", "vLLM", "vLLM", "sagelmi"]
        for server in level["servers"].values():
            assert server["errors"] == 0 and server["tokens_per_s"] > 0 and server["cpu_s_per_1k_tokens"] > 0
            assert server["requests"] == 2 * 8  # two trials of --requests
        ratio, low, high = level["ratios"]["tokens_per_s"]
        assert low <= ratio <= high
        # the CPU split names each server's parts, and adds up to the total
        sagelmi, vllm = (level["servers"][name]["cpu_s_per_1k_tokens_by_role"] for name in ("sagelmi", "vLLM"))
        assert {"frontend", "model worker", "engine core"} <= set(sagelmi) and "API server" in vllm
        for trial in level["trials"]:
            assert abs(sum(trial["cpu_s_by_role"].values()) - trial["cpu_s"]) < 0.01
            # each engine step runs at least one token, and at 2 streams decodes at most 2 (prompts aside)
            assert trial["engine_tokens_per_step"] >= 1, trial
    assert "## Where the CPU goes" in (tmp_path / "results.md").read_text()
    assert "each 8 requests streaming" in (tmp_path / "results.md").read_text()
    assert "### `/v1/chat/completions`" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "results.png").stat().st_size > 10_000

    # the A/A run: vLLM against vLLM on /v1/completions, by the same method
    control = json.loads((tmp_path / "control.json").read_text())
    assert control["meta"]["servers"] == ["vLLM A", "vLLM B"]
    assert [(r["route"], r["concurrency"]) for r in control["results"]] == [("/v1/completions", 2)]
    level = control["results"][0]
    assert [t["server"] for t in level["trials"]] == ["vLLM A", "vLLM B", "vLLM B", "vLLM A"]
    assert all(server["errors"] == 0 and server["tokens_per_s"] > 0 for server in level["servers"].values())
    ratio, low, high = level["ratios"]["tokens_per_s"]
    assert low <= ratio <= high
    control_md = (tmp_path / "control.md").read_text()
    assert "## Resolution" in control_md and "- Throughput ratio: medians" in control_md
    assert (tmp_path / "control.png").stat().st_size > 10_000

    relay = json.loads((tmp_path / "relay.json").read_text())
    assert [level["streams"] for level in relay["results"]] == [1, 8]
    # make bench's default baseline: sagelmi of the commit before the layers restructuring, from a worktree
    assert relay["meta"]["servers"] == ["sagelmi", "gunicorn+Flask", "asyncio", "sagelmi@4f464b1"]
    for level in relay["results"]:
        assert len(level["trials"]) == 8  # two rounds of the four servers
        for name, server in level["servers"].items():
            assert server["errors"] == 0 and server["items_per_s"] > 0, name
        assert all(t["items"] == t["requests"] * 64 for t in level["trials"])
        for other in ("gunicorn+Flask", "sagelmi@4f464b1"):
            ratio, low, high = level["ratios"][f"items_per_s vs {other}"]
            assert low <= ratio <= high
    assert "| 8 |" in (tmp_path / "relay.md").read_text()
    s3 = json.loads((tmp_path / "s3_load.json").read_text())
    by = {r["strategy"]: r for r in s3["results"]}
    assert all(r["same_bytes_on_disk"] for r in by.values())  # every file compared with what was uploaded
    assert by["one after another"]["most_connections_sending"] == 1
    assert by["sagelmi"]["most_connections_sending"] >= 4  # the shards came at once
    assert (tmp_path / "s3_load.png").stat().st_size > 0
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    assert "sagelmi-relay-" not in worktrees  # the baseline's checkout is removed
    assert (tmp_path / "relay.png").stat().st_size > 10_000

    # one stream round by round: both routes, both servers, every request answered and timed
    rounds = json.loads((tmp_path / "rounds.json").read_text())
    assert rounds["meta"]["servers"] == ["sagelmi", "vLLM"]
    assert [r["route"] for r in rounds["results"]] == ["completions", "lmi"]
    for result in rounds["results"]:
        for name, server in result["servers"].items():
            assert server["requests"] == 2 * 3, name
            assert 0 < server["ttft_p50_ms"] < server["end_p50_ms"], name
            assert server["cpu_ms_per_request"] > 0 and "engine core" in server["cpu_ms_per_request_by_role"]
            # vLLM's own count of the same requests' first tokens: inside the client's
            assert 0 < server["engine_ttft_mean_ms"] < server["ttft_mean_ms"], name
        assert len(result["ttft_ratio_per_round"]["sagelmi"]) == 2
        assert result["ttft_ratio"]["sagelmi"]["rounds"] == 2
    assert "| sagelmi |" in (tmp_path / "rounds.md").read_text()
    assert (tmp_path / "rounds.png").stat().st_size > 10_000
