"""The relay benchmark's handler (``benchmarks/relay.py``): streams pre-made tokens, no engine.

Each request's body is ``{"tokens": N, "stream": true}``; the answer is N JSON lines of the size of an LMI
token line, as fast as the event loop allows (one item per stream per loop pass, as an engine
step hands every running stream one token). The minimal servers the benchmark compares
sagelmi with import this file and serve the same items.
"""

import asyncio
import json

from djl_python import Input, Output

ITEM = b'{"token": {"id": 7592, "text": " sea", "log_prob": -0.25}, "generated_text": null}\n'
MARKER = b'"token"'  # once per item: what the benchmark's client counts


async def tokens(count: int):
    for _ in range(count):
        yield ITEM
        await asyncio.sleep(0)  # one item per loop pass: the other streams get theirs too


def sync_tokens(count: int):
    """The same items for a server without an event loop (gunicorn + Flask)."""
    for _ in range(count):
        yield ITEM


def token_count(body: bytes) -> int:
    return int(json.loads(body or b"{}").get("tokens", 256))


async def handle(inputs: Input):
    if inputs.is_empty():  # the initialisation call
        return None
    return (Output().add_property("content-type", "application/jsonlines")
            .add_stream_content(tokens(token_count(inputs.get_as_bytes())), output_formatter=None))
