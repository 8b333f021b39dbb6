"""An async handler for cancellation and streaming tests.

{"sleep": s, "marker": path}         sleeps; writes "cancelled" to path if cancelled
{"stream": [...], "gate": path}      streams items; before the last one, waits for
                                     the file at `gate` to exist (the test creates it
                                     once it has received the first item)
{"stream_forever": path}             streams a line every 0.1 s until cancelled, then
                                     writes "cancelled" to path
{"stream_fail": msg}                 streams one item, then raises RuntimeError(msg)
"""

import asyncio
import os

from djl_python import Input, Output


async def _wait_for(path):
    while not os.path.exists(path):
        await asyncio.sleep(0.02)


async def _stream(items, gate):
    for item in items[:-1]:
        yield {"item": item}
    await _wait_for(gate)
    yield {"item": items[-1]}


async def _forever(marker):
    try:
        n = 0
        while True:
            yield {"n": n}
            n += 1
            await asyncio.sleep(0.1)
    except (asyncio.CancelledError, GeneratorExit):
        with open(marker, "w") as f:
            f.write("cancelled")
        raise


async def _fail_after_one(message):
    yield {"item": "first"}
    raise RuntimeError(message)


async def handle(inputs: Input):
    if inputs.is_empty():
        return None
    data = inputs.get_as_json()
    if "stream" in data:
        return Output().add_stream_content(_stream(data["stream"], data["gate"]))
    if "stream_fail" in data:
        return Output().add_stream_content(_fail_after_one(data["stream_fail"]))
    if "stream_forever" in data:
        return Output().add_stream_content(_forever(data["stream_forever"]))
    try:
        await asyncio.sleep(float(data.get("sleep", 0)))
    except asyncio.CancelledError:
        with open(data["marker"], "w") as f:
            f.write("cancelled")
        raise
    return Output().add_as_json({"slept": data.get("sleep", 0)})
