"""Two containers of the image as a 2-node cluster on one podman network: the README's commands
("Running on several machines"), run as this machine runs containers (podman, runc, limits).

The built-in engine with tensor parallel 2 puts one rank in each container (vLLM's headless node in
the worker container); its greedy tokens must be the single-process engine's (``vllm_server``,
float32). Then the failures: a container with a wrong secret, a worker container killed under load.
Then a model.py in MPI mode across the same two containers (its second rank started through
sagelmi's launch service). LMI's lmi-dist configuration is this same engine on the same nodes,
checked by its settings (tests/unit/test_lmi_dist_settings.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ipaddress
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import openai
import pytest
import requests

from tests.container.conftest import IMAGE, PODMAN, RUN_LIMITS, logs, podman
from tests.e2e.conftest import EXACT
from tests.readme import run_shell, section, shell_commands
from tests.server import REPO, Server, free_port

pytestmark = [
    pytest.mark.container,
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed (.ci/run installs it)"),
]

COMMANDS = shell_commands(section("Running on several machines"))
NETWORK = "sagelmi-net"  # the README's
PROMPTS = [f"Prompt number {i} about the {word}" for i, word in
           enumerate(["sea", "sky", "river", "city", "dog", "fox", "morning", "queue"])]
READY = 600  # two engines compiling on 2 shared cores


def readme(start: str) -> str:
    (found,) = [c for c in COMMANDS if c.startswith(start)]
    return found


def node_command(role: str, model_dir, port: int | None, extra: dict[str, str]) -> list[str]:
    """The README's ``docker run`` of ``role`` (leader or worker) as podman runs it here, with the
    test's model directory and port, and with ``extra`` variables."""
    words = shlex.split(readme(f"docker run -d --name sagelmi-{role} "))
    words[:1] = PODMAN
    words[len(PODMAN) + 1:len(PODMAN) + 1] = RUN_LIMITS
    words = [w.replace("/tmp/tiny-model:", f"{model_dir}:") for w in words]
    if port is not None:
        words = [w.replace("127.0.0.1:8080:", f"127.0.0.1:{port}:") for w in words]
    image = words.index("sagelmi:cpu")
    words[image] = IMAGE
    for name, value in extra.items():
        words[image:image] = ["-e", f"{name}={value}"]
        image += 2
    return words


def start(words: list[str], secret: str) -> None:
    result = subprocess.run(words, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "SAGELMI_CLUSTER_SECRET": secret})
    assert result.returncode == 0, result.stderr


def remove(*names: str) -> None:
    podman("rm", "--force", "--time", "0", *names, check=False)


def wait_status(port: int, wanted, timeout: float, name: str = "sagelmi-leader") -> requests.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            response = requests.get(f"http://127.0.0.1:{port}/ping", timeout=2)
            if wanted(response):
                return response
        except requests.RequestException:
            pass
        state = podman("inspect", "--format", "{{.State.Status}}", name, check=False).stdout.strip()
        assert state == "running", f"{name} is {state}:\n{logs(name)[-6000:]}"
        time.sleep(1)
    raise AssertionError(f"/ping never matched in {timeout} s:\n{logs(name)[-6000:]}")


_PROCESSES = """
import json, os
found = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        line = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
    except OSError:
        continue
    if int(pid) != os.getpid() and any(w in line for w in ("container.worker", "prted", "prterun", "supervisor.rsh",
                                                           "vllm_node", "VLLM::")):
        found[pid] = line
print(json.dumps(found))
"""


def worker_processes(name: str) -> dict[int, str]:
    """pid -> command line of the container's model workers, mpirun, Open MPI's daemons, the rsh agents,
    vLLM's headless node and its processes."""
    result = podman("exec", name, "python", "-c", _PROCESSES)
    return {int(pid): line for pid, line in json.loads(result.stdout).items()}


@contextlib.contextmanager
def two_containers(model_dir, extra: dict[str, str], secret: str, ready: float) -> Iterator[int]:
    """The README's worker and leader containers (with ``extra`` variables) on a new network, in place of
    any left before: the leader's port, once its /ping says 200."""
    remove("sagelmi-leader", "sagelmi-worker", "sagelmi-intruder")
    podman("network", "rm", "--force", NETWORK, check=False)
    podman("network", "create", NETWORK)
    port = free_port()
    try:
        start(node_command("worker", model_dir, None, extra), secret)
        start(node_command("leader", model_dir, port, extra), secret)
        wait_status(port, lambda r: r.status_code == 200, ready)
        yield port
    finally:
        remove("sagelmi-leader", "sagelmi-worker", "sagelmi-intruder")
        podman("network", "rm", "--force", NETWORK, check=False)


