"""Real streamed answers, and cutting them into SageMaker PayloadParts."""

import json
import random

import requests
from sagemaker_sdk import parse_stream
from sagemaker_sdk.sdk_major import ByteIterator

MULTI_BYTE = "☃".encode()  # three bytes; the test handler's answers hold it and other multi-byte characters


def capture(port: int, body) -> bytes:
    """The bytes of a real streamed answer from the server on ``port``."""
    response = requests.post(f"http://127.0.0.1:{port}/invocations", json=body, stream=True, timeout=120)
    assert response.status_code == 200, response.text
    return response.content


def json_lines(raw: bytes) -> list:
    return [json.loads(line) for line in raw.decode().splitlines() if line]


def sse_events(raw: bytes) -> list:
    return [json.loads(line[len("data: "):]) for line in raw.decode().split("\n")
            if line.startswith("data: ") and line != "data: [DONE]"]


def sagemaker_items(pieces: list[bytes]) -> list:
    """The items predict_stream reads from PayloadParts holding ``pieces`` (through the sagemaker SDK's ByteIterator)."""
    return list(parse_stream(ByteIterator([{"PayloadPart": {"Bytes": piece}} for piece in pieces])))


def assert_every_cut_gives(raw: bytes, expected: list, multi_byte: bytes = MULTI_BYTE) -> None:
    """``raw`` cut into PayloadParts in every way below parses to ``expected``."""
    assert multi_byte in raw  # some cuts below fall inside a multi-byte character
    for offset in range(len(raw) + 1):
        assert sagemaker_items([raw[:offset], raw[offset:]]) == expected, f"cut at byte {offset}"
    assert sagemaker_items([raw[i:i + 1] for i in range(len(raw))]) == expected
    rng = random.Random(8)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(raw)), rng.randint(2, 40)))
        pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]
        assert sagemaker_items(pieces) == expected, f"cuts at {cuts}"
