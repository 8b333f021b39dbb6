# In the shape of djl-demo's customized-processing notebook for LMI's vLLM rolling batch
# (deepjavalibrary/djl-demo, aws/sagemaker/large-model-inference/sample-llm/
# vllm_rollingbatch_deploy_customized_processing.ipynb at 8f704af, its model.py cell), with its
# logic kept as it is there: no handle(); an @input_formatter written as a method (a first
# parameter `self`) that takes the request's Input and reads "prompt"; an @output_formatter
# that takes the rolling-batch TextGenerationOutput, unpacks get_next_token() into three names
# (djl_python 0.28-0.31) and writes one JSON line per token, the last with finish_reason.
import json
import logging
import types

from djl_python.encode_decode import decode, encode
from djl_python.huggingface import HuggingFaceService
from djl_python.input_parser import input_formatter
from djl_python.inputs import Input
from djl_python.output_formatter import TextGenerationOutput, output_formatter
from djl_python.outputs import Output
from djl_python.request_io import TextInput

_service = HuggingFaceService()


@output_formatter
def custom_output_formatter(request_output: TextGenerationOutput) -> str:
    """One line per generated token: its id, text and log probability; the finish reason on
    the last one."""
    sequence = request_output.sequences[request_output.best_sequence_index]
    token, is_first, is_last = sequence.get_next_token()
    line = {"token_id": token.id, "token_text": token.text, "token_log_prob": token.log_prob}
    if is_last:
        line["finish_reason"] = sequence.finish_reason
    return json.dumps(line) + "\n"


@input_formatter
def custom_input_formatter(self, input_item: Input, **kwargs) -> TextInput:
    """The request's "prompt" and "parameters" (in place of LMI's "inputs")."""
    payload = decode(input_item, input_item.get_property("Content-Type"))
    request = TextInput()
    request.input_text = payload.pop("prompt", payload)
    request.parameters = payload.pop("parameters", {})
    return request
