"""A cluster's settings, its authenticated channel and the mpirun line across its nodes
(the cluster itself runs in tests/integration/test_cluster.py and tests/container/test_cluster.py)."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from container import supervisor
from container.core.cluster import Channel, ClusterConfig, ClusterError
from container.core.devices import GroupPlan
from container.core.settings import resolve_settings
from container.supervisor.cluster_setup import cluster_config, cluster_plan

SECRET = "0123456789abcdef0123456789abcdef"  # 32 hex characters, the shortest allowed


def test_no_cluster_size_or_a_size_of_one_is_a_single_machine():
    assert ClusterConfig.from_env({}) is None
    assert ClusterConfig.from_env({"LWS_GROUP_SIZE": "1", "LWS_LEADER_ADDRESS": "x"}) is None


@pytest.mark.parametrize("env", [
    {"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_LEADER_ADDR": "leader", "SAGELMI_CLUSTER_SECRET": SECRET},
    {"DJL_CLUSTER_SIZE": "2", "DJL_LEADER_ADDR": "leader", "SAGELMI_CLUSTER_SECRET": SECRET},
    {"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "leader", "LWS_WORKER_INDEX": "1", "SAGELMI_CLUSTER_SECRET": SECRET},
], ids=["sagelmi", "lmi", "leaderworkerset"])
def test_each_spelling_names_the_cluster(env):
    config = ClusterConfig.from_env(env)
    assert (config.size, config.leader, config.secret) == (2, "leader", SECRET.encode())
    assert config.index == (1 if "LWS_WORKER_INDEX" in env else None)


def test_the_secret_can_be_a_file(tmp_path):
    (tmp_path / "secret").write_text(SECRET + "\n")
    config = ClusterConfig.from_env({"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_LEADER_ADDR": "l",
                                     "SAGELMI_CLUSTER_SECRET_FILE": str(tmp_path / "secret")})
    assert config.secret == SECRET.encode()


@pytest.mark.parametrize("env,message", [
    ({"SAGELMI_CLUSTER_SIZE": "two"}, "SAGELMI_CLUSTER_SIZE='two' is not a number"),
    ({"SAGELMI_CLUSTER_SIZE": "2"}, "needs the leader's address: set SAGELMI_LEADER_ADDR"),
    ({"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_LEADER_ADDR": "l"}, "needs a shared secret on every node"),
    ({"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_LEADER_ADDR": "l", "SAGELMI_CLUSTER_SECRET": "short"}, "too short"),
    ({"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_LEADER_ADDR": "l", "SAGELMI_CLUSTER_SECRET": SECRET[:31]},
     r"SAGELMI_CLUSTER_SECRET is too short \(31 characters\): use at least 32 random characters"),
    ({"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_LEADER_ADDR": "l", "SAGELMI_CLUSTER_SECRET_FILE": "/nonexistent/s"},
     "cannot read it"),
    ({"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_LEADER_ADDR": "l", "SAGELMI_CLUSTER_SECRET": SECRET,
      "SAGELMI_CLUSTER_PORT": "x"}, "SAGELMI_CLUSTER_PORT='x' is not a number"),
])
def test_settings_that_cannot_work_are_one_line(env, message):
    with pytest.raises(ClusterError, match=message) as caught:
        ClusterConfig.from_env(env)
    assert "\n" not in str(caught.value)


def test_the_leader_is_index_zero_or_the_node_whose_address_it_is():
    base = {"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_CLUSTER_SECRET": SECRET}
    assert ClusterConfig.from_env({**base, "SAGELMI_LEADER_ADDR": "127.0.0.1"}).is_leader()
    assert not ClusterConfig.from_env({**base, "SAGELMI_LEADER_ADDR": "203.0.113.7"}).is_leader()
    worker = {**base, "SAGELMI_LEADER_ADDR": "127.0.0.1", "SAGELMI_NODE_INDEX": "1"}
    assert not ClusterConfig.from_env(worker).is_leader()


def test_leaderworkerset_names_a_missing_worker_by_its_hostname():
    config = ClusterConfig.from_env({"LWS_GROUP_SIZE": "3", "LWS_LEADER_ADDRESS": "llama-0.llama.default",
                                     "SAGELMI_CLUSTER_SECRET": SECRET})
    assert config.expected_name(2) == "worker node 2 (llama-0-2.llama.default)"


def _pair(server_secret: bytes, client_secret: bytes):
    a, b = socket.socketpair()
    result = {}

    def serve():
        try:
            result["server"] = Channel.accept(a, server_secret)
        except ClusterError as exc:
            result["server"] = exc
            a.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        result["client"] = Channel.connect(b, client_secret)
    except ClusterError as exc:
        result["client"] = exc
    thread.join(5)
    return result["server"], result["client"]


def test_the_channel_carries_messages_both_ways_with_one_secret():
    server, client = _pair(b"k" * 20, b"k" * 20)
    client.send({"type": "register", "index": 1})
    assert server.receive() == {"type": "register", "index": 1}
    server.send({"type": "welcome"})
    assert client.receive() == {"type": "welcome"}
    client.close()
    assert server.receive() is None


def test_a_different_secret_is_refused_on_both_sides():
    server, client = _pair(b"k" * 20, b"j" * 20)
    assert isinstance(server, ClusterError) and "does not know the cluster's secret" in str(server)
    assert isinstance(client, ClusterError) and "the cluster secrets differ" in str(client)


# A node's supervisor waiting for its peer's next message, as the registration does on both ends.
_RECEIVER = """
import socket, sys, time
from container.core.cluster import Channel
channel = Channel.connect(socket.create_connection(("127.0.0.1", int(sys.argv[1]))), sys.argv[2].encode())
print("waiting", flush=True)
print(channel.receive(silence=1.0, beat=0.25), flush=True)
began = time.monotonic()
try:
    channel.receive(silence=1.0, beat=0.25)
