"""A cluster of nodes running the same image: its settings, read from each node's environment,
and the authenticated channel its nodes talk over.

One node is the *leader*: it serves HTTP and starts each worker group across every node: one
``mpirun`` (a model.py in MPI mode), or vLLM's own executor (the built-in engine), whose headless
node on each worker node the leader has started there. The others are *worker nodes*: they
register with the leader and run what it starts on them (``container/supervisor/cluster.py``). The names follow
LMI's (``DJL_CLUSTER_SIZE``, ``DJL_LEADER_ADDR``) and Kubernetes LeaderWorkerSet's
(``LWS_GROUP_SIZE``, ``LWS_LEADER_ADDRESS``, ``LWS_WORKER_INDEX``), ``SAGELMI_*`` first.

The channel: a connection proves knowledge of a key both ways (HMAC-SHA256 over two fresh
nonces; the key is the cluster's secret between nodes, a one-use launch key for a launch, a
group's random token on its rank relay), then every message is a length-prefixed JSON object
followed by an HMAC tag under a session key derived from the key and both nonces, with a
counter per direction, so a message cannot be forged, altered, replayed or reordered by anyone
without the key. Nothing is encrypted: nothing secret crosses it.

Launch keys: both ends of a worker node's registration derive a key from the registration's
session key (``Channel.derive``), which no other node knows; the leader turns it into one key
per launch (``launch_key``, numbered), and the worker node accepts each number once. So only
the leader this node is registered with can start Open MPI's daemon on it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PORT = 8889  # not the model's port: the registration and launch channel
DEFAULT_JOIN_TIMEOUT = 600.0
HEARTBEAT = 1.0  # seconds between heartbeats on a registration
LOST_AFTER = 5.0  # a registration silent this long is a lost node
HANDSHAKE_TIMEOUT = 10.0  # seconds an unauthenticated connection may take to prove itself, in all
MAX_MESSAGE = 1 << 20
MIN_SECRET = 32  # characters: 32 hex characters are 128 bits, past offline guessing of a captured handshake
# Where the secret comes from; the supervisor removes both from its environment once read, so
# no process it starts (frontend, ranks, handlers, Open MPI, pip) inherits them.
SECRET_VARIABLES = ("SAGELMI_CLUSTER_SECRET", "SAGELMI_CLUSTER_SECRET_FILE")

SIZE_NAMES = ("SAGELMI_CLUSTER_SIZE", "DJL_CLUSTER_SIZE", "LWS_GROUP_SIZE")
LEADER_NAMES = ("SAGELMI_LEADER_ADDR", "DJL_LEADER_ADDR", "LWS_LEADER_ADDRESS")
INDEX_NAMES = ("SAGELMI_NODE_INDEX", "LWS_WORKER_INDEX")


class ClusterError(Exception):
    """A cluster setting that cannot work, or a peer that failed to authenticate."""


def _first(env: dict[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


@dataclass(frozen=True)
class ClusterConfig:
    size: int  # nodes, the leader included
    leader: str  # the leader's address (a name or an IP) as the workers reach it
    secret: bytes = field(repr=False)  # never in a log line that shows the config
    port: int = DEFAULT_PORT
    index: int | None = None  # this node's index (0: the leader), when the environment says
    node_address: str | None = None  # the address other nodes reach this one at, when set
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    leader_variable: str = "SAGELMI_LEADER_ADDR"  # where the leader's address came from

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ClusterConfig | None:
        """The cluster this node belongs to, or ``None`` (a single machine).

        Raises ``ClusterError`` (one line) for settings that cannot work."""
        env = dict(os.environ if env is None else env)
        found = _first(env, SIZE_NAMES)
        if found is None:
            return None
        name = found[0]
        size = _number(env, name, 1, int)
        if size < 1:
            raise ClusterError(f"{name}={size}: a cluster has at least one node")
        if size == 1:
            return None  # LeaderWorkerSet sets LWS_GROUP_SIZE=1 for a single-node group
        leader = _first(env, LEADER_NAMES)
        if leader is None:
            raise ClusterError(
                f"{name}={size} needs the leader's address: set SAGELMI_LEADER_ADDR (or DJL_LEADER_ADDR)"
            )
        port = _number(env, "SAGELMI_CLUSTER_PORT", DEFAULT_PORT, int)
        if not 0 < port < 65535:
            raise ClusterError(f"SAGELMI_CLUSTER_PORT={port}: a port from 1 to 65534 (the next is the engine's)")
        return cls(
            size=size,
            leader=leader[1],
            leader_variable=leader[0],
            secret=_secret(env),
            port=port,
            index=_number(env, index[0], None, int) if (index := _first(env, INDEX_NAMES)) else None,
            node_address=env.get("SAGELMI_NODE_ADDR") or None,
            join_timeout=_number(env, "SAGELMI_CLUSTER_JOIN_TIMEOUT", DEFAULT_JOIN_TIMEOUT, float),
        )

    @property
    def engine_port(self) -> int:
        """The built-in engine's rendezvous port on the leader (vLLM's ``master_port``, where
        torch.distributed meets): the port after the cluster port."""
        return self.port + 1

    def is_leader(self) -> bool:
        """Index 0 when the environment gives one; else whether the leader's address is one of
        this machine's (an address a socket can bind to is local)."""
        if self.index is not None:
            return self.index == 0
        try:
            address = socket.gethostbyname(self.leader)
        except OSError:
            return False
        with socket.socket() as probe:
            try:
                probe.bind((address, 0))
            except OSError:
                return False
        return True

    def expected_name(self, index: int) -> str:
        """How a worker node is named in messages: LeaderWorkerSet's predictable hostname
        (``<leader's first label>-<index>.<the rest>``) when the leader's address is one."""
        if self.leader_variable == "LWS_LEADER_ADDRESS" and "." in self.leader:
            first, rest = self.leader.split(".", 1)
            return f"worker node {index} ({first}-{index}.{rest})"
        return f"worker node {index}"


