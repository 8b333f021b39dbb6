"""Pipeline parallel 2 in Python mode (vLLM's own processes), and a killed EngineCore.

The greedy tokens are compared with vLLM's offline engine in one process (tests/references.py, kept
between runs), not with the session's ``vllm_server``: this module runs in lane ``rest``
(tests/lanes.py), which starts no shared server."""

import re
import time

import pytest
import requests

from container.core.proc import parents
from tests.e2e.conftest import ENGINE_READY_TIMEOUT, EXACT, VLLM_CPU_ENV
from tests.references import one_process_answers
from tests.server import Server, kill_mid_stream, processes

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox", "Hello world", "One two three four"]
TOKENS = 24



@pytest.fixture(scope="module")
def pipeline(tiny_model):
    with Server(tiny_model, env={**VLLM_CPU_ENV, **EXACT, "PIPELINE_PARALLEL_DEGREE": "2"},
                ready_timeout=ENGINE_READY_TIMEOUT) as server:
        yield server


@pytest.fixture(scope="module")
def one_process(tiny_model):
    return one_process_answers(tiny_model, PROMPTS, TOKENS)["ids"]


def _ids(server, prompt):
    body = {"inputs": prompt, "parameters": {"max_new_tokens": TOKENS, "ignore_eos": True, "details": True}}
    return [t["id"] for t in server.invoke(body, timeout=120).json()["details"]["tokens"]]


def test_pipeline_parallel_2_gives_the_greedy_tokens_of_1(pipeline, one_process):
    (group,) = pipeline.group_pids()
    stages = [cmd for cmd in processes(group).values() if cmd.startswith("VLLM::Worker_PP")]
    assert sorted(stages) == ["VLLM::Worker_PP0", "VLLM::Worker_PP1"]
    assert "VLLM_CPU_OMP_THREADS_BIND=" in pipeline.log()  # each stage got its own cores
    assert [_ids(pipeline, p) for p in PROMPTS] == one_process


def test_a_killed_engine_core_ends_in_flight_requests_and_the_group_starts_again(pipeline):
    """Last in this module: the module's server stops while the new group starts (the restarted group
    serving again is tests/e2e/test_lmi_dist.py's killed-rank test)."""
    (group,) = pipeline.group_pids()
    old = processes(group)
    engine_core = next(pid for pid, cmd in old.items() if cmd.startswith("VLLM::EngineCore"))
    seconds, endings = kill_mid_stream(pipeline, engine_core, streams=8, tokens=8000)
    assert seconds < 5
    assert all(e.get("code") == 503 for e in endings), endings
    assert requests.get(pipeline.url("/ping"), timeout=2).status_code != 200
    deadline = time.monotonic() + 120
    died = re.compile(rf"worker group 0 \(pid {group}\) died: (.*)")
    while (said := died.search(pipeline.log())) is None:
        assert time.monotonic() < deadline, "the supervisor never said the group died"
        time.sleep(0.2)
    # the worker's own reason: vLLM's, or the worker's own check of vLLM's processes (the EngineCore's, or
    # one of its stages', which end with it), whichever saw it first
    assert re.match(r"its engine died \((EngineDeadError|EngineProcessGone: vLLM's process VLLM::)", said[1]), said[0]
    while (pids := pipeline.group_pids()) in ([], [group]) or set(old) & set(parents()):
        assert time.monotonic() < deadline, f"no new group, or the old one's processes left: {pids}"
        time.sleep(0.2)
