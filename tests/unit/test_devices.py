import pytest

from container.core.devices import GroupPlan, cpu_binding, cpu_threads, discover_devices, parse_visible_devices, plan_groups
from container.core.settings import SettingsError, resolve_settings


def settings(tmp_path, **env):
    return resolve_settings({k: str(v) for k, v in env.items()}, tmp_path)


def test_visible_devices_parsing():
    assert parse_visible_devices("0,1, 2") == ["0", "1", "2"]
    assert parse_visible_devices("") == []
    assert parse_visible_devices("-1") == []
    assert parse_visible_devices("GPU-abc,GPU-def") == ["GPU-abc", "GPU-def"]


def test_cuda_visible_devices_is_honoured(tmp_path):
    s = settings(tmp_path, CUDA_VISIBLE_DEVICES="0,1,2,3")
    assert discover_devices(s, proc_dir=tmp_path / "absent") == ["0", "1", "2", "3"]


def test_driver_proc_is_used_when_unset(tmp_path):
    proc = tmp_path / "gpus"
    for bus in ("0000:00:1e.0", "0000:00:1f.0"):
        (proc / bus).mkdir(parents=True)
    assert discover_devices(settings(tmp_path), proc_dir=proc) == ["0", "1"]


def test_tensor_parallel_two_over_four_devices_gives_two_slices(tmp_path):
    plans = plan_groups(settings(tmp_path, TENSOR_PARALLEL_DEGREE=2), ["0", "1", "2", "3"])
    assert [p.cuda_visible_devices for p in plans] == ["0,1", "2,3"]


def test_max_uses_every_device_in_one_group(tmp_path):
    plans = plan_groups(settings(tmp_path, TENSOR_PARALLEL_DEGREE="max"), ["4", "5", "6"])
    assert [p.cuda_visible_devices for p in plans] == ["4,5,6"]


def test_max_workers_caps_groups_and_leftovers_stay_unused(tmp_path):
    assert len(plan_groups(settings(tmp_path, SERVING_MAX_WORKERS=3), ["0"] * 8)) == 3
    plans = plan_groups(settings(tmp_path, TENSOR_PARALLEL_DEGREE=2), ["0", "1", "2"])
    assert [p.cuda_visible_devices for p in plans] == ["0,1"]


def test_cpu_groups_follow_worker_settings(tmp_path):
    assert [p.devices for p in plan_groups(settings(tmp_path), [])] == [()]
    assert len(plan_groups(settings(tmp_path, SAGEMAKER_MODEL_SERVER_WORKERS=3), [])) == 3


def test_impossible_plans_are_explained(tmp_path):
    with pytest.raises(SettingsError, match="needs 4 accelerators, but only 2 are visible"):
        plan_groups(settings(tmp_path, TENSOR_PARALLEL_DEGREE=4), ["0", "1"])
    with pytest.raises(SettingsError, match=r"tensor_parallel_degree=2 \(env TENSOR_PARALLEL_DEGREE\) x "
                                            r"option.pipeline_parallel_degree=2 \(env PIPELINE_PARALLEL_DEGREE\) "
                                            r"needs 4 accelerators, but only 3"):
        plan_groups(settings(tmp_path, TENSOR_PARALLEL_DEGREE=2, PIPELINE_PARALLEL_DEGREE=2), ["0", "1", "2"])
    with pytest.raises(SettingsError, match="divisible by 2"):
        plan_groups(settings(tmp_path, TENSOR_PARALLEL_DEGREE="max", PIPELINE_PARALLEL_DEGREE=2), ["0", "1", "2"])


def test_groups_are_sized_tensor_times_pipeline_parallel(tmp_path):
    plans = plan_groups(settings(tmp_path, TENSOR_PARALLEL_DEGREE=2, PIPELINE_PARALLEL_DEGREE=2), list("01234567"))
    assert [(p.cuda_visible_devices, p.world_size) for p in plans] == [("0,1,2,3", 4), ("4,5,6,7", 4)]
    plans = plan_groups(settings(tmp_path, TENSOR_PARALLEL_DEGREE="max", PIPELINE_PARALLEL_DEGREE=2), list("0123"))
    assert [(p.tensor_parallel_degree, p.pipeline_parallel_degree) for p in plans] == [(2, 2)]


def test_without_accelerators_parallel_groups_run_their_processes_on_the_cpu(tmp_path):
    plans = plan_groups(settings(tmp_path, SM_NUM_GPUS=2, PIPELINE_PARALLEL_DEGREE=2), [])
    assert [(p.devices, p.world_size) for p in plans] == [((), 4)]
    assert plan_groups(settings(tmp_path, TENSOR_PARALLEL_DEGREE="max"), [])[0].world_size == 1


def test_cpu_binding_gives_each_engine_process_its_own_cores():
    assert cpu_binding([GroupPlan(0, (), 2, 1)], cores=[0, 1]) == {0: "0|1"}
    assert cpu_binding([GroupPlan(0, (), 1, 2)], cores=list(range(8))) == {0: "0-3|4-7"}
    assert cpu_binding([GroupPlan(0, (), 2, 1), GroupPlan(1, (), 2, 1)], cores=list(range(8))) == \
        {0: "0-1|2-3", 1: "4-5|6-7"}
    # more processes than cores: shares wrap around rather than refuse
    assert cpu_binding([GroupPlan(0, (), 2, 1), GroupPlan(1, (), 2, 1)], cores=[0, 1]) == {0: "0|1", 1: "0|1"}


def test_cpu_threads_are_the_cores_of_one_processs_share():
    assert cpu_threads([GroupPlan(0, (), 1, 2)], cores=list(range(8))) == 4
    assert cpu_threads([GroupPlan(0, (), 1, 1)], cores=[0, 1]) == 2
    assert cpu_threads([GroupPlan(0, (), 2, 1), GroupPlan(1, (), 2, 1)], cores=[0, 1]) == 1  # never none
