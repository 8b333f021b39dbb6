"""MPI mode with real mpirun, two ranks per group, on the CPU."""

import concurrent.futures
import json
import os
import re
import signal
import time

import pytest
import requests

from container.core.proc import parents
from tests.mpi.conftest import alive, rank_log, rank_records
from tests.readme import run_shell, section, serve_settings, shell_commands
from tests.server import REPO, MODEL_DIRS, Server, processes

pytestmark = pytest.mark.mpi

MPI = {"OPTION_MPI_MODE": "true", "TENSOR_PARALLEL_DEGREE": "2"}


# "Your own model.py in MPI mode" (docs/large_models.md): serve the example on two ranks, ask it.
TENSOR_PARALLEL_EXAMPLE = shell_commands(section("Your own model.py in MPI mode"))


def test_tensor_parallel_example_answers_what_one_process_computes():
    serve, ask = TENSOR_PARALLEL_EXAMPLE
    env, model_dir = serve_settings(serve)
    assert env == MPI and model_dir == "examples/tensor_parallel"
    rows = [[[i, -i, 2 * i, 1, 0, 3, -2, i % 3]] for i in range(8)]
    with Server(REPO / model_dir) as single, Server(REPO / model_dir, env=env) as sharded:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            expected = list(pool.map(lambda r: single.invoke({"inputs": r}).json(), rows))
            got = list(pool.map(lambda r: sharded.invoke({"inputs": r}).json(), rows))
        readme = run_shell(ask, sharded.port)
        assert json.loads(readme.stdout) == single.invoke(json.loads(ask.split("-d ", 1)[1].strip("'"))).json() \
            | {"world_size": 2}
    assert {e["world_size"] for e in expected} == {1} and {g["world_size"] for g in got} == {2}
    assert [g["outputs"] for g in got] == [e["outputs"] for e in expected]
    assert len({json.dumps(e["outputs"]) for e in expected}) == 8  # the inputs do give different answers


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    record = tmp_path_factory.mktemp("ranks")
    with Server(MODEL_DIRS / "mpi_ranks", env={**MPI, "OPTION_RECORD_DIR": str(record),
                                               "OPTION_PREDICT_TIMEOUT": "2"}) as server:
        server.record = record
        yield server


def test_each_rank_gets_its_place_in_the_group(ranks):
    records = sorted(rank_records(ranks.record), key=lambda r: r["RANK"])
    assert [(r["RANK"], r["WORLD_SIZE"], r["LOCAL_RANK"]) for r in records] == [("0", "2", "0"), ("1", "2", "1")]
    assert records[0]["MASTER_ADDR"] == records[1]["MASTER_ADDR"] == "127.0.0.1"
    assert records[0]["MASTER_PORT"] == records[1]["MASTER_PORT"] and int(records[0]["MASTER_PORT"]) > 0


def test_every_rank_gets_every_request_and_cancel_in_the_same_order(ranks):
    bodies = [{"sleep": 0.05 * (i % 4)} for i in range(8)] + [{"stream": 5}] * 3 + [{"sleep": 30}] * 3
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: ranks.invoke(b, timeout=30), bodies))
    assert [a.status_code for a in answers] == [200] * 11 + [504] * 3  # the slow ones: predict_timeout=2
    # only rank 0 answers, streams included
    assert {a.json()["rank"] for a in answers[:8]} == {0}
    for stream in answers[8:11]:
        assert [json.loads(line)["outputs"]["rank"] for line in stream.text.splitlines()] == [0] * 5  # LMI lines
    time.sleep(0.5)  # the cancels reach both ranks
    logs = [rank_log(ranks.record, r["pid"]) for r in rank_records(ranks.record)]
    assert len(logs[0]) == 8 * 2 + 3 * 2 + 3 * 2  # start and end/cancel of each
    assert sum(line.startswith("cancel") for line in logs[0]) == 3
    # What each rank received, in order, is the same; when each finished is its own business.
    received = [[line for line in log if not line.startswith("end")] for log in logs]
    assert received[0] == received[1]
    assert sorted(logs[0]) == sorted(logs[1])


