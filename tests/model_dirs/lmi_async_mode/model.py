"""An async-mode handler in LMI's style: ``async def handle`` answering with
``djl_python.async_utils`` outputs, and a stream as an async generator of them."""

import asyncio

from djl_python import Input
from djl_python.async_utils import create_non_stream_output, create_stream_chunk_output


async def _chunks(words, fail_at):
    for i, word in enumerate(words):
        await asyncio.sleep(0.01)
        if i == fail_at:
            yield create_stream_chunk_output("", True, error=f"cannot say {word!r}", code=424)
            return
        yield create_stream_chunk_output({"token": word}, last_chunk=i == len(words) - 1)


async def handle(inputs: Input):
    if inputs.is_empty():
        return None
    body = inputs.get_as_json()
    if body.get("error"):
        return create_non_stream_output("", error=body["error"], code=400)
    if body.get("stream"):
        return _chunks(body["inputs"].split(), body.get("fail_at", -1))
    return create_non_stream_output({"generated_text": body["inputs"].upper()})
