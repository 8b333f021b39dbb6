"""A SageMaker inference toolkit script in MPI mode (engine=MPI / option.mpi_mode=true with
TENSOR_PARALLEL_DEGREE=2): both ranks load it and run every request, rank 0 answers."""

import concurrent.futures

import pytest

from tests.integration.test_inference_toolkit import _model_dir, post
from tests.server import Server

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("mode", [{"OPTION_MPI_MODE": "true"}, {"OPTION_ENGINE": "MPI"}], ids=["mpi_mode", "engine"])
def test_both_ranks_run_the_script_and_rank_0_answers(tmp_path, mode):
    record = tmp_path / "record"
    record.mkdir()
    env = {**mode, "TENSOR_PARALLEL_DEGREE": "2", "SAGELMI_TEST_RECORD_DIR": str(record)}
    bodies = [{"values": [i, i + 1]} for i in range(6)]
    with Server(_model_dir(tmp_path, "sm_mpi"), env=env) as server:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda body: post(server, body), bodies))
    assert [a.status_code for a in answers] == [200] * 6
    assert [a.json() for a in answers] == [{"doubled": [2 * i, 2 * i + 2], "rank": 0} for i in range(6)]
    logs = {path.stem: path.read_text().splitlines() for path in record.glob("*.log")}
    assert sorted(logs) == ["0", "1"]
    assert logs["0"][0] == logs["1"][0] == "model_fn world_size=2"
    assert logs["0"] == logs["1"]  # every request reached both ranks, in the same order
    assert sorted(logs["0"][1:]) == sorted(f'predict {{"values": [{i}, {i + 1}]}}' for i in range(6))
