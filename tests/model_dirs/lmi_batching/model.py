"""A dynamic-batching handler in LMI's style: one call gets up to batch_size
requests (serving.properties), answered item by item with batch_index. Each
answer reports the size of the batch it came in; an item asking to fail fails
alone. With option.record_dir, each rank (MPI mode) appends the ids of every batch
it handles to <record_dir>/rank-<RANK>.batches."""

import json
import os
import time

from djl_python import Input, Output

record = None


def handle(inputs: Input):
    global record
    if inputs.is_empty():
        if inputs.get_properties().get("record_dir"):
            record = os.path.join(inputs.get_properties()["record_dir"], f"rank-{os.environ.get('RANK', '0')}.batches")
        return None
    batch = inputs.get_batches()
    if record is not None:
        with open(record, "a") as f:
            f.write(json.dumps([item.get_as_json()["id"] for item in batch]) + "\n")
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
