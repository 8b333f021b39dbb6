"""A streaming handler: an async generator yields one JSON line per word.

Try it:  sagelmi serve --model-dir examples/streaming --port 8080
         curl -sN localhost:8080/invocations -d '{"inputs": "one two three", "delay": 0.2}'
"""

import asyncio

from djl_python import Input


async def handle(inputs: Input):
    if inputs.is_empty():  # initialisation call: nothing to load
        return
    request = inputs.get_as_json()
    delay = float(request.get("delay", 0.05))
    words = str(request.get("inputs", "")).split()
    for index, word in enumerate(words):
        await asyncio.sleep(delay)
        yield {"index": index, "token": word}
    yield {"generated_text": " ".join(words)}
