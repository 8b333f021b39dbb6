"""lmi-dist is LMI's name for the built-in vLLM engine on several ranks: a configuration with
``option.rolling_batch=lmi-dist`` (with or without LMI's MPI mode settings) starts the same engine, with
the same arguments, as the same configuration without it, on vLLM's own executor (no mpirun). Checked
for every cell of the option matrix (tests/e2e/test_option_matrix.py, whose cells are served or refused
on real engines): lmi-dist crossed with each setting there is refused alike or given the same vLLM
engine arguments."""

import pytest

from container.core.engine_args import EngineOptionError, check_engine_options
from container.core.handler_choice import describe_handler, mpirun_groups, uses_builtin_engine
from container.core.settings import SettingsError, resolve_settings
from container.supervisor.cluster_setup import cluster_config, cluster_plan
from handlers.engines.vllm_args import build_engine_kwargs
from tests.e2e.test_option_matrix import CELLS, SHARED_CELLS

LMI_DIST = ({"OPTION_ROLLING_BATCH": "lmi-dist"},  # LMI's quick start
            {"OPTION_ROLLING_BATCH": "lmi-dist", "OPTION_MPI_MODE": "true"},  # LMI's lmi-dist guides
            {"OPTION_ROLLING_BATCH": "lmi-dist", "OPTION_ENGINE": "MPI"},  # serving.properties' engine=MPI
            {"OPTION_ENGINE": "MPI"})  # MPI mode without a model.py: lmi-dist by LMI's default
SETTINGS = {**{cell: env for cell, (env, _) in CELLS.items()}, **SHARED_CELLS}


def _outcome(env: dict[str, str], model_dir) -> tuple[str, object]:
    """What serve would start with these settings: its refusal, or the engine's arguments."""
    try:
        settings = resolve_settings({"OPTION_DTYPE": "float32", **env}, model_dir)
        check_engine_options(settings, model_dir)
    except (SettingsError, EngineOptionError) as exc:
        return "refused", str(exc).replace("option.rolling_batch=lmi-dist", "option.rolling_batch=auto")
    assert uses_builtin_engine(settings, model_dir) and not mpirun_groups(settings, model_dir)
    tensor_parallel = settings.tensor_parallel_degree if isinstance(settings.tensor_parallel_degree, int) else 1
    return "serves", build_engine_kwargs(settings, str(model_dir), tensor_parallel, cpu=True)


@pytest.mark.parametrize("cell", list(SETTINGS))
def test_lmi_dist_with_each_cells_settings_is_the_built_in_engine_with_them(cell, tiny_model):
    plain = {k: v for k, v in SETTINGS[cell].items() if k != "OPTION_ROLLING_BATCH"}
    expected = _outcome(plain, tiny_model)
    for lmi_dist in LMI_DIST:
        assert _outcome({**plain, **lmi_dist}, tiny_model) == expected, lmi_dist


def test_config_names_the_lmi_dist_handler_and_vllms_processes(tiny_model):
    settings = resolve_settings({"OPTION_ROLLING_BATCH": "lmi-dist", "TENSOR_PARALLEL_DEGREE": "2"}, tiny_model)
    assert describe_handler(settings, tiny_model) == "the built-in lmi-dist handler (option.rolling_batch=lmi-dist)"


def test_on_a_cluster_of_two_lmi_dist_is_the_built_in_engines_cluster(tiny_model, monkeypatch):
    """The README's two nodes (tensor parallel 2, one rank on each) with lmi-dist: each node checks and
    splits the group as it does without it, with vLLM's nodes (no mpirun: the worker node runs vLLM's
    headless node, container.supervisor), and the leader starts the same engine."""
    for name, value in {"SAGELMI_CLUSTER_SIZE": "2", "SAGELMI_LEADER_ADDR": "sagelmi-leader",
                        "SAGELMI_CLUSTER_SECRET": "0" * 64}.items():
        monkeypatch.setenv(name, value)
    plain = {"OPTION_DTYPE": "float32", "TENSOR_PARALLEL_DEGREE": "2"}

    def nodes(env):
        settings = resolve_settings(env, tiny_model)
        config = cluster_config(settings)
        kwargs = build_engine_kwargs(settings, str(tiny_model), 2, cpu=True)
        return config, cluster_plan(settings, [], config), mpirun_groups(settings, tiny_model), kwargs

    expected = nodes(plain)
    assert expected[0] is not None and expected[2] is False
    for lmi_dist in LMI_DIST:
        assert nodes({**plain, **lmi_dist}) == expected, lmi_dist
