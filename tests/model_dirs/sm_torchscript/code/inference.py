"""An inference-toolkit script of sagelmi's own (not a public example): no model_fn, so the model is
the directory's model.pt, loaded as TorchScript as the PyTorch toolkit's default model_fn loads it;
the default predict_fn calls it and the default output_fn encodes the answer for the Accept type."""

import json

import torch


def input_fn(request_body, request_content_type):
    return torch.tensor(json.loads(request_body)["inputs"], dtype=torch.float32)
