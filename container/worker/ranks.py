"""The ranks of an MPI worker group: start-up through MPI, then one ordered
relay from rank 0 (the leader) to every other rank (the followers).

Start-up (``bootstrap``): every rank initialises MPI (mpi4py); rank 0 reads the
group's launch file, opens the relay's TCP listener on the address the other
ranks reach it at (loopback when they all run on its machine), picks
``MASTER_ADDR`` / ``MASTER_PORT`` for ``torch.distributed`` and a random token,
and broadcasts all of it; then MPI is finalised. Nothing after start-up uses MPI: a rank blocked in
an MPI receive polls and burns a core for as long as it waits, while a rank
blocked on a socket costs nothing, and an idle model server waits most of the
time.

The relay: each follower connects to the leader's listener and proves it
belongs to the job: an HMAC challenge both ways keyed by the token
(``container.core.cluster.Channel``), so the token never crosses the
connection; then it says which rank it is in an authenticated message. Each
connection that has not proved itself gets ``HANDSHAKE_TIMEOUT`` seconds, in a
thread of its own, while the leader goes on accepting: a silent or wrong
connection is dropped and never holds up the group's start. The leader sends every ``Invoke`` and
``Cancel`` it receives down each follower connection in the order it received them, from one lock, so every
rank sees the same messages in the same order. Followers send their ``Status``
(loading, ready, failed) back. A connection that closes means its peer is gone:
the group cannot work without all its ranks, so the survivor exits and the
supervisor restarts the whole group.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from container.core.accepting import AcceptLoop
from container.core.cluster import HANDSHAKE_TIMEOUT, Channel, ClusterError
from container.core.protocol import (
    METRICS_PATH,
    Chunk,
    Fail,
    FrameBuffer,
    Invoke,
    Message,
    ProtocolError,
    Status,
    WorkerState,
    encode,
)

log = logging.getLogger("sagelmi.ranks")

ACCEPT_TIMEOUT = 120.0  # followers connect right after start-up; much longer means a broken job


@dataclass(frozen=True)
class RankInfo:
    """Who this process is in its group, and how the group's ranks meet."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    relay_port: int
    token: bytes = field(repr=False)

    def export(self) -> None:
        """Set the variables ``torch.distributed`` (``env://``) and vLLM read."""
        os.environ.update(
            {
                "RANK": str(self.rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port),
            }
        )


def _this_host_address() -> str:
    """An address of this machine other ranks can reach (the one its hostname resolves to)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def relay_host(local_size: int, size: int) -> str:
    """Where rank 0 listens for the relay: loopback when every rank runs on its machine, else the
    address of its machine the others reach (MASTER_ADDR if set, as the supervisor sets it in a
    cluster, else its hostname's), never every address."""
    if local_size == size:
        return "127.0.0.1"
    return os.environ.get("MASTER_ADDR") or _this_host_address()


def _local_rank(comm, MPI) -> tuple[int, int]:
    """This rank's index among the ranks of its machine, and their number: as Open MPI's launcher
    says (each node's daemon knows its own ranks), else by asking MPI which ranks share memory."""
    if "OMPI_COMM_WORLD_LOCAL_RANK" in os.environ and "OMPI_COMM_WORLD_LOCAL_SIZE" in os.environ:
        return int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]), int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"])
    on_this_machine = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return on_this_machine.Get_rank(), on_this_machine.Get_size()
    finally:
        on_this_machine.Free()