except TimeoutError:
    print(f"silent after {time.monotonic() - began:.1f} s", flush=True)
"""


def test_a_receiver_stopped_longer_than_the_silence_limit_hears_the_peer_that_was_stopped_too():
    """A loaded machine stops both nodes' supervisors at once (here: SIGSTOP for 2 s, past the 1 s
    limit); the first to run again must not count its own stop as the other's silence before the
    other could send its heartbeat (a plain socket timeout did: the group restarted in CI). A peer
    silent while the receiver runs is still found silent within the limit."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        child = subprocess.Popen(
            [sys.executable, "-c", _RECEIVER, str(listener.getsockname()[1]), SECRET],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        )
        try:
            listener.settimeout(30)
            conn, _ = listener.accept()
            peer = Channel.accept(conn, SECRET.encode())
            assert child.stdout.readline() == "waiting\n"
            time.sleep(0.3)  # in receive()
            os.kill(child.pid, signal.SIGSTOP)
            time.sleep(2.0)
            os.kill(child.pid, signal.SIGCONT)
            time.sleep(0.1)  # the peer's heartbeat, a moment after both run again
            peer.send({"type": "heartbeat"})
            out, _ = child.communicate(timeout=30)
        finally:
            child.kill()
            child.wait()
    lines = out.splitlines()
    assert lines[0] == "{'type': 'heartbeat'}", out
    assert lines[1] in ("silent after 1.0 s", "silent after 1.1 s", "silent after 1.2 s"), out


class _Capture:
    def __init__(self):
        self.frames = []

    def sendall(self, data):
        self.frames.append(data)


def _frame(client: Channel, message: dict) -> bytes:
    """The bytes ``client`` would send for its next message."""
    capture = _Capture()
    twin = Channel(capture, client._key, client._out_label, client._in_label)
    twin._sent = client._sent
    twin.send(message)
    return capture.frames[0]


def test_an_altered_message_fails_its_tag():
    server, client = _pair(b"k" * 20, b"k" * 20)
    frame = _frame(client, {"type": "launch", "command": "prted"})
    client.sock.sendall(frame.replace(b"prted", b"rm -r"))
    with pytest.raises(ClusterError, match="authentication tag"):
        server.receive()


