"""The rank relay's start-up (container/worker/ranks.py), with real sockets in this process: the
followers prove they belong to the job without sending its token, a silent, wrong or broken
connection never holds up or fails the group's start, and rank 0 listens on one address."""

import socket
import threading
import time

import pytest

from container.core.cluster import HANDSHAKE_TIMEOUT
from container.core.protocol import Invoke
from container.worker.ranks import Follower, Leader, RankInfo
from tests.server import NoDescriptorsLeft


def _group(world_size: int) -> tuple[Leader, list[RankInfo]]:
    listener = socket.create_server(("127.0.0.1", 0))
    infos = [RankInfo(rank=r, world_size=world_size, local_rank=r, master_addr="127.0.0.1", master_port=1,
                      relay_port=listener.getsockname()[1], token=b"t" * 32) for r in range(world_size)]
    return Leader(infos[0], listener), infos


def _accept_in_background(leader: Leader, **kwargs) -> tuple[threading.Thread, list]:
    outcome: list = []

    def run():
        try:
            leader.accept_followers(**kwargs)
            outcome.append("connected")
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_silent_a_wrong_and_a_garbage_connection_do_not_hold_up_the_group_start():
    leader, infos = _group(3)
    thread, outcome = _accept_in_background(leader)
    address = ("127.0.0.1", infos[0].relay_port)
    silent = socket.create_connection(address)  # connects, never says a word
    garbage = socket.create_connection(address)
    garbage.sendall(b"\x00" * 200)
    impostor = Follower(RankInfo(**{**infos[1].__dict__, "token": b"x" * 32}))  # another job's token
    with pytest.raises(Exception, match="the cluster secrets differ"):
        impostor.connect()
    started = time.monotonic()
    for info in infos[1:]:
        Follower(info).connect()
    thread.join(HANDSHAKE_TIMEOUT - 2)
    assert outcome == ["connected"], outcome
    assert time.monotonic() - started < 2  # not after the silent connection's deadline
    assert sorted(leader.states) == [1, 2]
    silent.close()
    garbage.close()


def test_a_failed_accept_does_not_fail_the_group_start(caplog):
    leader, infos = _group(2)
    thread, outcome = _accept_in_background(leader)
    victims = [socket.socket() for _ in range(5)]  # made while descriptors are left
    with NoDescriptorsLeft() as descriptors:
        # rank 0's accept() gets EMFILE. Another thread of this process (a server of an earlier
        # test shutting down) may free a descriptor just before it, and rank 0 then refuses that
        # connection instead; the next victim tries again.
        for victim in victims:
            victim.connect(("127.0.0.1", infos[0].relay_port))
            if _wait_for_log(caplog, "relay: accepting a connection failed ([Errno 24] Too many open files)",
                             descriptors):
                break
        else:
            raise AssertionError(caplog.text)
    for victim in victims:
        victim.close()
    Follower(infos[1]).connect()
    thread.join(5)
    assert outcome == ["connected"], outcome


def _wait_for_log(caplog, text: str, descriptors: NoDescriptorsLeft, timeout: float = 5) -> bool:
    """Whether ``text`` was logged before the timeout or before rank 0 refused a connection."""
    deadline = time.monotonic() + timeout
    while text not in caplog.text:
        if "refused a relay connection" in caplog.text or time.monotonic() > deadline:
            caplog.clear()
            return False
        descriptors.take()  # any a closing connection of another thread gave back
        time.sleep(0.02)
    return True


class _Tap:
    """A TCP forwarder between a follower and rank 0 that keeps every byte the follower sends."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sent = bytearray()
        self.target = target
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(self.target)
        threading.Thread(target=self._pipe, args=(upstream, client, None), daemon=True).start()
        self._pipe(client, upstream, self.sent)

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, record: bytearray | None) -> None:
        while data := source.recv(65536):
            if record is not None:
                record += data
            sink.sendall(data)


def test_a_follower_proves_it_belongs_to_the_job_without_sending_the_token():
    leader, infos = _group(2)
    thread, outcome = _accept_in_background(leader)
    tap = _Tap(("127.0.0.1", infos[0].relay_port))
    follower = Follower(RankInfo(**{**infos[1].__dict__, "relay_port": tap.port}))
    follower.connect()
    thread.join(5)
    assert outcome == ["connected"]
    heard, got = [], []
    leader.on_change = lambda: heard.append(True)
    follower.on_message = got.append
    follower.send_status(leader.states[1])  # the relay works through the tap, both ways
    leader.send(Invoke(id="r1", properties={}, body=b"x"))
    deadline = time.monotonic() + 5
    while not (heard and got) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert heard and [m.id for m in got] == ["r1"]
    assert len(tap.sent) > 64 and infos[0].token not in bytes(tap.sent)


def test_a_connection_presenting_the_token_in_clear_is_refused():
    leader, infos = _group(2)
    thread, outcome = _accept_in_background(leader, timeout=2)
    with socket.create_connection(("127.0.0.1", infos[0].relay_port)) as sock:
        sock.sendall(infos[0].token[:16] + (1).to_bytes(4, "big"))  # a hello of the old relay
        thread.join(5)
    assert isinstance(outcome[0], RuntimeError) and "only 0 of 1 other ranks connected" in str(outcome[0])


def test_rank_0_listens_on_loopback_or_the_cluster_s_address_never_on_every_address(monkeypatch):
    from container.worker.ranks import relay_host

    assert relay_host(2, 2) == "127.0.0.1"  # every rank on rank 0's machine
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")  # what the supervisor sets in a cluster
    assert relay_host(1, 2) == "10.1.2.3"