def bootstrap(launch_path: Path) -> tuple[RankInfo, bytes, socket.socket | None]:
    """Meet the other ranks through MPI. Returns this rank's ``RankInfo``, the
    launch file's bytes (read by rank 0, sent to all), and on rank 0 the relay's
    listening socket."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local_rank, local_size = _local_rank(comm, MPI)
    listener = shared = None
    if rank == 0:
        host = relay_host(local_size, size)
        try:
            listener = socket.create_server((host, 0))
        except OSError as exc:
            raise RuntimeError(f"rank 0 cannot listen for the other ranks on {host} (MASTER_ADDR): {exc}") from None
        shared = {
            "host": host,
            "relay_port": listener.getsockname()[1],
            "master_port": _free_port(host),
            "token": secrets.token_bytes(32),
            "launch": launch_path.read_bytes(),
        }
    shared = comm.bcast(shared, root=0)
    MPI.Finalize()
    info = RankInfo(
        rank=rank,
        world_size=size,
        local_rank=local_rank,
        master_addr=shared["host"],
        master_port=shared["master_port"],
        relay_port=shared["relay_port"],
        token=shared["token"],
    )
    return info, shared["launch"], listener


class _Peer:
    """One relay connection: framed writes under a lock, a reader thread."""

    def __init__(
        self, sock: socket.socket, name: str, on_message: Callable[[Message], None], on_closed: Callable[[], None]
    ) -> None:
        self.sock = sock
        self.name = name
        self._lock = threading.Lock()
        self._on_message = on_message
        self._on_closed = on_closed
        self._thread = threading.Thread(target=self._read, name=f"relay-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, frame: bytes) -> None:
        with self._lock:
            self.sock.sendall(frame)

    def _read(self) -> None:
        frames = FrameBuffer()
        try:
            while data := self.sock.recv(1 << 18):
                for message in frames.feed(data):
                    self._on_message(message)
        except (OSError, ProtocolError) as exc:
            log.debug("relay connection to %s broke: %s", self.name, exc)
        self._on_closed()


class Leader:
    """Rank 0's side of the relay: sends to every follower, hears their status."""

    def __init__(self, info: RankInfo, listener: socket.socket) -> None:
        self.info = info
        self.listener = listener
        self.peers: list[_Peer] = []
        self.states: dict[int, Status] = {}
        self._send_lock = threading.Lock()
        self._metrics: dict[str, dict[int, str]] = {}
        self._metrics_cond = threading.Condition()
        self.on_change: Callable[[], object] = lambda: None  # a follower's status changed (reader thread)
        self.on_lost: Callable[[int], object] = lambda rank: None  # a follower went away (reader thread)

    def accept_followers(self, timeout: float = ACCEPT_TIMEOUT) -> None:
        """Wait until every follower has connected and proved it belongs to the job (see the
        module's text); ``RuntimeError`` when some have not within ``timeout`` seconds."""
        others = self.info.world_size - 1
        joined: dict[int, socket.socket] = {}
        cond = threading.Condition()

        def admit(sock: socket.socket, address: tuple) -> None:
            try:
                channel = Channel.accept(sock, self.info.token)
                sock.settimeout(HANDSHAKE_TIMEOUT)
                hello = channel.receive() or {}
            except (ClusterError, OSError, ValueError) as exc:
                log.warning("refused a relay connection from %s: %s", address[0], exc)
                sock.close()
                return
            rank = hello.get("rank")
            with cond:
                if not isinstance(rank, int) or not 0 < rank <= others or rank in joined or len(joined) == others:
                    log.warning("refused a relay connection from %s: rank %r is not awaited", address[0], rank)
                    sock.close()
                    return
                joined[rank] = sock
                cond.notify_all()

        accepting = AcceptLoop(self.listener, admit, "relay").start()
        try:
            with cond:
                if not cond.wait_for(lambda: len(joined) == others, timeout):
                    raise RuntimeError(f"only {len(joined)} of {others} other ranks connected within {timeout:g}s")
        finally:
            accepting.close()
        for rank, sock in sorted(joined.items()):
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.states[rank] = Status(state=WorkerState.LOADING, rank=rank)
            self.peers.append(_Peer(sock, f"rank-{rank}", partial(self._heard, rank), partial(self._lost, rank)))
        for peer in self.peers:
            peer.start()
        log.info("all %d ranks of the group are connected", self.info.world_size)

    def _heard(self, rank: int, message: Message) -> None:
        if isinstance(message, Status):
            self.states[rank] = message
            self.on_change()
        elif isinstance(message, Chunk):  # a follower's metrics (protocol: its Prometheus text)
            with self._metrics_cond:
                if message.id in self._metrics:
                    self._metrics[message.id][rank] = message.data.decode()
                    self._metrics_cond.notify_all()
        else:
            log.warning("ignoring %s from rank %d", type(message).__name__, rank)

    def _lost(self, rank: int) -> None:
        self.on_lost(rank)

    def collect_metrics(self, timeout: float) -> dict[int, str]:
        """Every follower's Prometheus text, by rank (those that answer within ``timeout``)."""
        request_id = f"metrics-{uuid.uuid4().hex}"
        with self._metrics_cond:
            answers = self._metrics[request_id] = {}
        try:
            self.send(Invoke(id=request_id, properties={}, body=b"", path=METRICS_PATH))
            with self._metrics_cond:
                self._metrics_cond.wait_for(lambda: len(answers) == len(self.peers), timeout)
                return dict(answers)
        finally:
            with self._metrics_cond:
                self._metrics.pop(request_id, None)

    def send(self, message: Message) -> None:
        """Send ``message`` to every follower; messages keep the order of the calls."""
        frame = encode(message)
        with self._send_lock:
            for peer in self.peers:
                peer.send(frame)


