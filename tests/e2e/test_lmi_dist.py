"""lmi-dist: LMI's configuration for a model split over ranks (the README's try-out: tensor parallel 2 on
the CPU), served by vLLM's own executor: one worker process whose vLLM starts a worker per rank.

That lmi-dist crossed with every setting of the option matrix gives the same engine as the built-in
engine's configuration is checked where it is cheapest (tests/unit/test_lmi_dist_settings.py); the
tokens of pipeline parallel 2 are tests/e2e/test_pipeline_parallel.py's."""

import concurrent.futures
import json

import openai
import pytest
import requests

from container.core.proc import parents
from tests.e2e.conftest import ENGINE_READY_TIMEOUT
from tests.server import drop_stream_and_wait_until_idle, kill_mid_stream, metric, mpi_rank, processes

pytestmark = pytest.mark.slow

PROMPTS = [f"Prompt number {i} about the {word}" for i, word in
           enumerate(["sea", "sky", "river", "city", "dog", "fox", "morning", "queue"])]


@pytest.fixture(scope="module")
def lmi_dist(lmi_dist_server):
    """The README's lmi-dist try-out (tests/e2e/conftest.py), shared with the option matrix."""
    return lmi_dist_server


def _streamed_ids(server, prompt):
    body = {"inputs": prompt, "stream": True, "parameters": {"max_new_tokens": 24, "ignore_eos": True}}
    with server.invoke(body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        return [json.loads(line)["token"]["id"] for line in r.iter_lines() if line]


def _answer_ids(server, prompt):
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 24, "ignore_eos": True, "details": True}}
    return [t["id"] for t in server.invoke(body, timeout=120).json()["details"]["tokens"]]


def _tp_workers(group) -> dict[str, int]:
    """vLLM's tensor-parallel workers of the group: process title -> pid."""
    return {cmd: pid for pid, cmd in processes(group).items() if cmd.startswith("VLLM::Worker_TP")}


def test_is_served_by_vllms_executor_with_a_worker_per_rank_and_no_mpirun(lmi_dist):
    (group,) = lmi_dist.group_pids()
    assert sorted(_tp_workers(group)) == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    group_processes = processes(group)
    assert not [cmd for cmd in group_processes.values() if "mpirun" in cmd or "prted" in cmd]
    assert all(mpi_rank(pid) is None for pid in group_processes)
    assert "the built-in lmi-dist handler (option.rolling_batch=lmi-dist)" in lmi_dist.log()


def test_metrics_carry_the_router_gauges(lmi_dist):
    """vllm:num_requests_waiting and vllm:kv_cache_usage_perc, which SageMaker's routers and autoscalers
    read, under vLLM's names, once for the group."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(lmi_dist.url("/metrics"), timeout=60).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert families[name].type == "gauge"
        assert [(s.name, s.labels["group"], "rank" in s.labels) for s in families[name].samples] == [(name, "0", False)]


def test_streams_give_the_greedy_tokens_of_one_process(lmi_dist, vllm_server):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        sharded = list(pool.map(lambda p: _streamed_ids(lmi_dist, p), PROMPTS))
    expected = [_answer_ids(vllm_server, p) for p in PROMPTS]
    assert [len(ids) for ids in sharded] == [24] * 8
    assert sharded == expected


def test_chat_streams_give_the_greedy_answers_of_one_process(lmi_dist, vllm_server):
    def chat(server, prompt, stream):
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=16, temperature=0, stream=stream)
        if not stream:
            return reply.choices[0].message.content
        return "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        sharded = list(pool.map(lambda p: chat(lmi_dist, p, True), PROMPTS))
    assert sharded == [chat(vllm_server, p, False) for p in PROMPTS]
    assert all(sharded)


@pytest.mark.parametrize("path,body", [
    ("/invocations", {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 1000, "ignore_eos": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 1000,
                              "ignore_eos": True}),
], ids=["lmi", "chat"])
def test_a_dropped_stream_is_aborted_in_the_engine(lmi_dist, path, body):
    drop_stream_and_wait_until_idle(lmi_dist, path, body, tokens=1000)
    assert metric(lmi_dist, "sagelmi_engine_unfinished_requests") == 0
    assert len(_answer_ids(lmi_dist, PROMPTS[0])) == 24  # and the engine still answers


def test_a_killed_rank_ends_in_flight_streams_and_the_group_restarts(lmi_dist):
    """Last in this module: it restarts the group."""
    (group,) = lmi_dist.group_pids()
    old = processes(group)
    rank_1 = _tp_workers(group)["VLLM::Worker_TP1"]
    seconds, endings = kill_mid_stream(lmi_dist, rank_1, streams=12, tokens=1000)  # the README's model: 1024
    assert seconds < 5
    assert all(e.get("code") == 503 for e in endings), endings
    assert requests.get(lmi_dist.url("/ping"), timeout=2).status_code != 200
    lmi_dist.wait_until(lambda r: r.status_code == 200, timeout=ENGINE_READY_TIMEOUT)
    assert len(_answer_ids(lmi_dist, PROMPTS[0])) == 24
    assert not set(old) & set(parents())  # nothing of the old group is left: the worker, EngineCore, both ranks
    assert "died: its engine died (EngineProcessGone: vLLM's process VLLM::Worker_TP1 (pid " in lmi_dist.log()
