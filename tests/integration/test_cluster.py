"""A cluster of two nodes on this one machine: the leader on 127.0.0.1, a worker node on 127.0.0.2
in a UTS namespace of its own (another hostname, so that Open MPI takes it for another machine).
The same as tests/container/test_cluster.py with two containers, in seconds instead of minutes,
with the tensor-parallel example (a model.py in MPI mode); plus what needs no worker at all."""

import concurrent.futures
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

from container.core.cluster import Channel, ClusterError
from container.core.proc import parents
from container.supervisor.cluster import LAUNCH_INDEX, LAUNCH_NUMBER
from tests.server import REPO, Server, free_port, mpi_rank, processes

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")]

EXAMPLE = REPO / "examples" / "tensor_parallel"
ROWS = [[[i, -i, 2 * i, 1, 0, 3, -2, i % 3]] for i in range(8)]


def _env(secret: str, cluster_port: int, **extra: str) -> dict[str, str]:
    return {"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_LEADER_ADDR": "127.0.0.1", "SAGELMI_CLUSTER_SECRET": secret,
            "SAGELMI_CLUSTER_PORT": str(cluster_port), "OPTION_MPI_MODE": "true", "TENSOR_PARALLEL_DEGREE": "2",
            "OPTION_MPI_EXTRA_ARGS": "--mca btl self,tcp --mca btl_tcp_if_include lo", **extra}


# Each node's own credentials, which its ranks must see rather than the leader's.
LEADER_OWN = {"AWS_ACCESS_KEY_ID": "AKIALEADEROWN", "HF_TOKEN": "hf_leader_own"}
WORKER_OWN = {"AWS_ACCESS_KEY_ID": "AKIAWORKEROWN", "HF_TOKEN": "hf_worker_own"}


def _worker(secret: str, cluster_port: int, address: str = "127.0.0.2", **extra: str) -> Server:
    wrapper = ["unshare", "--uts", "sh", "-c", 'hostname "$0"; exec "$@"', f"node-{address}"]
    env = _env(secret, cluster_port, SAGELMI_NODE_INDEX="1", SAGELMI_NODE_ADDR=address, **extra)
    return Server(EXAMPLE, env=env, wrapper=wrapper)


@pytest.fixture(scope="module")
def single():
    with Server(EXAMPLE) as server:
        yield [server.invoke({"inputs": row}).json()["outputs"] for row in ROWS]


def _start_pair(secret: str, cluster_port: int) -> Server:
    worker = _worker(secret, cluster_port, **WORKER_OWN).start(wait_ready=False)
    env = _env(secret, cluster_port, SAGELMI_NODE_ADDR="127.0.0.1", **LEADER_OWN)
    leader = Server(EXAMPLE, env=env)
    leader.worker = worker
    try:
        return leader.start()
    except AssertionError:
        worker.stop()
        raise


@pytest.fixture(scope="module")
def cluster():
    """One cluster for the module (the lost-node test, last, replaces its worker node). Two Open MPI
    "nodes" on one host once pinned both ranks to core 0 (mpirun's default binding, now --bind-to
    none), where rank 0's polling starved rank 1 for over a minute. One more try, in case."""
    secret, cluster_port = secrets.token_hex(16), free_port()
    try:
        leader = _start_pair(secret, cluster_port)
    except AssertionError as first:
        print(f"the first start of the emulated cluster failed, trying once more: {str(first)[-300:]}")
        leader = _start_pair(secret, cluster_port)
    leader.secret, leader.cluster_port = secret, cluster_port
    try:
        yield leader
    finally:
        leader.stop()
        leader.worker.stop()


def _answers(server: Server) -> list:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda row: server.invoke({"inputs": row}, timeout=60), ROWS))
    # Each an answer; else what the cluster said, with both nodes' logs, which tell why
    failed = [(r.status_code, r.text[:300]) for r in responses if r.status_code != 200]
    assert not failed, f"{failed}\nleader:\n{server.log()[-4000:]}\nworker node:\n{server.worker.log()[-4000:]}"
    return [r.json() for r in responses]