@pytest.fixture(scope="module")
def cluster(image, tiny_model):
    """The README's two-node cluster (the built-in engine, tensor parallel 2), on the tiny model, in float32."""
    made = run_shell(readme("export SAGELMI_CLUSTER_SECRET=") + ' && printf %s "$SAGELMI_CLUSTER_SECRET"', 0)
    secret = made.stdout
    assert made.returncode == 0 and len(secret) == 64, made.stderr
    assert readme("docker network create") == f"docker network create {NETWORK}"
    started = time.monotonic()
    with two_containers(tiny_model, EXACT, secret, READY) as port:
        print(f"2-node cluster ready in {time.monotonic() - started:.0f} s")
        yield {"port": port, "secret": secret, "model": tiny_model, "url": f"http://127.0.0.1:{port}"}


def _streamed_ids(url: str, prompt: str, tokens: int = 24) -> list[int]:
    body = {"inputs": prompt, "stream": True, "parameters": {"max_new_tokens": tokens, "ignore_eos": True}}
    with requests.post(f"{url}/invocations", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        return [json.loads(line)["token"]["id"] for line in r.iter_lines() if line]


def _answer_ids(server: Server, prompt: str) -> list[int]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 24, "ignore_eos": True, "details": True}}
    return [t["id"] for t in server.invoke(body, timeout=120).json()["details"]["tokens"]]


def _chat(url: str, prompt: str, stream: bool) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=16, temperature=0, stream=stream)
    if not stream:
        return reply.choices[0].message.content
    return "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)


def _exact(cluster, vllm_server) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        sharded = list(pool.map(lambda p: _streamed_ids(cluster["url"], p), PROMPTS))
        chats = list(pool.map(lambda p: _chat(cluster["url"], p, True), PROMPTS))
    assert [len(ids) for ids in sharded] == [24] * 8
    assert sharded == [_answer_ids(vllm_server, p) for p in PROMPTS]
    assert chats == [_chat(vllm_server.url(""), p, False) for p in PROMPTS] and all(chats)


def test_the_readme_curl_is_answered_by_ranks_in_both_containers(cluster):
    answer = run_shell(readme("curl -s localhost:8080/invocations"), cluster["port"], timeout=300)
    assert answer.returncode == 0 and json.loads(answer.stdout)["generated_text"], answer.stdout
    leader, worker = worker_processes("sagelmi-leader"), worker_processes("sagelmi-worker")
    assert any("container.worker" in c for c in leader.values()), leader
    assert any("vllm_node" in c for c in worker.values()), worker  # vLLM's node 1 runs in the worker container
    assert any("VLLM::" in c for c in worker.values()), worker  # and its rank
    assert not any("prted" in c or "prterun" in c for c in {**leader, **worker}.values())  # no MPI
    ping = requests.get(f"http://127.0.0.1:{cluster['port']}/ping", timeout=5)
    assert ping.status_code == 200


def test_eight_streams_give_the_single_process_greedy_tokens(cluster, vllm_server):
    _exact(cluster, vllm_server)


def test_a_worker_node_answers_ping_as_a_cluster_worker_never_200(cluster):
    script = ("import urllib.request as u\ntry: u.urlopen('http://127.0.0.1:8080/ping')\n"
              "except Exception as e: print(e.code, e.read().decode())")
    result = podman("exec", "sagelmi-worker", "python", "-c", script)
    code, body = result.stdout.split(" ", 1)
    assert code == "503" and "worker of the cluster led by sagelmi-leader" in json.loads(body)["error"]


