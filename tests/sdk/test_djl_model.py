"""SagelmiModel as users of sagemaker.djl_inference.DJLModel know it: the same
arguments (a positional model_id, task, engine, min_workers ...) build the
environment DJLModel builds, compared with DJLModel's own code on the sagemaker
SDK 2.x (3.x has no DJLModel: tests/sdk/test_other_major.py runs this file in a
2.x virtual environment when the shared one has 3.x). No AWS calls (moto for
DJLModel's session), no server."""

import inspect

import pytest

from container.core.settings import SettingsError, resolve_settings
from sagemaker_sdk import SDK_MAJOR, SagelmiModel
from tests.sdk.aws import IMAGE, ROLE, aws, components  # noqa: F401 (fixtures)

if SDK_MAJOR != 2:
    pytest.skip("DJLModel is sagemaker 2.x's (test_other_major.py runs this file there)", allow_module_level=True)

import sagemaker  # noqa: E402
from sagemaker.djl_inference import DJLModel  # noqa: E402

# The names differ, the setting is the same: sagelmi writes LMI's own spelling of each setting
# (the first of its environment names in container/core/setting_keys.py, the one serving.properties'
# key maps to); DJLModel writes the Hugging Face / SageMaker spelling. The container reads both.
RENAMED = {"HF_MODEL_ID": "OPTION_MODEL_ID", "HF_TASK": "OPTION_TASK",
           "TENSOR_PARALLEL_DEGREE": "OPTION_TENSOR_PARALLEL_DEGREE"}
# DJLModel writes OPTION_ENGINE=Python whenever engine= is not given (OnnxRuntime for the
# text-embedding task: a DJL Java engine sagelmi does not have). sagelmi leaves it to the
# container, which picks Python (MPI mode only when asked for, for a model.py).
DJL_ONLY_UNLESS_GIVEN = {"OPTION_ENGINE"}
# DJLModel writes a bool as Python's str(True); sagelmi as the container's true/false. Both parse alike.
BOOLEANS = {"OPTION_PARALLEL_LOADING"}

ISSUE_EXAMPLE = dict(task="text-generation", min_workers=1, job_queue_size=100, model_loading_timeout=900,
                     prediction_timeout=60)
EVERY_SHARED_ARGUMENT = dict(ISSUE_EXAMPLE, engine="Python", dtype="fp16", tensor_parallel_degree=2, max_workers=2,
                             parallel_loading=True, huggingface_hub_token="hf_secret")


@pytest.fixture
def djl_session(aws):
    return sagemaker.Session(boto_session=aws)


def settings_of(env: dict) -> dict:
    """What the container resolves ``env`` to, without where each value came from (an
    ignored option's text is kept as given: a boolean's case is left out of the comparison)."""
    settings = resolve_settings(env, "/nonexistent").model_dump(exclude={"sources"})
    for name in BOOLEANS:
        option = name.removeprefix("OPTION_").lower()
        if option in settings["options"]:
            settings["options"][option] = settings["options"][option].lower()
    return settings


@pytest.mark.parametrize("arguments", [ISSUE_EXAMPLE, EVERY_SHARED_ARGUMENT], ids=["issue-example", "every-argument"])
def test_the_environment_is_djlmodels_for_the_same_arguments(djl_session, arguments, caplog):
    djl = DJLModel("org/model", image_uri=IMAGE, role=ROLE, sagemaker_session=djl_session, **arguments).env
    ours = SagelmiModel("org/model", image_uri=IMAGE, role=ROLE, **arguments).env
    assert djl and ours
    expected_keys = set()
    for key, value in djl.items():
        if key in DJL_ONLY_UNLESS_GIVEN and "engine" not in arguments:
            assert key not in ours
            continue
        name = RENAMED.get(key, key)
        expected_keys.add(name)
        if key in BOOLEANS:
            assert (value, ours[name]) == ("True", "true"), key
        else:
            assert ours[name] == value, key
    assert set(ours) == expected_keys  # nothing more than DJLModel writes
    # The container reads both environments as the same settings.
    assert settings_of(ours) == settings_of(djl)
    if arguments.get("parallel_loading"):  # the container loads each group on its own; said once, as it says it
        assert "option.parallel_loading is ignored" in caplog.text


def test_model_id_is_the_first_positional_argument_as_in_djlmodel():
    assert list(inspect.signature(SagelmiModel).parameters)[0] == list(inspect.signature(DJLModel).parameters)[0]
    assert SagelmiModel("org/model").settings.model_id == "org/model"
    with pytest.raises(TypeError):
        SagelmiModel("org/model", "Python")  # the rest are keywords: a second positional is a mistake here


@pytest.mark.parametrize("arguments, message", [
    ({"engine": "OnnxRuntime"}, "invalid setting engine='OnnxRuntime' (from env OPTION_ENGINE): Input should be "
                                "'Python' or 'MPI'"),
    ({"job_queue_size": 0}, "invalid setting job_queue_size='0'"),
    ({"prediction_timeout": -1}, "invalid setting option.predict_timeout='-1'"),
    ({"min_workers": "two"}, "invalid setting min_workers='two'"),
])
def test_djlmodel_arguments_the_container_refuses_are_refused_here(arguments, message):
    with pytest.raises(SettingsError) as refused:
        SagelmiModel("org/model", **arguments)
    assert message in str(refused.value)


def test_the_hub_token_is_hf_token():
    assert SagelmiModel("org/model", huggingface_hub_token="hf_a").env["HF_TOKEN"] == "hf_a"
    assert SagelmiModel("org/model", huggingface_hub_token="hf_a", env={"HF_TOKEN": "hf_a"}).env["HF_TOKEN"] == "hf_a"
    with pytest.raises(ValueError, match="HF_TOKEN is given twice"):
        SagelmiModel("org/model", huggingface_hub_token="hf_a", env={"HF_TOKEN": "hf_b"})


def test_a_setting_given_as_argument_and_in_env_is_refused_where_djlmodel_keeps_envs(djl_session):
    assert DJLModel("org/model", job_queue_size=5, env={"SERVING_JOB_QUEUE_SIZE": "7"}, image_uri=IMAGE,
                    sagemaker_session=djl_session).env["SERVING_JOB_QUEUE_SIZE"] == "7"  # the argument is dropped
    with pytest.raises(SettingsError, match="job_queue_size is given twice: '5' here and '7' as env "
                                            "SERVING_JOB_QUEUE_SIZE"):
        SagelmiModel("org/model", job_queue_size=5, env={"SERVING_JOB_QUEUE_SIZE": "7"})


@pytest.mark.parametrize("name", ["djl_version", "djl_framework"])
def test_djlmodels_image_choice_points_to_image_uri(name):
    with pytest.raises(TypeError, match=f"SagelmiModel takes no {name}=: .*image_uri="):
        SagelmiModel("org/model", **{name: "0.30.0"})
