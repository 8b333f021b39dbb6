"""A dynamic-batching handler in LMI's style: one call gets up to batch_size
requests (serving.properties), answered item by item with batch_index. Each
answer reports the size of the batch it came in; an item asking to fail fails
alone."""

import time

from djl_python import Input, Output

batch_sizes = []


def handle(inputs: Input):
    if inputs.is_empty():
        return None
    batch = inputs.get_batches()
    batch_sizes.append(len(batch))
    time.sleep(0.2)  # a model call: more requests arrive meanwhile
    outputs = Output()
    for i, item in enumerate(batch):
        request = item.get_as_json()
        if request.get("fail"):
            outputs.error(f"item {request['id']} cannot be answered", batch_index=i)
            continue
        outputs.add_as_json({"id": request["id"], "batch_size": len(batch), "is_batch": inputs.is_batch(),
                             "request_id": item.get_property("requestId")}, batch_index=i)
    return outputs
