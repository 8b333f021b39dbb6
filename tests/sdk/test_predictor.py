"""SagelmiPredictor keeps the sagemaker Predictor's signature: its second argument is
initial_args (invoke_endpoint's arguments), generation parameters are keywords. That
the request options reach an endpoint: tests/sdk/test_local.py (a real server) and
tests/sdk/test_streaming.py (boto3's runtime client)."""

import inspect

import pytest
from sagemaker.predictor import Predictor

from sagemaker_sdk import SagelmiPredictor


@pytest.mark.parametrize("method", ["predict", "predict_stream"])
def test_the_predictor_keeps_the_sagemaker_predictors_arguments_in_order(method):
    base = list(inspect.signature(getattr(Predictor, method)).parameters.values())
    ours = list(inspect.signature(getattr(SagelmiPredictor, method)).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[:len(base)]] == [(p.name, p.kind, p.default) for p in base]
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in ours[len(base):])  # ours: keywords only


def test_generation_parameters_in_initial_args_are_refused_before_any_call():
    predictor = SagelmiPredictor("nowhere", sagemaker_session=object())  # a call would fail on this session
    with pytest.raises(TypeError, match="initial_args are invoke_endpoint's arguments .*not max_new_tokens, "
                                        "temperature: give generation parameters as parameters="):
        predictor.predict("hello", {"max_new_tokens": 8, "temperature": 0.5})
    with pytest.raises(TypeError, match="not max_new_tokens"):
        predictor.predict_stream("hello", {"max_new_tokens": 8})
    with pytest.raises(TypeError, match="initial_args must be a dict"):
        predictor.predict("hello", "application/json")
