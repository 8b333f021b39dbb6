import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from container import supervisor
from container.core.devices import GroupPlan, cpu_threads
from container.core.settings import resolve_settings
from container.supervisor.groups import WorkerGroup


def test_mpirun_command_starts_tp_x_pp_ranks_with_the_users_arguments(tmp_path):
    settings = resolve_settings({"OPTION_MPI_HOSTFILE": "/etc/hostfile", "OPTION_MPI_EXTRA_ARGS": "--mca btl ^ofi -v"},
                                tmp_path)
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_TOKEN": "x", "SECRET_THING": "y",
           "PATH": "/bin"}
    command = supervisor.mpirun_command("/x/mpirun", settings, GroupPlan(0, ("0", "1"), 1, 2), ["python", "-m", "w"],
                                        env)
    assert command[:3] == ["/x/mpirun", "-np", "2"]
    assert ("--allow-run-as-root" in command) == (os.geteuid() == 0)
    assert command[command.index("--hostfile") + 1] == "/etc/hostfile"
    assert command[command.index("-v") - 3:command.index("-v") + 1] == ["--mca", "btl", "^ofi", "-v"]
    exported = {command[i + 1] for i, word in enumerate(command) if word == "-x"}
    assert exported == {"CUDA_VISIBLE_DEVICES", "VLLM_CPU_KVCACHE_SPACE", "PATH"}  # not HF_TOKEN, not SECRET_THING
    assert command[-4:] == ["python", "-m", "w", "--mpi"]
    assert command[command.index("--bind-to") + 1] == "none"  # the engine places its threads, not Open MPI


@pytest.mark.parametrize("extra", ["--bind-to core", "--bind-to=socket", "--mca hwloc_base_binding_policy core"])
def test_a_users_binding_in_mpi_extra_args_replaces_bind_to_none(tmp_path, extra):
    settings = resolve_settings({"OPTION_MPI_EXTRA_ARGS": extra}, tmp_path)
    command = supervisor.mpirun_command("/x/mpirun", settings, GroupPlan(0, (), 2, 1), ["w"], {})
    assert "none" not in command and command[-len(extra.split()) - 2:-2] == extra.split()


def test_a_missing_mpirun_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    with pytest.raises(supervisor.StartupError, match=r"needs Open MPI's mpirun.*pip install 'sagelmi\[mpi\]'"):
        supervisor.find_mpirun()


def test_mpirun_is_found_next_to_this_python_without_path(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert supervisor.find_mpirun().endswith("/mpirun")


def test_a_long_tmpdir_moves_the_runtime_directory_where_its_sockets_fit(tmp_path, monkeypatch):
    long = tmp_path / ("d" * (100 - len(str(tmp_path))))
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    runtime = supervisor.runtime_directory()
    try:
        assert runtime.parent == Path("/tmp")
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(runtime / "group-9999.sock.fd"))  # AF_UNIX path too long under the 100-byte TMPDIR
    finally:
        shutil.rmtree(runtime)
    short = Path(tempfile.mkdtemp(dir="/tmp"))  # tmp_path itself may be too long (a lane's TMPDIR)
    monkeypatch.setattr(tempfile, "tempdir", str(short))
    try:
        assert supervisor.runtime_directory().parent == short
    finally:
        shutil.rmtree(short)


@pytest.mark.parametrize("users", [None, "3"])
def test_mpi_ranks_on_the_cpu_get_their_share_of_the_cores_as_openmp_threads(tmp_path, monkeypatch, users):
    """mpirun, unlike vLLM's own launcher, sets no OMP_NUM_THREADS: the group does (the user's wins), and
    every rank gets it, on other nodes too. Without it, every rank's OpenMP starts on every core the
    group's ranks share."""
    if users is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", users)
    settings = resolve_settings({"OPTION_MPI_MODE": "true", "TENSOR_PARALLEL_DEGREE": "2"}, tmp_path)
    plan = GroupPlan(0, (), 2, 1)
    threads = cpu_threads([plan], cores=[0, 1, 2, 3])
    group = WorkerGroup(plan, settings, tmp_path, str(tmp_path), "/x/mpirun", "0-1|2-3", omp_threads=threads)
    try:
        env = group._env()
        assert env["OMP_NUM_THREADS"] == (users or "2")
        command = group.command(env)
        assert command[command.index("OMP_NUM_THREADS") - 1] == "-x"
    finally:
        group.client.close()
