import pytest

from container.core.served_names import served_names
from container.core.settings import resolve_settings
from container.supervisor import model_info
from handlers.engines.vllm_args import build_engine_kwargs


def settings_of(**options):
    return resolve_settings({f"OPTION_{k.upper()}": str(v) for k, v in options.items()}, "/opt/ml/model")


# (options, where the model is, the engine's name (/v1), LMI's name (GET /models))
CASES = [
    ({}, "/opt/ml/model", "model", "model"),
    ({"model_id": "org/llama"}, "org/llama", "org/llama", "llama"),
    ({"model_id": "llama"}, "llama", "llama", "llama"),
    ({"model_id": "s3://bucket/models/llama-3/"}, "/root/.cache/sagelmi/s3/abc", "llama-3", "llama-3"),
    ({"model_id": "/models/tiny/"}, "/models/tiny/", "tiny", "tiny"),
    ({"model_id": "org/llama", "served_model_name": "my-llm"}, "org/llama", "my-llm", "my-llm"),
]


@pytest.mark.parametrize("options,location,engine,management", CASES)
def test_one_function_names_the_model_for_v1_and_for_models(options, location, engine, management):
    settings = settings_of(**options)
    assert served_names(settings, location) == (engine, management)
    # the two callers take their names from it: vLLM's engine arguments and GET /models
    assert build_engine_kwargs(settings, location, 1)["served_model_name"] == engine
    assert model_info(settings).name == management
