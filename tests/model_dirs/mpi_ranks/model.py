"""An async handler that records, on every rank, what reached it and in which
order, into the directory named by option.record_dir:

  <record_dir>/<pid>.json    the rank's environment, written at initialisation
  <record_dir>/<pid>.log     one line per request start ("start <id>"), cancel
                             ("cancel <id>") and end ("end <id>")

Bodies: {"sleep": s} sleeps; {"stream": n} streams n items; {"fail_on_rank": r}
(in option.fail_init_on_rank) makes initialisation fail on that rank.
Answers carry the answering rank, so a test can see whose answer came back.
"""

import asyncio
import json
import os
from pathlib import Path

from djl_python import Input, Output

record = None
rank = int(os.environ.get("RANK", 0))


def _write(line: str) -> None:
    with open(record / f"{os.getpid()}.log", "a") as f:
        f.write(line + "\n")


async def _stream(request_id: str, count: int):
    for i in range(count):
        await asyncio.sleep(0.01)
        yield {"item": i, "rank": rank}
    _write(f"end {request_id}")


async def handle(inputs: Input):
    global record
    if inputs.is_empty():
        properties = inputs.get_properties()
        if properties.get("fail_init_on_rank") == str(rank):
            raise RuntimeError(f"rank {rank} refuses to start (fail_init_on_rank)")
        record = Path(properties["record_dir"])
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
        (record / f"{os.getpid()}.json").write_text(json.dumps({n: os.environ.get(n) for n in names}))
        return None
    request_id = inputs.get_property("x-amzn-sagemaker-inference-id")
    body = inputs.get_as_json()
    _write(f"start {request_id}")
    if "stream" in body:
        return Output().add_stream_content(_stream(request_id, int(body["stream"])))
    try:
        await asyncio.sleep(float(body.get("sleep", 0)))
    except asyncio.CancelledError:
        _write(f"cancel {request_id}")
        raise
    _write(f"end {request_id}")
    return Output().add_as_json({"rank": rank, "pid": os.getpid()})
