"""An inference-toolkit script of sagelmi's own (not a public example): no model_fn, so the model is
a transformers pipeline for HF_TASK, as the Hugging Face toolkit builds it; the default input_fn and
predict_fn (the pipeline called with inputs and parameters) serve, this output_fn wraps the answer."""

import json


def output_fn(prediction, accept):
    return json.dumps({"predictions": prediction}), "application/json"