class Follower:
    """A follower's side of the relay: hears rank 0's messages, reports its status."""

    def __init__(self, info: RankInfo) -> None:
        self.info = info
        self.on_message: Callable[[Message], object] = lambda message: None  # Invoke/Cancel (reader thread)
        self.on_lost: Callable[[], object] = lambda: None  # rank 0 went away (reader thread)
        self._peer: _Peer | None = None

    def connect(self) -> None:
        """Connect to rank 0 and prove this rank belongs to the job. Raises ``ClusterError`` when
        the listener is not this job's rank 0, ``OSError``."""
        sock = socket.create_connection((self.info.master_addr, self.info.relay_port), timeout=30)
        channel = Channel.connect(sock, self.info.token)
        channel.send({"rank": self.info.rank})
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peer = _Peer(sock, "rank-0", self._heard, self._closed)
        self._peer.start()

    def _heard(self, message: Message) -> None:
        self.on_message(message)

    def _closed(self) -> None:
        self.on_lost()

    def send_status(self, status: Status) -> None:
        self._send(status)

    def send_metrics(self, request_id: str, text: str) -> None:
        self._send(Chunk(id=request_id, data=text.encode()))

    def _send(self, message: Message) -> None:
        assert self._peer is not None, "connect() first"
        try:
            self._peer.send(encode(message))
        except OSError as exc:
            log.warning("could not send %s to rank 0: %s", type(message).__name__, exc)


class DroppedAnswers:
    """Where the answers of a rank other than 0 go: nowhere (rank 0's answer is the group's)."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task] = {}

    async def send(self, message: Message) -> None:
        if isinstance(message, Fail):
            log.warning("this rank's answer was an error (rank 0 answers the client): %s", message.error)

    def add_chunk(self, request_id: str, data: bytes) -> bool:
        return False

    def has_client(self, request_id: str) -> bool:
        return False

    def stop_reason(self, request_id: str) -> Exception | None:
        return None

    def answer_headers(self, request_id: str, code: int, headers: dict[str, str]) -> dict[str, str]:
        return headers

    def stopped(self, request_id: str) -> Exception | None:
        return None

    def held(self, request_id: str) -> bool:
        return False

    async def delivered(self, request_id: str) -> None:
        pass

    def open_client(self, request_id: str, code: int, headers: Mapping[str, str], length: int | None) -> None:
        pass

    async def end_client(
        self, request_id: str, error: Exception | None = None, tokens: tuple[int | None, int | None] = (None, None)
    ) -> None:
        pass

    def release_client(self, request_id: str) -> bool:
        return False

    def drop_client(self, request_id: str) -> None:
        pass

    async def wait_writable(self, request_id: str | None = None) -> None:
        pass

    def close(self) -> None:
        pass
