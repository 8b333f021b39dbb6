"""lmi-dist: the tiny model split over two MPI ranks (tensor parallel 2) on the CPU."""

import concurrent.futures
import json

import openai
import pytest
import requests

from container.core.proc import parents
from tests.e2e.conftest import ENGINE_READY_TIMEOUT, EXACT, VLLM_CPU_ENV
from tests.server import Server, drop_stream_and_wait_until_idle, kill_mid_stream, metric, mpi_rank, processes

pytestmark = [pytest.mark.slow, pytest.mark.mpi]

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


def _ranks(group) -> dict[int, int]:
    """rank -> pid of the group's model workers."""
    return {mpi_rank(pid): pid for pid, cmd in processes(group).items()
            if "container.worker" in cmd and pid != group}  # mpirun (the group's first process) names it too


def test_is_served_by_two_ranks(lmi_dist):
    (group,) = lmi_dist.group_pids()
    assert sorted(_ranks(group)) == [0, 1]


def test_metrics_carry_the_router_gauges_from_rank_0(lmi_dist):
    """vllm:num_requests_waiting and vllm:kv_cache_usage_perc, which SageMaker's routers and autoscalers
    read, under vLLM's names: rank 0 runs vLLM's front, the other rank only its engine core."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(lmi_dist.url("/metrics"), timeout=60).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert families[name].type == "gauge"
        assert [(s.name, s.labels["group"], s.labels["rank"]) for s in families[name].samples] == [(name, "0", "0")]


def test_streams_give_the_greedy_tokens_of_python_mode(lmi_dist, vllm_server):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        sharded = list(pool.map(lambda p: _streamed_ids(lmi_dist, p), PROMPTS))
    expected = [_answer_ids(vllm_server, p) for p in PROMPTS]
    assert [len(ids) for ids in sharded] == [24] * 8
    assert sharded == expected


def test_chat_streams_give_the_greedy_answers_of_python_mode(lmi_dist, vllm_server):
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


def _unfinished(server) -> dict[str, float]:
    return {rank: metric(server, "sagelmi_engine_unfinished_requests", rank=rank) for rank in ("0", "1")}


@pytest.mark.parametrize("path,body", [
    ("/invocations", {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 1000, "ignore_eos": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 1000,
                              "ignore_eos": True}),
], ids=["lmi", "chat"])
def test_a_dropped_stream_is_aborted_on_both_ranks(lmi_dist, path, body):
    drop_stream_and_wait_until_idle(lmi_dist, path, body, tokens=1000)  # idle: every rank's count at 0
    assert _unfinished(lmi_dist) == {"0": 0, "1": 0}
    assert len(_answer_ids(lmi_dist, PROMPTS[0])) == 24  # and the ranks are still in step


def test_a_killed_rank_ends_in_flight_streams_and_the_group_restarts(lmi_dist):
    """Last in this module: it restarts the group."""
    (group,) = lmi_dist.group_pids()
    old = processes(group)
    seconds, endings = kill_mid_stream(lmi_dist, _ranks(group)[1], streams=12, tokens=1000)  # the README's model: 1024
    assert seconds < 5
    assert all(e.get("code") == 503 and "stopped while handling the request" in e["error"] for e in endings)
    assert requests.get(lmi_dist.url("/ping"), timeout=2).status_code != 200
    lmi_dist.wait_until(lambda r: r.status_code == 200, timeout=ENGINE_READY_TIMEOUT)
    assert len(_answer_ids(lmi_dist, PROMPTS[0])) == 24
    assert not set(old) & set(parents())  # nothing of the old group is left
    assert "rank 1 of the group went away" in lmi_dist.log()


def test_pipeline_parallel_lmi_dist_gives_the_greedy_tokens_of_python_mode(tiny_model, vllm_server):
    env = {**VLLM_CPU_ENV, **EXACT, "OPTION_ROLLING_BATCH": "lmi-dist", "PIPELINE_PARALLEL_DEGREE": "2"}
    with Server(tiny_model, env=env, ready_timeout=ENGINE_READY_TIMEOUT) as pipeline:
        (group,) = pipeline.group_pids()
        assert sorted(_ranks(group)) == [0, 1]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            staged = list(pool.map(lambda p: _streamed_ids(pipeline, p), PROMPTS))
    assert staged == [_answer_ids(vllm_server, p) for p in PROMPTS]
