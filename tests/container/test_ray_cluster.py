"""Two containers of the image form a Ray cluster as ``option.distributed_executor_backend=ray``
has them form one (``sagelmi ray-node``: the same ``ray start`` that ``serve`` runs beside the
engine, without a model): a plain Ray task runs on each node, a container without the secret
cannot join nor connect, and a node that is killed is seen as dead by the head.

vLLM itself cannot run on Ray in the CPU image (its CPU platform has no Ray device): ``serve`` with
the setting stops in one line (the last test here; tests/integration/test_engine_options.py shows it
stops before any download), so this proves the cluster, not the engine. The containers, their network and names are this module's own.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time

import pytest

from tests.container.conftest import PODMAN, RUN_LIMITS, logs, podman

pytestmark = [
    pytest.mark.container,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed (.ci/run installs it)"),
]

NETWORK = "sagelmi-ray-net"
HEAD, NODE, INTRUDER = "sagelmi-ray-head", "sagelmi-ray-node", "sagelmi-ray-intruder"
PORT = 6379  # option.ray_port's default
FORMED_WITHIN = 600  # two Ray nodes starting on 2 shared cores (a Ray that times out starting is started again)
DEAD_WITHIN = 120  # Ray's health checks declare a silent node dead after about 15-30 s

# Run in a container as a Ray driver: the cluster's nodes as the head sees them, and with "tasks",
# the host name a plain task pinned to each live node reports. The token comes from the secret, as
# every node derives it (container.core.ray_cluster.ray_token); without a secret, no token at all.
_DRIVER = """
import json, os, socket, sys, tempfile
secret = os.environ.pop("SAGELMI_CLUSTER_SECRET", "")
if secret:  # before Ray is imported: it reads its settings then
    from container.core.ray_cluster import auth_environment, ray_token
    path = os.path.join(tempfile.mkdtemp(), "token")
    with open(path, "w") as f:
        f.write(ray_token(secret.encode()))
    os.environ.update(auth_environment(path))
import ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
except Exception as exc:
    print("RESULT", json.dumps({"refused": f"{type(exc).__name__}: {exc}"[:400]}), flush=True)
    sys.exit(0)
nodes = [{"ip": n["NodeManagerAddress"], "alive": n["Alive"]} for n in ray.nodes()]
hosts = {}
if sys.argv[2] == "tasks":
    @ray.remote(num_cpus=0)
    def host():
        return socket.gethostname()
    live = [n["ip"] for n in nodes if n["alive"]]
    hosts = dict(zip(live, ray.get([host.options(resources={f"node:{ip}": 0.001}).remote() for ip in live],
                                   timeout=120)))