def _number(env: dict[str, str], name: str, default, kind):
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise ClusterError(f"{name}={text!r} is not a number") from None
    if value < 0:
        raise ClusterError(f"{name}={text!r} must not be negative")
    return value


def _secret(env: dict[str, str]) -> bytes:
    path = env.get("SAGELMI_CLUSTER_SECRET_FILE", "").strip()
    if path:
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise ClusterError(f"SAGELMI_CLUSTER_SECRET_FILE: cannot read it ({exc.strerror})") from None
        source = "SAGELMI_CLUSTER_SECRET_FILE's file"
    else:
        value = env.get("SAGELMI_CLUSTER_SECRET", "").strip()
        source = "SAGELMI_CLUSTER_SECRET"
    if not value:
        raise ClusterError(
            "a cluster needs a shared secret on every node: set SAGELMI_CLUSTER_SECRET (or SAGELMI_CLUSTER_SECRET_FILE "
            "naming a file, e.g. a Kubernetes secret); make one with: "
            "python -c 'import secrets; print(secrets.token_hex(32))'"
        )
    if len(value) < MIN_SECRET:
        raise ClusterError(
            f"{source} is too short ({len(value)} characters): use at least {MIN_SECRET} random characters, e.g. "
            f"python3 -c 'import secrets; print(secrets.token_hex(32))'"
        )
    return value.encode()


def launch_key(registration_key: bytes, number: int) -> bytes:
    """The key of launch ``number`` (from 1) on a worker node, from its registration's key."""
    return _mac(registration_key, b"launch", number.to_bytes(8, "big"))


