"""An LMI-style handler: echoes the JSON it receives, with what the server told it.

Try it:  sagelmi serve --model-dir examples/echo --port 8080
         curl -s localhost:8080/invocations -H 'Content-Type: application/json' -d '{"inputs": "hi"}'
"""

import logging

from djl_python import Input, Output

log = logging.getLogger(__name__)
properties = None


def handle(inputs: Input) -> Output:
    global properties
    if properties is None:  # the initialisation call: model properties, no content
        properties = inputs.get_properties()
        log.info("echo handler initialised for %s", properties.get("model_dir"))
    if inputs.is_empty():
        return None
    request = inputs.get_as_json()
    return Output().add_as_json({
        "echo": request,
        "request_id": inputs.get_property("X-Amzn-SageMaker-Inference-Id"),
        "model_dir": properties.get("model_dir"),
    })
