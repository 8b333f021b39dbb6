# Public source: https://github.com/deepjavalibrary/djl-demo/blob/8f704af8e23d415fa3d676ae902c81e675b7b789/aws/sagemaker/large-model-inference/sample-llm/vllm_rollingbatch_deploy_customized_processing.ipynb
# (its model.py cell). Adapted where it fails on LMI too: LMI calls an input formatter as
# fn(input_item, **kwargs), so the notebook's extra first parameter `self` is dropped; its
# @output_formatter takes the rolling-batch TextGenerationOutput, which LMI's vLLM service (what
# option.rolling_batch=vllm runs now) no longer passes, so it is left out.
from djl_python.huggingface import HuggingFaceService
from djl_python.inputs import Input
from djl_python.outputs import Output
from djl_python.encode_decode import encode, decode
from djl_python.input_parser import input_formatter
from djl_python.request_io import TextInput
import logging
import json
import types

_service = HuggingFaceService()

@input_formatter
def custom_input_formatter(input_item: Input, **kwargs) -> TextInput:
    """
    Replace this function with your custom input formatter.
        
    Args:
        data (obj): The request data, dict or string  

    Returns:
        (tuple): input_data (list), input_size (list), parameters (dict), errors (dict), batch (list)
    """
    content_type = input_item.get_property("Content-Type")
    input_map = decode(input_item, content_type)
    
    request_input = TextInput()
    request_input.input_text = input_map.pop("prompt", input_map)
    request_input.parameters = input_map.pop("parameters", {})
    
    return request_input
