import json
import socket
import threading
import typing

import msgspec
import pytest

from container.core.launch import WorkerLaunch, decode_worker_launch, encode_launch
from container.core.protocol import (
    FRAME_HEADER,
    Attach,
    Cancel,
    Chunk,
    End,
    Fail,
    FrameBuffer,
    Head,
    Invoke,
    InvokeBatch,
    Message,
    ProtocolError,
    ResponseHead,
    SetAdapter,
    Status,
    Taken,
    WorkerState,
    decode,
    encode,
    progress,
)
from container.core.settings import Settings

MESSAGES = [
    Invoke(id="r1", properties={"content-type": "application/json"}, body=b'{"a": 1}'),
    Cancel(id="r1"),
    Head(id="r1", code=200, headers={"content-type": "text/plain"}, stream=True),
    Chunk(id="r1", data=b"\x00\xffbytes"),
    End(id="r1"),
    Fail(id="r1", code=424, message="invoke handler failure", error="boom"),
    Status(state=WorkerState.READY, detail="", incarnation=3, rank=1),
    InvokeBatch(items=[Invoke(id="r2", properties={}, body=b"{}")]),
    Attach(id="r1"),
    Attach(id="r3", head=ResponseHead("HTTP/1.1", "sagelmi", False, {"x-group": "0"}), max_body=1 << 20),
    Taken(id="r3", request_id="abc", path="/invocations", fingerprint="f00d"),
    End(id="r3", completion_tokens=3, body_bytes=9, code=200, outcome="completed", close=True),
    Head(id="r3", code=404, headers={}, stream=False, written=True),
    progress("r1"),
    SetAdapter(id="a1", name="fr", path="/tmp/fr"),
    SetAdapter(id="a2", name="fr"),
]


def test_the_wire_has_at_most_twelve_kinds_and_each_is_exercised_here():
    """One struct per kind of conversation: a variant is a field (an End's outcome, a Head rank 0
    writes itself, an Attach's head, an empty Chunk), not another kind."""
    kinds = set(typing.get_args(Message))
    assert len(kinds) <= 12, sorted(kind.__name__ for kind in kinds)
    assert kinds == {type(message) for message in MESSAGES}


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_each_message_round_trips_with_its_type(message):
    frame = encode(message)
    (length,) = FRAME_HEADER.unpack(frame[:4])
    assert length == len(frame) - 4
    assert decode(frame[4:]) == message


def read_all(sock: socket.socket) -> list:
    frames, got = FrameBuffer(), []
    while data := sock.recv(7):  # small reads: frames split anywhere
        got += frames.feed(data)
    if frames.pending_bytes:
        raise ProtocolError("truncated")
    return got


def test_frames_are_read_back_in_order_from_a_socket():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"".join(encode(m) for m in MESSAGES))
        a.shutdown(socket.SHUT_WR)
        assert read_all(b) == MESSAGES


def test_frames_split_across_many_small_writes_are_reassembled():
    a, b = socket.socketpair()
    data = b"".join(encode(m) for m in MESSAGES)

    def trickle():
        for i in range(0, len(data), 3):
            a.sendall(data[i:i + 3])
        a.shutdown(socket.SHUT_WR)

    writer = threading.Thread(target=trickle)
    writer.start()
    with a, b:
        got = read_all(b)
    writer.join()
    assert got == MESSAGES


def test_one_feed_returns_every_complete_frame_and_keeps_the_rest():
    frames = FrameBuffer()
    data = encode(End(id="a")) + encode(End(id="b"))
    assert frames.feed(data + data[:5]) == [End(id="a"), End(id="b")]
    assert frames.pending_bytes == 5
    assert frames.feed(data[5:]) == [End(id="a"), End(id="b")]
    assert frames.pending_bytes == 0


def test_truncated_and_garbage_frames_are_protocol_errors():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(encode(End(id="x"))[:-1])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError):
            read_all(b)
    with pytest.raises(ProtocolError):
        decode(b"\x93not a message")
    with pytest.raises(ProtocolError, match="exceeds"):
        FrameBuffer().feed(FRAME_HEADER.pack(2 ** 31))


def test_worker_launch_round_trips_as_json_with_typed_settings():
    settings = Settings(model_dir="/m", rolling_batch="lmi-dist", tgi_compat=True, tensor_parallel_degree="max")
    launch = WorkerLaunch(group=1, socket_path="/tmp/s", ready_path="/tmp/r", settings=settings,
                          model_properties={"model_id": "x"}, model_location="/m", tensor_parallel_degree=4)
    data = encode_launch(launch)
    assert json.loads(data)["settings"]["tensor_parallel_degree"] == "max"  # an object, not JSON in a string
    again = decode_worker_launch(data)
    assert again == launch
    assert isinstance(again.settings, Settings) and again.settings == settings
    with pytest.raises(msgspec.ValidationError, match="tensor_parallel_degree"):
        decode_worker_launch(data.replace(b'"max"', b'"most"'))


def test_status_state_is_a_closed_set():
    frame = encode(Status(state=WorkerState.LOADING))
    assert decode(frame[4:]).state is WorkerState.LOADING
    with pytest.raises(ProtocolError):
        decode(frame[4:].replace(b"loading", b"sleepyy"))