def test_a_replayed_message_fails_its_tag():
    server, client = _pair(b"k" * 20, b"k" * 20)
    frame = _frame(client, {"type": "launch", "command": "prted"})
    client.sock.sendall(frame + frame)
    assert server.receive() == {"type": "launch", "command": "prted"}
    with pytest.raises(ClusterError, match="authentication tag"):
        server.receive()


def test_cluster_settings_are_checked_against_the_engine_settings(tmp_path, monkeypatch):
    for name, value in {"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_LEADER_ADDR": "127.0.0.1",
                        "SAGELMI_CLUSTER_SECRET": SECRET}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(supervisor.StartupError, match=r"\(3\) must be a number divisible by the cluster's 2 nodes"):
        cluster_config(resolve_settings({"OPTION_MPI_MODE": "true", "TENSOR_PARALLEL_DEGREE": "3"}, tmp_path))
    with pytest.raises(supervisor.StartupError, match=r"\(3\) must be a number divisible by the cluster's 2 nodes"):
        cluster_config(resolve_settings({"TENSOR_PARALLEL_DEGREE": "3"}, tmp_path))  # the built-in engine too
    with pytest.raises(supervisor.StartupError, match="option.distributed_executor_backend=uni: a cluster of 2 nodes "
                                                      "runs the built-in engine on vLLM's multiprocessing executor"):
        cluster_config(resolve_settings({"TENSOR_PARALLEL_DEGREE": "2", "OPTION_DISTRIBUTED_EXECUTOR_BACKEND": "uni"},
                                        tmp_path))
    # The built-in engine (no model.py) runs across the nodes on vLLM's own executor ...
    config = cluster_config(resolve_settings({"TENSOR_PARALLEL_DEGREE": "2"}, tmp_path))
    assert config is not None and config.engine_port == config.port + 1
    # ... a model.py's handle needs MPI mode.
    (tmp_path / "model.py").write_text("def handle(inputs):\n    return None\n")
    with pytest.raises(supervisor.StartupError, match="or each worker group as one mpirun across them: serve without "
                                                      "a model.py's handle"):
        cluster_config(resolve_settings({"TENSOR_PARALLEL_DEGREE": "2"}, tmp_path))
    settings = resolve_settings({"OPTION_MPI_MODE": "true", "TENSOR_PARALLEL_DEGREE": "4"}, tmp_path)
    config = cluster_config(settings)
    assert cluster_plan(settings, ["0", "1", "2", "3"], config) == [GroupPlan(0, ("0", "1"), 4, 1)]
    with pytest.raises(supervisor.StartupError, match="cluster's 2 nodes runs 2 ranks, but this one sees 1"):
        cluster_plan(settings, ["0"], config)


def _exported(command: list[str]) -> set[str]:
    return {command[i + 1] for i, word in enumerate(command) if word == "-x"}


def test_mpirun_across_a_cluster_reaches_the_nodes_through_sagelmi_not_ssh(tmp_path):
    settings = resolve_settings({"OPTION_MPI_MODE": "true", "TENSOR_PARALLEL_DEGREE": "2"}, tmp_path)
    env = {"CUDA_VISIBLE_DEVICES": "0", "SAGELMI_CLUSTER_SECRET": SECRET, "SAGELMI_NODE_INDEX": "0",
           "SAGELMI_CLUSTER_SIZE": "2", "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = supervisor.mpirun_command("/x/mpirun", settings, GroupPlan(0, (), 2, 1), ["w"], env,
                                        hosts=["10.0.0.1:1", "10.0.0.2:1"], launch_keys=tmp_path / "group-0.launch")
    assert command[command.index("--host") + 1] == "10.0.0.1:1,10.0.0.2:1"
    agent = command[command.index("plm_rsh_agent") + 1]
    assert agent.endswith(f" -m container.supervisor.rsh {tmp_path / 'group-0.launch'}")
    assert _exported(command) == {"VLLM_CPU_KVCACHE_SPACE"}  # not the secret, not per-node values