def test_the_example_across_two_nodes_answers_as_one_process(cluster, single):
    got = _answers(cluster)
    assert {g["world_size"] for g in got} == {2}
    assert [g["outputs"] for g in got] == single
    assert "worker node 1 registered from 127.0.0.2" in cluster.log()
    ranks = _ranks(cluster)
    assert sorted(ranks) == [0, 1]
    for pid in ranks.values():  # not Open MPI's default, each node's first core (both ranks on core 0 here)
        assert os.sched_getaffinity(pid) == os.sched_getaffinity(0)
    ping = requests.get(cluster.worker.url("/ping"), timeout=5)
    assert ping.status_code == 503 and "worker of the cluster led by 127.0.0.1" in ping.json()["error"]


def _ranks(cluster: Server) -> dict[int, int]:
    """rank -> pid of the group's model workers, on both nodes."""
    return {rank: pid for family in (cluster.group_pids()[0], cluster.worker.process.pid)
            for pid, cmd in processes(family).items()
            if "container.worker" in cmd and (rank := mpi_rank(pid)) is not None}


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def test_no_process_of_either_node_but_its_supervisor_holds_the_cluster_secret(cluster):
    """Ranks run the model's code (a model.py, trust_remote_code): neither they nor anything else
    the nodes start (the frontend, mpirun, the rsh agent, prted) inherits the secret; the
    supervisors' own environment is closed to processes without CAP_SYS_PTRACE (a container's)."""
    secret = cluster.secret.encode()
    supervisors = (cluster.process.pid, cluster.worker.process.pid)
    checked = {}
    for supervisor in supervisors:
        for pid, cmd in processes(supervisor).items():
            if pid != supervisor:
                assert secret not in Path(f"/proc/{pid}/environ").read_bytes(), cmd
                checked[pid] = cmd
    assert sorted(_ranks(cluster)) == [0, 1] and set(_ranks(cluster).values()) <= set(checked)
    assert any("prted" in cmd for cmd in checked.values()) and any("gunicorn" in cmd or "frontend" in cmd
                                                                   for cmd in checked.values())
    for supervisor in supervisors:
        look = subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-all", "cat", f"/proc/{supervisor}/environ"],
                              capture_output=True)
        assert look.returncode != 0 and secret not in look.stdout, look.stderr


def test_each_node_s_ranks_keep_that_node_s_own_credentials(cluster):
    """mpirun -x passes no credentials over Open MPI's plain channel: the worker node's rank reads
    the worker node's own, the leader's stay on the leader."""
    ranks = _ranks(cluster)
    leader_rank, worker_rank = _environ(ranks[0]), _environ(ranks[1])
    assert {name: leader_rank.get(name) for name in LEADER_OWN} == LEADER_OWN
    assert {name: worker_rank.get(name) for name in WORKER_OWN} == WORKER_OWN
    mpirun = Path(f"/proc/{cluster.group_pids()[0]}/cmdline").read_bytes().decode()
    assert "AWS_" not in mpirun and "HF_TOKEN" not in mpirun


def test_a_node_that_is_not_the_leader_cannot_launch_on_a_worker_node(cluster, single):
    """A peer holding the cluster's secret (another node) is not the leader: the worker node's
    launch service refuses it, and the cluster goes on serving."""
    with socket.create_connection(("127.0.0.2", cluster.cluster_port), timeout=5) as sock:
        assert LAUNCH_INDEX.unpack(sock.recv(LAUNCH_INDEX.size)) == (1,)
        sock.sendall(LAUNCH_NUMBER.pack(1_000_000))
        with pytest.raises(ClusterError, match="the cluster secrets differ"):
            Channel.connect(sock, cluster.secret.encode())
    refused = "refused a launch from 127.0.0.1: it is not the leader this node registered with"
    deadline = time.monotonic() + 10
    while refused not in cluster.worker.log():
        assert time.monotonic() < deadline, cluster.worker.log()[-3000:]
        time.sleep(0.1)
    assert [g["outputs"] for g in _answers(cluster)] == single


