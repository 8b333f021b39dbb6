"""Takes option.init_seconds to initialise (LMI style)."""

import time

from djl_python import Input, Output

ready = False


def handle(inputs: Input):
    global ready
    if not ready:
        time.sleep(float(inputs.get_properties().get("init_seconds", "5")))
        ready = True
    if inputs.is_empty():
        return None
    return Output().add_as_json({"ready": True})