def test_mpirun_forwards_what_ranks_need_and_never_credentials(tmp_path):
    """Open MPI's channel is plain: the leader's AWS credentials and Hub token stay on the leader
    (each node's ranks read their own node's), and so does anything named like a credential."""
    settings = resolve_settings({"OPTION_MPI_MODE": "true", "TENSOR_PARALLEL_DEGREE": "2"}, tmp_path)
    credentials = {"AWS_ACCESS_KEY_ID": "AKIALEADER", "AWS_SECRET_ACCESS_KEY": "leader-secret",
                   "AWS_SESSION_TOKEN": "leader-session", "AWS_REGION": "us-west-2", "AWS_PROFILE": "prod",
                   "HF_TOKEN": "hf_leader", "HUGGING_FACE_HUB_TOKEN": "hf_leader2", "VLLM_API_KEY": "sk-leader",
                   "NCCL_PASSWORD": "nccl-leader-password", "SAGELMI_CLUSTER_SECRET": SECRET}
    needed = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD": "256", "HF_HOME": "/cache",
              "HF_HUB_OFFLINE": "1", "NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0",
              "OMP_NUM_THREADS": "4", "SAGELMI_LOG_FORMAT": "json", "PYTHONPATH": "/opt/code"}
    for hosts in (["10.0.0.1:1", "10.0.0.2:1"], None):
        command = supervisor.mpirun_command("/x/mpirun", settings, GroupPlan(0, (), 2, 1), ["w"],
                                            {**credentials, **needed}, hosts=hosts, launch_keys=tmp_path / "k")
        assert _exported(command) == set(needed)
        assert not any(value in " ".join(command) for value in credentials.values())


def test_a_users_hostfile_names_the_cluster_s_nodes_for_mpirun(tmp_path):
    settings = resolve_settings({"OPTION_MPI_MODE": "true", "TENSOR_PARALLEL_DEGREE": "2",
                                 "OPTION_MPI_HOSTFILE": "/opt/ml/model/hostfile"}, tmp_path)
    command = supervisor.mpirun_command("/x/mpirun", settings, GroupPlan(0, (), 2, 1), ["w"], {},
                                        hosts=["10.0.0.1:1", "10.0.0.2:1"], launch_keys=tmp_path / "k")
    assert command[command.index("--hostfile") + 1] == "/opt/ml/model/hostfile" and "--host" not in command
    assert command[command.index("plm_rsh_agent") + 1].endswith(f" -m container.supervisor.rsh {tmp_path / 'k'}")


def _doc_manifests() -> list[list[dict]]:
    """The YAML blocks of docs/cluster.md, each as its documents: the LeaderWorkerSet of vLLM's executor
    (an lmi-dist configuration), then Ray's."""
    import re

    import yaml

    from tests.server import REPO

    blocks = re.findall(r"```yaml\n(.*?)```", (REPO / "docs" / "cluster.md").read_text(), re.S)
    return [list(yaml.safe_load_all(text)) for text in blocks]


