"""SagelmiPredictor keeps the sagemaker 2.x Predictor's signature on both SDK majors: its second
argument is initial_args (invoke_endpoint's arguments), generation parameters are keywords. That
the request options reach an endpoint: tests/sdk/test_local.py (a real server) and
tests/sdk/test_streaming.py (boto3's runtime client). Runs under both majors
(tests/sdk/test_other_major.py runs it in the other one)."""

import inspect

import pytest

from sagemaker_sdk import SDK_MAJOR, SagelmiPredictor

# sagemaker 2.x's Predictor.predict and predict_stream (compared with the class itself on 2.x)
PREDICTOR_2X = {
    "predict": [("self", None), ("data", None), ("initial_args", None), ("target_model", None),
                ("target_variant", None), ("inference_id", None), ("custom_attributes", None),
                ("component_name", None)],
    "predict_stream": [("self", None), ("data", None), ("initial_args", None), ("target_variant", None),
                       ("inference_id", None), ("custom_attributes", None), ("component_name", None),
                       ("target_container_hostname", None), ("iterator", "ByteIterator")],
}


def _parameters(function) -> list:
    return list(inspect.signature(function).parameters.values())


def _named(parameter) -> tuple:
    default = parameter.default
    return parameter.name, (None if default is inspect.Parameter.empty else
                            default.__name__ if inspect.isclass(default) else default)


@pytest.mark.parametrize("method", ["predict", "predict_stream"])
def test_the_predictor_keeps_the_sagemaker_predictors_arguments_in_order(method):
    expected = PREDICTOR_2X[method]
    ours = _parameters(getattr(SagelmiPredictor, method))
    assert [_named(p) for p in ours[:len(expected)]] == expected
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in ours[:len(expected)])
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in ours[len(expected):])  # ours: keywords only
    if SDK_MAJOR == 2:
        from sagemaker.predictor import Predictor

        assert [_named(p) for p in _parameters(getattr(Predictor, method))] == expected


def test_generation_parameters_in_initial_args_are_refused_before_any_call():
    predictor = SagelmiPredictor("nowhere", sagemaker_session=object())  # a call would fail on this session
    with pytest.raises(TypeError, match="initial_args are invoke_endpoint's arguments .*not max_new_tokens, "
                                        "temperature: give generation parameters as parameters="):
        predictor.predict("hello", {"max_new_tokens": 8, "temperature": 0.5})
    with pytest.raises(TypeError, match="not max_new_tokens"):
        predictor.predict_stream("hello", {"max_new_tokens": 8})
    with pytest.raises(TypeError, match="initial_args must be a dict"):
        predictor.predict("hello", "application/json")