def test_a_container_with_a_wrong_secret_is_refused_and_the_cluster_keeps_serving(cluster, vllm_server):
    words = node_command("worker", cluster["model"], None, {})
    words = [w.replace("sagelmi-worker", "sagelmi-intruder") for w in words]
    # An address of its own: the container exits within a second, and an exited one has none to inspect
    subnet = podman("network", "inspect", "--format", "{{range .Subnets}}{{.Subnet}}{{end}}", NETWORK).stdout
    address = str(ipaddress.ip_network(subnet.strip())[200])
    words[words.index(IMAGE):words.index(IMAGE)] = ["--ip", address]
    start(words, secrets.token_hex(16))
    deadline = time.monotonic() + 120
    while podman("inspect", "--format", "{{.State.Status}}", "sagelmi-intruder").stdout.strip() == "running":
        assert time.monotonic() < deadline, logs("sagelmi-intruder")
        time.sleep(1)
    assert "the cluster secrets differ" in logs("sagelmi-intruder")
    assert int(podman("inspect", "--format", "{{.State.ExitCode}}", "sagelmi-intruder").stdout) == 1
    refused = [line for line in logs("sagelmi-leader").splitlines() if "refused a node" in line]
    assert refused and all("does not know the cluster's secret" in line for line in refused)
    assert address and address in refused[-1]  # logged with its address
    remove("sagelmi-intruder")
    assert requests.get(f"{cluster['url']}/ping", timeout=5).status_code == 200
    assert _streamed_ids(cluster["url"], PROMPTS[0]) == _answer_ids(vllm_server, PROMPTS[0])


def _stream_until_cut(url: str, tokens: int) -> tuple[float, dict | None]:
    """(when the stream ended, its last line if that is an error: None for a whole answer)."""
    body = {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": tokens, "ignore_eos": True}}
    last = {}
    try:
        with requests.post(f"{url}/invocations", json=body, stream=True, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    last = json.loads(line)
    except requests.RequestException as exc:
        return time.monotonic(), {"exception": str(exc)}
    return time.monotonic(), last if "error" in last or "code" in last else None


def test_killing_the_worker_container_ends_in_flight_requests_and_a_new_one_restores_the_cluster(
        cluster, vllm_server):
    """Last of the built-in engine's cluster: it replaces the worker container."""
    old = set(worker_processes("sagelmi-leader"))
    assert old
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(_stream_until_cut, cluster["url"], 4000) for _ in range(8)]
        time.sleep(3)  # all streaming
        assert not any(s.done() for s in streams)
        killed = time.monotonic()
        podman("kill", "--signal", "KILL", "sagelmi-worker")
        endings = [s.result(timeout=60) for s in streams]
    seconds = max(ended for ended, _ in endings) - killed
    print(f"in-flight streams ended {seconds:.2f} s after the kill")
    assert seconds < 5
    assert all(error is not None for _, error in endings), endings  # cut with an error, not completed
    assert requests.get(f"{cluster['url']}/ping", timeout=5).status_code != 200
    ping = wait_status(cluster["port"], lambda r: "waiting for worker node 1" in r.text, 10)
    assert ping.status_code == 503 and "went away" in ping.text, ping.text
    time.sleep(2)
    assert not old & set(worker_processes("sagelmi-leader"))  # nothing of the old group is left
    assert requests.get(f"{cluster['url']}/ping", timeout=5).status_code != 200  # still waiting

    remove("sagelmi-worker")
    start(node_command("worker", cluster["model"], None, EXACT), cluster["secret"])
    wait_status(cluster["port"], lambda r: r.status_code == 200, READY)
    _exact(cluster, vllm_server)


@pytest.fixture
def mpi_cluster(image):
    """The tensor-parallel example (a model.py in MPI mode) across two containers."""
    example = REPO / "examples" / "tensor_parallel"
    with two_containers(example, {"OPTION_MPI_MODE": "true"}, secrets.token_hex(16), 300) as port:
        yield f"http://127.0.0.1:{port}"


def test_a_model_py_in_mpi_mode_across_two_containers_gives_its_single_process_answer(mpi_cluster):
    rows = [[[i, -i, 2 * i, 1, 0, 3, -2, i % 3]] for i in range(8)]
    with Server(REPO / "examples" / "tensor_parallel") as single:
        expected = [single.invoke({"inputs": r}).json() for r in rows]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda r: requests.post(f"{mpi_cluster}/invocations", json={"inputs": r},
                                                     timeout=60).json(), rows))
    assert {g["world_size"] for g in got} == {2} and {e["world_size"] for e in expected} == {1}
    assert [g["outputs"] for g in got] == [e["outputs"] for e in expected]
    assert len({json.dumps(e["outputs"]) for e in expected}) == 8


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-x", "-q"]))
