"""An inference-toolkit script of sagelmi's own (not a public example): only model_fn, taking the
context as the toolkit passes it, so that the default input_fn, predict_fn and output_fn serve
(JSON, CSV and NPY), as the PyTorch toolkit's defaults run a torch module."""

import torch


class Doubler(torch.nn.Module):
    def forward(self, x):
        return x * 2 + 1


def model_fn(model_dir, context):
    assert context.system_properties["model_dir"] == model_dir
    return Doubler()