def test_a_node_with_another_secret_is_refused_and_the_cluster_keeps_serving(cluster, single):
    intruder = _worker(secrets.token_hex(16), cluster.cluster_port, address="127.0.0.3").start(wait_ready=False)
    assert intruder.process.wait(60) == 1
    assert "start-up failed: cluster: the leader at 127.0.0.1" in intruder.log()
    assert "the cluster secrets differ" in intruder.log()
    assert "refused a node at 127.0.0.3: it does not know the cluster's secret" in cluster.log()
    assert [g["outputs"] for g in _answers(cluster)] == single


def test_a_lost_worker_node_is_waited_for_and_a_new_one_restores_the_group(cluster, single):
    (group,) = cluster.group_pids()
    old = set(processes(group)) | {group}
    worker_family = set(processes(cluster.worker.process.pid))
    for pid in worker_family:  # the node dies whole, as a machine or a container does
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    killed = time.monotonic()
    ping = cluster.wait_until(lambda r: r.status_code != 200, timeout=10)
    print(f"/ping {ping.status_code} {time.monotonic() - killed:.2f} s after the worker node died")
    assert time.monotonic() - killed < 5
    cluster.wait_until(lambda r: "waiting for worker node 1" in r.text, timeout=10)
    time.sleep(1)
    assert not old & set(parents())  # the group's processes on the leader are gone
    assert not worker_family & set(parents())
    assert requests.get(cluster.url("/ping"), timeout=5).status_code == 503

    cluster.worker = _worker(cluster.secret, cluster.cluster_port).start(wait_ready=False)
    cluster.wait_until(lambda r: r.status_code == 200, timeout=120)
    assert [g["outputs"] for g in _answers(cluster)] == single


def test_a_restarted_leader_finds_its_worker_node_again(cluster, single):
    """Last of the module's cluster: the leader stops (its group with it, on both nodes) and a new
    one starts on the same address; the worker node, still running, registers with it."""
    group = cluster.one_group()
    old = set(processes(group)) | {group}
    assert cluster.stop() == 0
    time.sleep(1)
    assert not old & set(parents())  # the group's ranks are gone on both nodes, prted included
    assert cluster.worker.process.poll() is None  # the worker node stays up, waiting
    env = _env(cluster.secret, cluster.cluster_port, SAGELMI_NODE_ADDR="127.0.0.1")
    with Server(EXAMPLE, env=env) as leader:
        assert [g["outputs"] for g in _answers(leader)] == single
        assert "worker node 1 registered from 127.0.0.2" in leader.log()
    assert "registering again" in cluster.worker.log()


def test_a_leader_whose_worker_never_comes_stops_after_the_timeout_naming_it():
    env = _env(secrets.token_hex(16), free_port(), SAGELMI_CLUSTER_JOIN_TIMEOUT="3")
    server = Server(EXAMPLE, env=env).start(wait_ready=False)
    assert server.process.wait(60) == 1
    failures = [line for line in server.log().splitlines() if "start-up failed" in line]
    assert len(failures) == 1
    assert "cluster: worker node 1 did not register with this leader within 3s" in failures[0]


@pytest.mark.parametrize("env,message", [
    ({"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_LEADER_ADDR": "127.0.0.1"}, "needs a shared secret on every node"),
    ({"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_LEADER_ADDR": "127.0.0.1", "SAGELMI_CLUSTER_SECRET": "x" * 31},
     "SAGELMI_CLUSTER_SECRET is too short (31 characters): use at least 32 random characters"),
    ({"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_LEADER_ADDR": "127.0.0.1", "SAGELMI_CLUSTER_SECRET": "x" * 32,
      "OPTION_MPI_MODE": "false"}, "or each worker group as one mpirun across them: serve without a model.py's handle"),
])
def test_a_cluster_setting_that_cannot_work_stops_start_up_in_one_line(env, message):
    server = Server(EXAMPLE, env={"TENSOR_PARALLEL_DEGREE": "2", **env}).start(wait_ready=False)
    assert server.process.wait(60) == 1
    failures = [line for line in server.log().splitlines() if "start-up failed" in line]
    assert len(failures) == 1 and message in failures[0]