def test_two_mpi_groups_get_their_device_slices(tmp_path):
    env = {**MPI, "CUDA_VISIBLE_DEVICES": "0,1,2,3", "OPTION_RECORD_DIR": str(tmp_path)}
    with Server(MODEL_DIRS / "mpi_ranks", env=env) as server:
        groups = requests.get(server.url("/ping"), timeout=2).json()["workers"]
        assert [g["devices"] for g in groups] == ["0,1", "2,3"]
        seen = {(r["CUDA_VISIBLE_DEVICES"], r["RANK"]) for r in rank_records(tmp_path)}
        assert seen == {("0,1", "0"), ("0,1", "1"), ("2,3", "0"), ("2,3", "1")}
        answering = {server.invoke({"sleep": 0.2}).json()["pid"] for _ in range(4)}
        assert len(answering) == 2  # requests spread over both groups' rank 0
        ports = {r["MASTER_PORT"] for r in rank_records(tmp_path)}
        assert len(ports) == 2  # each group meets on its own port


def test_a_killed_rank_fails_requests_at_once_and_the_group_restarts(tmp_path):
    env = {**MPI, "OPTION_RECORD_DIR": str(tmp_path)}
    with Server(MODEL_DIRS / "mpi_ranks", env=env) as server:
        old = {r["RANK"]: r["pid"] for r in rank_records(tmp_path)}
        (group,) = server.group_pids()  # mpirun
        family = processes(group)
        assert set(old.values()) < set(family)  # the ranks are below mpirun
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            running = [pool.submit(server.invoke, {"sleep": 60}) for _ in range(3)]
            server.wait_until(lambda r: r.json()["workers"][0]["in_flight"] == 3, timeout=5)
            killed_at = time.monotonic()
            os.kill(old["1"], signal.SIGKILL)
            results = [f.result(timeout=10) for f in running]
            assert time.monotonic() - killed_at < 5
        assert [r.status_code for r in results] == [503] * 3
        assert "stopped while handling the request" in results[0].json()["error"]
        assert requests.get(server.url("/ping"), timeout=2).status_code != 200
        server.wait_until(lambda r: r.status_code == 200, timeout=60)
        assert server.invoke({"sleep": 0}).status_code == 200
        assert not set(family) & set(parents())  # mpirun and the old ranks are gone
        new = {r["RANK"]: r["pid"] for r in rank_records(tmp_path) if r["pid"] not in old.values()}
        assert set(new) == {"0", "1"} and all(alive(pid) for pid in new.values())
        # the supervisor reports the worker's own reason, sent over the wire before it exited
        assert re.search(r"worker group 0 \(pid \d+\) died: rank 1 of the group went away", server.log())


def test_a_rank_that_fails_to_start_stops_start_up_with_its_error(tmp_path):
    env = {**MPI, "OPTION_RECORD_DIR": str(tmp_path), "OPTION_FAIL_INIT_ON_RANK": "1"}
    server = Server(MODEL_DIRS / "mpi_ranks", env=env).start(wait_ready=False)
    assert server.wait_exit(60) == 1
    log = server.log()
    assert "rank 1 refuses to start (fail_init_on_rank)" in log
    assert "start-up failed" in log


def test_dynamic_batches_are_the_same_on_every_rank(tmp_path):
    with Server(MODEL_DIRS / "lmi_batching", env={**MPI, "OPTION_RECORD_DIR": str(tmp_path)}) as server:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: server.invoke({"id": i}), range(8)))
        assert [r.json()["id"] for r in answers] == list(range(8))
        deadline = time.monotonic() + 10
        while True:  # the other rank's answers are dropped: wait for it to finish its batches
            batches = [(tmp_path / f"rank-{rank}.batches").read_text().splitlines()
                       if (tmp_path / f"rank-{rank}.batches").exists() else [] for rank in (0, 1)]
            if batches[0] == batches[1] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert batches[0] == batches[1]  # rank 0 formed the batches; rank 1 ran exactly those
    assert sorted(i for line in batches[0] for i in json.loads(line)) == list(range(8))
    assert max(len(json.loads(line)) for line in batches[0]) > 1


def test_a_killed_supervisor_leaves_no_mpirun_or_rank_behind(tmp_path):
    """mpirun has no tie to its parent of its own: sagelmi starts it set to get SIGTERM when the
    supervisor dies, so SIGKILL of `sagelmi serve` does not leave the group running."""
    env = {**MPI, "OPTION_RECORD_DIR": str(tmp_path)}
    with Server(MODEL_DIRS / "mpi_ranks", env=env) as server:
        ranks = [r["pid"] for r in rank_records(tmp_path)]
        (group,) = server.group_pids()  # mpirun
        family = processes(group)
        assert set(ranks) < set(family)
        os.kill(server.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while set(family) & set(parents()):
            assert time.monotonic() < deadline, "mpirun or its ranks outlived the killed supervisor"
            time.sleep(0.2)
