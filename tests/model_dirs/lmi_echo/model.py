"""An LMI-style handler, written as for LMI's djl_python: it must run unchanged.

Body fields drive the test cases: {"sleep": s} sleeps, {"fail": "msg"} raises,
{"error_output": "msg"} answers with Output.error(), {"attributes": "k=v"} sets
the response's custom attributes header; {"lines": [...], "gate": path} streams
the lines from a plain generator, waiting for the file at `gate` before the
last; {"lines_forever": path} streams until the client goes away, then writes
"closed" to path; {"open": path} reads a file (a missing one raises
FileNotFoundError), {"lines_then_open": [...], "path": path} streams the lines,
then reads the file; {"big_lines": {"count": n, "size": bytes, "every": s, "sse": bool}} streams
n lines of that size, one every s seconds (server-sent events with "sse").
"""

import logging
import os
import time

from djl_python import Input, Output

log = logging.getLogger(__name__)
model = None


def load_model(properties):
    log.info("loading with %s", sorted(properties))
    return {"properties": properties, "pid": os.getpid()}


def _lines(lines, gate):
    for line in lines[:-1]:
        yield line + "\n"
    while not os.path.exists(gate):
        time.sleep(0.02)
    yield lines[-1] + "\n"


def _forever(marker):
    try:
        n = 0
        while True:
            yield f"line {n}\n"
            n += 1
            time.sleep(0.05)
    finally:
        with open(marker, "w") as f:
            f.write("closed")


def _lines_then_open(lines, path):
    yield from (line + "\n" for line in lines)
    with open(path) as f:
        yield f.read()


def _big_lines(count, size, every, sse):
    for n in range(count):
        text = f"{n:08d}" + "x" * max(size - 8, 0)
        yield f"data: {{\"line\": \"{text}\"}}\n\n" if sse else text
        time.sleep(every)


def handle(inputs: Input):
    global model
    if model is None:
        model = load_model(inputs.get_properties())
    if inputs.is_empty():
        # Model server makes an empty call to warmup the model on startup
        return None

    data = inputs.get_as_json()
    if "lines" in data:
        return Output().add_stream_content(_lines(data["lines"], data["gate"]))
    if "big_lines" in data:
        spec = data["big_lines"]
        lines = _big_lines(spec["count"], spec["size"], spec["every"], spec.get("sse", False))
        if spec.get("sse"):
            return Output().add_property("content-type", "text/event-stream").add_stream_content(lines, None)
        return Output().add_stream_content(lines)
    if "lines_forever" in data:
        return Output().add_stream_content(_forever(data["lines_forever"]))
    if "lines_then_open" in data:
        return Output().add_stream_content(_lines_then_open(data["lines_then_open"], data["path"]))
    if "open" in data:
        with open(data["open"]) as f:
            data["read"] = f.read()
    if "sleep" in data:
        time.sleep(float(data["sleep"]))
    if "fail" in data:
        raise RuntimeError(data["fail"])
    outputs = Output()
    if "error_output" in data:
        return outputs.error(data["error_output"])
    if "attributes" in data:
        outputs.add_property("X-Amzn-SageMaker-Custom-Attributes", data["attributes"])
    outputs.add_as_json({
        "echo": data,
        "properties": inputs.get_properties(),
        "model_properties": model["properties"],
        "pid": model["pid"],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    })
    return outputs
