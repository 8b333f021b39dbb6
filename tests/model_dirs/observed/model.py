"""An async handler for the observability tests (tests/integration/test_observability.py).

{"stream": [...], "gate": path, "tokens": [p, c]}   streams items; before the last one waits
                                                     for the file at `gate`; reports p prompt
                                                     and c completion tokens
{"forever": true}                                    streams a line every 0.1 s until cancelled
{"say": text}                                        logs `text` (INFO) and answers it
"""

import asyncio
import logging
import os

from djl_python import Input, Output
from handlers.api.usage import count_tokens

log = logging.getLogger("observed_model")


async def _stream(items, gate, tokens):
    for item in items[:-1]:
        yield {"item": item}
    while not os.path.exists(gate):
        await asyncio.sleep(0.02)
    count_tokens(prompt=tokens[0], completion=tokens[1])
    yield {"item": items[-1]}


async def _forever():
    n = 0
    while True:
        yield {"n": n}
        n += 1
        await asyncio.sleep(0.1)


async def handle(inputs: Input):
    if inputs.is_empty():
        return None
    data = inputs.get_as_json()
    if "stream" in data:
        return Output().add_stream_content(_stream(data["stream"], data["gate"], data.get("tokens", [0, 0])))
    if "forever" in data:
        return Output().add_stream_content(_forever())
    log.info("saying %s", data["say"])
    return Output().add_as_json({"said": data["say"]})
