"""A model.py that wraps LMI's default handler (djl_python.huggingface), as many
LMI examples do, adding a response header."""

from djl_python import Input
from djl_python.huggingface import HuggingFaceService

_service = HuggingFaceService()


def handle(inputs: Input):
    if not _service.initialized:
        _service.initialize(inputs.get_properties())
    if inputs.is_empty():
        return None
    outputs = _service.inference(inputs)
    outputs.add_property("X-Wrapped-By", "model.py")
    return outputs