@pytest.mark.parametrize("which", [0, 1], ids=["vllm-mp", "ray"])
def test_the_leaderworkerset_manifest_of_the_docs_runs_one_image_with_one_environment(which, monkeypatch, tmp_path):
    from tests.server import REPO

    manifests = _doc_manifests()
    assert len(manifests) == 2
    manifest, *others = manifests[which]
    template = manifest["spec"]["leaderWorkerTemplate"]
    leader, worker = (template[t]["spec"]["containers"][0] for t in ("leaderTemplate", "workerTemplate"))
    assert leader["image"] == worker["image"] and leader["args"] == worker["args"] == ["serve"]
    env = {e["name"]: e["value"] for e in leader["env"]}
    assert env == {e["name"]: e["value"] for e in worker["env"]}
    # What LeaderWorkerSet sets, with the manifest's own variables, is a cluster sagelmi accepts.
    secret = REPO / "docs" / "cluster.md"  # any readable file stands in for the mounted secret
    lws = {"LWS_LEADER_ADDRESS": "llama-0.llama.default", "LWS_GROUP_SIZE": str(template["size"]),
           "LWS_WORKER_INDEX": "1", **env, "SAGELMI_CLUSTER_SECRET_FILE": str(secret)}
    config = ClusterConfig.from_env(lws)
    assert (config.size, config.leader, config.index) == (2, "llama-0.llama.default", 1)
    for name, value in lws.items():
        monkeypatch.setenv(name, value)
    settings = resolve_settings(env, str(tmp_path))
    assert cluster_config(settings) is not None  # the mode and the split are a cluster's
    assert leader["readinessProbe"]["httpGet"]["path"] == "/ping" and "readinessProbe" not in worker
    mounts = {m["mountPath"] for m in leader["volumeMounts"]}
    assert str(Path(env["SAGELMI_CLUSTER_SECRET_FILE"]).parent) in mounts
    if which == 1:  # Ray's ports reach the group's own pods alone
        assert env["OPTION_DISTRIBUTED_EXECUTOR_BACKEND"] == "ray"
        (policy,) = others
        pods = {"leaderworkerset.sigs.k8s.io/name": manifest["metadata"]["name"]}
        assert policy["kind"] == "NetworkPolicy" and policy["spec"]["podSelector"]["matchLabels"] == pods
        assert policy["spec"]["ingress"] == [{"ports": [{"port": 8080}]},
                                             {"from": [{"podSelector": {"matchLabels": pods}}]}]


def test_the_engine_across_the_nodes_gets_each_node_its_place_and_a_node_s_ended_part_restarts_the_group():
    """The leader tells each registered worker node its rank of vLLM's executor for one start of the
    group; a node's report that its part ended counts as a loss for that start alone."""
    from container.core.launch import EngineNodes
    from container.supervisor.cluster import Leader, Node
    from container.supervisor.engine_nodes import _parse_start

    server, client = _pair(b"k" * 20, b"k" * 20)
    leader = Leader(ClusterConfig(size=2, leader="127.0.0.1", secret=SECRET.encode()))
    leader.nodes[1] = Node(1, "10.0.0.2", "w", client)
    leader.start_engines(3, EngineNodes(2, 0, "10.0.0.1", 8890))
    message = server.receive()
    assert _parse_start(message) == (3, EngineNodes(2, 1, "10.0.0.1", 8890), "10.0.0.2")
    leader.engine_exit(1, {"type": "engine-exit", "incarnation": 2, "reason": "old"})  # an earlier start's
    assert leader.losses == 0
    leader.engine_exit(1, {"type": "engine-exit", "incarnation": 3, "reason": "vLLM's node ended (exit code 1)"})
    assert leader.losses == 1
    assert leader.loss_reason() == "worker node 1: vLLM's node ended (exit code 1)"
    leader.engine_exit(1, {"type": "engine-exit", "incarnation": 3, "reason": "again"})  # counted once
    assert leader.losses == 1
    leader.stop_engines()
    assert server.receive() == {"type": "engine-stop"}
    with pytest.raises(ValueError, match="master_addr is not an address"):
        _parse_start({**message, "master_addr": "a b"})
    with pytest.raises(ValueError, match="node_rank is not a number"):
        _parse_start({**message, "node_rank": "1"})


def test_a_taken_engine_rendezvous_port_stops_the_leader_in_one_line():
    from container.supervisor.engine_nodes import check_engine_port

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        config = ClusterConfig(size=2, leader="127.0.0.1", secret=SECRET.encode(), port=port - 1,
                               node_address="127.0.0.1")
        with pytest.raises(supervisor.StartupError, match=f"rendezvous port {port} \\(SAGELMI_CLUSTER_PORT \\+ 1\\) "
                                                          "cannot be bound on 127.0.0.1"):
            check_engine_port(config)
    check_engine_port(config)  # free again