class Channel:
    """One authenticated connection between two nodes of the cluster (see the module's text)."""

    _LENGTH = struct.Struct(">I")

    def __init__(self, sock: socket.socket, key: bytes, outgoing: bytes, incoming: bytes) -> None:
        self.sock = sock
        self._key = key
        self._out_label, self._in_label = outgoing, incoming
        self._sent = self._received = 0
        self._sending = threading.Lock()  # heartbeats and other messages leave from several threads

    @classmethod
    def connect(cls, sock: socket.socket, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> Channel:
        """The client's side of the handshake, within ``timeout`` seconds. Raises ``ClusterError``
        when the server has a different secret (or is not a cluster node), ``TimeoutError``."""
        deadline = time.monotonic() + timeout
        server_nonce = recv_exactly(sock, 32, deadline)
        if server_nonce is None:
            raise ClusterError("the connection closed during the handshake")
        client_nonce = secrets.token_bytes(32)
        sock.sendall(client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
        answer = recv_exactly(sock, 32, deadline)
        if answer is None or not hmac.compare_digest(answer, _mac(secret, b"server", client_nonce, server_nonce)):
            raise ClusterError("the cluster secrets differ")
        sock.settimeout(None)
        key = _mac(secret, b"session", server_nonce, client_nonce)
        return cls(sock, key, b"c", b"s")

    @classmethod
    def accept(cls, sock: socket.socket, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> Channel:
        """The server's side, within ``timeout`` seconds however slowly the client sends. Raises
        ``ClusterError`` when the client does not know the secret, ``TimeoutError``."""
        deadline = time.monotonic() + timeout
        sock.settimeout(timeout)
        server_nonce = secrets.token_bytes(32)
        sock.sendall(server_nonce)
        reply = recv_exactly(sock, 64, deadline)
        if reply is None:
            raise ClusterError("it closed the connection during the handshake")
        client_nonce, proof = reply[:32], reply[32:]
        if not hmac.compare_digest(proof, _mac(secret, b"client", server_nonce, client_nonce)):
            raise ClusterError("it does not know the cluster's secret")
        sock.sendall(_mac(secret, b"server", client_nonce, server_nonce))
        sock.settimeout(None)
        key = _mac(secret, b"session", server_nonce, client_nonce)
        return cls(sock, key, b"s", b"c")

    def derive(self, label: bytes) -> bytes:
        """A key both ends of this connection know and nobody else does (not even another
        holder of the secret that did not see the handshake)."""
        return _mac(self._key, b"derive", label)

    def send(self, message: dict) -> None:
        body = json.dumps(message, separators=(",", ":")).encode()
        with self._sending:  # the counter and the bytes leave in the same order
            tag = _mac(self._key, self._out_label, self._sent.to_bytes(8, "big"), body)
            self._sent += 1
            self.sock.sendall(self._LENGTH.pack(len(body)) + body + tag)

    def receive(self, silence: float | None = None, beat: float = HEARTBEAT) -> dict | None:
        """The next message, or ``None`` when the peer closed the connection. Raises
        ``ClusterError`` for a message that fails its tag or is not an object; with ``silence``,
        ``TimeoutError`` once the peer has sent nothing for that many seconds of this process's
        own running time (``_await``)."""
        if silence is not None:
            self._await(silence, beat)
        head = recv_exactly(self.sock, self._LENGTH.size)
        if head is None:
            return None
        (length,) = self._LENGTH.unpack(head)
        if length > MAX_MESSAGE:
            raise ClusterError(f"a message of {length} bytes")
        rest = recv_exactly(self.sock, length + 32)
        if rest is None:
            return None
        body, tag = rest[:length], rest[length:]
        if not hmac.compare_digest(tag, _mac(self._key, self._in_label, self._received.to_bytes(8, "big"), body)):
            raise ClusterError("a message failed its authentication tag")
        self._received += 1
        message = json.loads(body)
        if not isinstance(message, dict):
            raise ClusterError("a message that is not a JSON object")
        return message

    def _await(self, silence: float, beat: float) -> None:
        """Until the next message begins to arrive (or the connection ends); ``TimeoutError`` after
        ``silence`` seconds of waiting in vain, counting only the time this process ran.

        It waits in turns of ``beat`` seconds (the peer's heartbeat period) and counts at most
        ``beat`` for a turn, however long the turn really took: when a loaded machine (a paused VM, a
        starved cgroup, two nodes on one machine) stops both nodes' supervisors for longer than
        ``silence``, the first to run again does not take the other for silent before the other's
        heartbeat thread could run, as a plain socket timeout, counting all of it, would."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)  # a closed or failed connection wakes it too
        quiet = 0.0
        while True:
            began = time.monotonic()
            if poller.poll(beat * 1000):
                return
            quiet += min(time.monotonic() - began, beat)  # past ``beat``: this process did not run
            if quiet >= silence:
                raise TimeoutError(f"nothing for {silence:g} s")

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"|".join(parts), hashlib.sha256).digest()


def recv_exactly(sock: socket.socket, count: int, deadline: float | None = None) -> bytes | None:
    """``count`` bytes, or ``None`` when the connection closes first; ``TimeoutError`` past
    ``deadline`` (``time.monotonic()``), however the bytes trickle in."""
    data = bytearray()
    while len(data) < count:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the handshake took too long")
            sock.settimeout(left)
        try:
            chunk = sock.recv(count - len(data))
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return None
        data += chunk
    return bytes(data)
