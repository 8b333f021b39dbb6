"""The default engine across a cluster of two nodes on this one machine, on vLLM's own
multiprocessing executor: the leader on 127.0.0.1 runs sagelmi's frontend and vLLM's node 0, the
worker node on 127.0.0.2 (a UTS namespace of its own: another hostname, so vLLM takes it for
another machine and its ranks meet over TCP, not shared memory) runs vLLM's headless node 1;
tensor parallel 2, one rank on each node, each on a core of its own. One cluster for the module
(a worker node lost whole is tests/container/test_cluster.py's: a container killed). Its answers are
compared with vLLM's offline engine in one process (tests/references.py, kept between runs): this
module runs in lane ``e2e`` (tests/lanes.py), which starts no shared server."""

import concurrent.futures
import json
import os
import random
import secrets
import shutil
import signal
import socket
import time
from pathlib import Path

import openai
import pytest
import requests

from container.core.proc import parents
from tests.e2e.conftest import EAGER, ENGINE_READY_TIMEOUT, EXACT, VLLM_CPU_ENV
from tests.references import one_process_answers
from tests.server import RawStream, Server, processes

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")]

PROMPTS = [f"Prompt number {i} about the {word}" for i, word in
           enumerate(["sea", "sky", "river", "city", "dog", "fox", "morning", "queue"])]



@pytest.fixture(scope="module")
def one_process(tiny_model):
    return one_process_answers(tiny_model, PROMPTS, 24, chats=PROMPTS[:1])


def _env(secret: str, cluster_port: int, **extra: str) -> dict[str, str]:
    # gloo's interface named: the worker node's hostname resolves nowhere
    return {"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_LEADER_ADDR": "127.0.0.1", "SAGELMI_CLUSTER_SECRET": secret,
            "SAGELMI_CLUSTER_PORT": str(cluster_port), "TENSOR_PARALLEL_DEGREE": "2", "GLOO_SOCKET_IFNAME": "lo",
            **VLLM_CPU_ENV, **EXACT, **EAGER, **extra}


def _worker(model, secret: str, cluster_port: int) -> Server:
    address = "127.0.0.2"
    wrapper = ["unshare", "--uts", "sh", "-c", 'hostname "$0"; exec "$@"', f"node-{address}"]
    env = _env(secret, cluster_port, SAGELMI_NODE_INDEX="1", SAGELMI_NODE_ADDR=address,
               VLLM_CPU_OMP_THREADS_BIND="1")
    return Server(model, env=env, wrapper=wrapper)


def _free_pair() -> int:
    """A free port whose next one is free too: the cluster port, and the engine's rendezvous, which
    vLLM binds a minute later. Below the kernel's range of ephemeral ports: there, another lane's
    outgoing connection could take it meanwhile (EADDRINUSE, seen on a loaded run)."""
    low, _ = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    rng = random.Random()
    while True:
        port = rng.randrange(max(low - 12000, 1024), low - 1)
        try:
            with socket.create_server(("0.0.0.0", port)), socket.create_server(("0.0.0.0", port + 1)):
                return port
        except OSError:
            continue


@pytest.fixture(scope="module")
def cluster(tiny_model):
    secret, cluster_port = secrets.token_hex(16), _free_pair()
    worker = _worker(tiny_model, secret, cluster_port).start(wait_ready=False)
    env = _env(secret, cluster_port, SAGELMI_NODE_ADDR="127.0.0.1", VLLM_CPU_OMP_THREADS_BIND="0")
    leader = Server(tiny_model, env=env, ready_timeout=ENGINE_READY_TIMEOUT)
    leader.worker, leader.secret, leader.cluster_port, leader.model = worker, secret, cluster_port, tiny_model
    try:
        leader.start()
        yield leader
    finally:
        leader.stop()
        leader.worker.stop()


def _answer_ids(server: Server, prompt: str) -> list[int]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 24, "ignore_eos": True, "details": True}}
    answer = server.invoke(body, timeout=120)
    assert answer.status_code == 200, answer.text
    return [t["id"] for t in answer.json()["details"]["tokens"]]


def _node_processes(server: Server) -> dict[int, str]:
    return processes(server.process.pid)


def test_eight_concurrent_lmi_requests_give_the_greedy_tokens_of_one_process(one_process, cluster):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        spread = list(pool.map(lambda p: _answer_ids(cluster, p), PROMPTS))
    assert spread == one_process["ids"]
    assert "worker node 1 registered from 127.0.0.2" in cluster.log()
    # the worker node runs vLLM's node 1, no frontend and no sagelmi worker; its /ping is never 200
    worker = _node_processes(cluster.worker).values()
    assert any("handlers.engines.vllm_node" in cmd for cmd in worker)
    assert not any("container.worker" in cmd or "frontend" in cmd for cmd in worker)
    assert "vLLM's node 1 of 2: joining the leader's engine at 127.0.0.1" in cluster.worker.log()
    ping = requests.get(cluster.worker.url("/ping"), timeout=30)
    assert ping.status_code == 503 and ping.json()["message"] == "cluster worker"


def test_an_openai_chat_stream_works(one_process, cluster):
    client = openai.OpenAI(base_url=cluster.url("/v1"), api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                           max_tokens=16, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
    assert streamed and [streamed] == one_process["chat"]


def _streams(cluster: Server) -> list[RawStream]:
    """Eight long LMI streams, each past its first token, of which some are still running."""
    body = {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}
    streams = [RawStream(cluster.port, "/invocations", body, timeout=60) for _ in range(8)]
    for stream in streams:
        assert len(stream.read_lines(1)) == 1
    in_flight = [stream for stream in streams if not stream.complete()]
    assert in_flight, "every answer had come whole before the kill"
    return in_flight


def _endings(in_flight: list[RawStream], killed: float, what: str) -> list[dict]:
    endings = [json.loads(stream.read_lines(1_000_000)[-1]) for stream in in_flight]
    seconds = time.monotonic() - killed
    print(f"{len(in_flight)} streams ended {seconds:.2f} s after {what} died")
    assert seconds < 5
    assert all(e.get("code") == 503 for e in endings), endings
    return endings


def test_a_worker_node_s_part_of_vllm_that_dies_restarts_the_engine_on_every_node(cluster):
    """vLLM's headless node on the worker node dies (the node's sagelmi stays): in-flight requests
    end, and the engine starts again on both nodes, nothing of the old start left."""
    (group,) = cluster.worker_pids()  # not a reaped-later zombie of an earlier start
    old_group = set(processes(group))
    (node,) = [pid for pid, cmd in _node_processes(cluster.worker).items() if "handlers.engines.vllm_node" in cmd]
    old_node = set(processes(node))
    in_flight = _streams(cluster)
    os.kill(node, signal.SIGKILL)
    _endings(in_flight, time.monotonic(), "the worker node's vLLM")
    assert requests.get(cluster.url("/ping"), timeout=30).status_code != 200  # (30 s: a loaded run's answer)
    cluster.wait_until(lambda r: r.status_code == 200, timeout=ENGINE_READY_TIMEOUT)
    assert len(_answer_ids(cluster, PROMPTS[0])) == 24
    assert not (old_group | old_node) & set(parents())
    assert "worker node 1's part of the engine ended: vLLM's node ended (killed by SIGKILL)" in cluster.log()