print("RESULT", json.dumps({"nodes": nodes, "hosts": hosts}), flush=True)
"""


def run_node(name: str, index: int, secret: str, image: str) -> None:
    """``sagelmi ray-node`` in a container of the cluster (node ``index``), the secret in its environment."""
    words = [*PODMAN, "run", "-d", "--name", name, "--hostname", name, "--network", NETWORK,
             "--network-alias", name, *RUN_LIMITS, "--shm-size=1g",
             "-e", "SAGELMI_CLUSTER_SIZE=2", "-e", f"SAGELMI_LEADER_ADDR={HEAD}", "-e", f"SAGELMI_NODE_INDEX={index}",
             "-e", "SAGELMI_CLUSTER_SECRET", image, "sagelmi", "ray-node"]
    result = subprocess.run(words, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "SAGELMI_CLUSTER_SECRET": secret})
    assert result.returncode == 0, result.stderr


def driver(container: str, secret: str | None, tasks: bool = False) -> dict:
    env = ["-e", f"SAGELMI_CLUSTER_SECRET={secret}"] if secret else []
    result = podman("exec", *env, container, "python", "-c", _DRIVER, f"{HEAD}:{PORT}",
                    "tasks" if tasks else "nodes", timeout=300)
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]  # Ray prints too
    return json.loads(line.removeprefix("RESULT "))


def address(name: str) -> str:
    return podman("inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", name).stdout.strip()


def remove(*names: str) -> None:
    podman("rm", "--force", "--time", "0", *names, check=False)


@pytest.fixture(scope="module")
def ray_cluster(image):
    secret = secrets.token_hex(32)
    remove(HEAD, NODE, INTRUDER)
    podman("network", "rm", "--force", NETWORK, check=False)
    podman("network", "create", NETWORK)
    started = time.monotonic()
    try:
        run_node(HEAD, 0, secret, image)
        run_node(NODE, 1, secret, image)
        addresses = {address(HEAD), address(NODE)}
        deadline = time.monotonic() + FORMED_WITHIN
        while True:
            seen = driver(HEAD, secret)
            if {n["ip"] for n in seen.get("nodes", []) if n["alive"]} == addresses:
                break
            assert time.monotonic() < deadline, f"{seen}\n{logs(HEAD)[-3000:]}\n{logs(NODE)[-3000:]}"
            time.sleep(3)
        print(f"2-node Ray cluster formed in {time.monotonic() - started:.0f} s")
        yield {"secret": secret, "head": address(HEAD), "node": address(NODE)}
    finally:
        remove(HEAD, NODE, INTRUDER)
        podman("network", "rm", "--force", NETWORK, check=False)


def test_a_plain_ray_task_runs_on_each_node(ray_cluster):
    seen = driver(HEAD, ray_cluster["secret"], tasks=True)
    assert seen["hosts"] == {ray_cluster["head"]: HEAD, ray_cluster["node"]: NODE}, seen
    assert "--head --port=6379" in logs(HEAD) and f"--address={HEAD}:{PORT}" in logs(NODE)


def test_a_container_without_the_secret_cannot_join_nor_connect(ray_cluster, image):
    run_node(INTRUDER, 1, secrets.token_hex(32), image)  # the cluster's variables, another secret
    deadline = time.monotonic() + FORMED_WITHIN
    while "Authentication token is missing or incorrect" not in logs(INTRUDER):
        assert time.monotonic() < deadline, logs(INTRUDER)[-3000:]
        time.sleep(3)
    refused = driver(INTRUDER, None)  # a driver without any token
    assert "refused" in refused, refused
    seen = driver(HEAD, ray_cluster["secret"])["nodes"]
    assert {n["ip"] for n in seen} == {ray_cluster["head"], ray_cluster["node"]}, seen
    remove(INTRUDER)


def test_a_lost_node_is_seen_as_dead_by_the_head(ray_cluster):
    podman("kill", NODE)
    killed = time.monotonic()
    while True:
        alive = {n["ip"]: n["alive"] for n in driver(HEAD, ray_cluster["secret"])["nodes"]}
        if alive.get(ray_cluster["node"]) is False:
            break
        assert time.monotonic() - killed < DEAD_WITHIN, alive
        time.sleep(3)
    assert alive[ray_cluster["head"]] is True
    print(f"the head saw the lost node dead {time.monotonic() - killed:.0f} s after it was killed")


def test_serve_refuses_the_ray_backend_on_the_cpu_image_in_one_line(image):
    """The engine on Ray cannot run here: ``serve`` with the setting stops at once, one line naming why."""
    name = "sagelmi-ray-serve"
    remove(name)
    try:
        podman("run", "-d", "--name", name, *RUN_LIMITS, "-e", "OPTION_DISTRIBUTED_EXECUTOR_BACKEND=ray",
               "-e", "HF_MODEL_ID=s3://models/llama/v1", image)
        code = podman("wait", name, timeout=120).stdout.strip()
        lines = [line for line in logs(name).splitlines() if line.strip() and "syslog" not in line]
        assert code == "2" and len(lines) == 1, (code, lines)
        assert "option.distributed_executor_backend=ray cannot work on vLLM's CPU build" in lines[0]
        assert "current platform cpu does not support ray" in lines[0]
    finally:
        remove(name)
