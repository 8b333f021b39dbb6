"""Ray across the cluster's nodes (container/core/ray_cluster.py, container/supervisor/ray_node.py):
the commands and environments sagelmi builds, as docs/cluster.md shows them, and the vLLM engine
arguments of the setting. The Ray cluster itself forms in tests/container/test_ray_cluster.py."""

import shlex
import stat

from container.core.cluster import ClusterConfig
from container.core.ray_cluster import RayNode, auth_environment, ray_node, ray_token, uses_ray
from container.core.settings import resolve_settings
from container.supervisor import cluster_setup as supervisor_cluster
from container.supervisor.ray_node import RayProcess, ray_process
from handlers.engines.vllm_args import build_engine_kwargs
from tests.readme import section, shell_commands

SECRET = "0123456789abcdef" * 4
DOC_LEADER, DOC_LEADER_IP = "llama-0.llama", "10.0.0.1"  # docs/cluster.md's example
DOC_COMMANDS = shell_commands(section("Ray across the nodes"))


def settings(tmp_path, **env):
    return resolve_settings({k: str(v) for k, v in env.items()}, tmp_path)


def test_the_setting_is_vllms_executor_backend(tmp_path):
    assert uses_ray(settings(tmp_path, OPTION_DISTRIBUTED_EXECUTOR_BACKEND="Ray"))
    assert not uses_ray(settings(tmp_path, OPTION_DISTRIBUTED_EXECUTOR_BACKEND="mp"))
    assert not uses_ray(settings(tmp_path))


def test_the_documented_commands_are_the_ones_sagelmi_runs():
    head, joining = DOC_COMMANDS
    assert shlex.split(head) == RayNode(DOC_LEADER, 6379, head=True, node_address=DOC_LEADER_IP).start_command()
    assert shlex.split(joining) == RayNode(DOC_LEADER, 6379, head=False).start_command()
    assert f"`RAY_ADDRESS={DOC_LEADER}:6379`" in section("Ray across the nodes")


def test_the_head_advertises_the_leaders_address_and_a_node_its_own_when_given():
    assert ray_node("localhost", 6380, head=True, node_address=None).node_address == "127.0.0.1"
    assert ray_node("localhost", 6380, head=True, node_address="10.1.2.3").node_address == "10.1.2.3"
    joining = ray_node("leader.example", 6380, head=False, node_address=None)
    assert joining.node_address is None and "--address=leader.example:6380" in joining.start_command()
    assert "--node-ip-address=10.1.2.4" in ray_node("leader", 6380, False, "10.1.2.4").start_command()


def test_every_ray_process_and_the_engine_use_a_token_derived_from_the_secret():
    token = ray_token(SECRET.encode())
    assert token == ray_token(SECRET.encode()) and len(token) == 64
    assert SECRET not in token and token != ray_token(b"another secret of thirty-two characters")
    assert auth_environment("/run/t") == {
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/run/t", "RAY_USAGE_STATS_ENABLED": "0"}
    driver = RayNode("leader", 6380, head=True).driver_environment("/run/t")
    assert driver == {**auth_environment("/run/t"), "RAY_ADDRESS": "leader:6380"}


def test_the_engine_gets_ray_as_its_executor_and_not_the_port(tmp_path):
    chosen = settings(tmp_path, OPTION_DISTRIBUTED_EXECUTOR_BACKEND="ray", TENSOR_PARALLEL_DEGREE=8,
                      PIPELINE_PARALLEL_DEGREE=2, OPTION_RAY_PORT=6380)
    kwargs = build_engine_kwargs(chosen, "org/model", 8)
    assert kwargs["distributed_executor_backend"] == "ray"
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (8, 2)
    assert "ray_port" not in kwargs


def cluster_env(monkeypatch, **more):
    for name, value in {"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_LEADER_ADDR": "localhost",
                        "SAGELMI_CLUSTER_SECRET": SECRET, **more}.items():
        monkeypatch.setenv(name, value)


def test_a_cluster_runs_the_built_in_engine_in_python_mode_on_ray(tmp_path, monkeypatch):
    cluster_env(monkeypatch, SAGELMI_NODE_INDEX="0")
    chosen = settings(tmp_path, TENSOR_PARALLEL_DEGREE=2, OPTION_DISTRIBUTED_EXECUTOR_BACKEND="ray",
                      OPTION_RAY_PORT=6380)
    config = supervisor_cluster.cluster_config(chosen)
    assert config is not None
    ray = ray_process(chosen, config, tmp_path, ray="/bin/ray")
    assert ray is not None and ray.node == RayNode("localhost", 6380, head=True, node_address="127.0.0.1")
    assert ray_process(settings(tmp_path, TENSOR_PARALLEL_DEGREE=2), config, tmp_path) is None
    assert ray_process(chosen, None, tmp_path) is None
    mpi = settings(tmp_path, TENSOR_PARALLEL_DEGREE=2, OPTION_DISTRIBUTED_EXECUTOR_BACKEND="ray", OPTION_MPI_MODE="true")
    assert ray_process(mpi, config, tmp_path, ray="/bin/ray") is not None  # the built-in engine, in MPI mode too
    handler = tmp_path / "handler"
    handler.mkdir()
    (handler / "model.py").write_text("def handle(inputs):\n    return None\n")
    mpi = settings(handler, TENSOR_PARALLEL_DEGREE=2, OPTION_DISTRIBUTED_EXECUTOR_BACKEND="ray", OPTION_MPI_MODE="true")
    assert ray_process(mpi, config, tmp_path) is None  # a model.py in MPI mode: its groups are mpirun jobs
    monkeypatch.setenv("SAGELMI_NODE_INDEX", "1")
    ray = ray_process(chosen, ClusterConfig.from_env(), tmp_path, ray="/bin/ray")
    assert ray is not None and ray.node == RayNode("localhost", 6380, head=False)


def test_the_token_file_is_the_users_alone_and_goes_with_ray(tmp_path):
    ray = RayProcess(RayNode("localhost", 6380, head=True), SECRET.encode(), tmp_path, ray="/bin/false")
    ray.start()
    try:
        assert ray.token_path.read_text() == ray_token(SECRET.encode())
        assert stat.S_IMODE(ray.token_path.stat().st_mode) == 0o600
    finally:
        ray.stop()
    assert not ray.token_path.exists()
