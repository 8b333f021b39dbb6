"""The cluster's own code: a thin bootstrap over Open MPI and vLLM's own executor, never a scheduler.

- ``Leader``: the leader's registry. Worker nodes connect to its cluster port, prove they know
  the secret (``container.core.cluster.Channel``) and stay connected, sending heartbeats; a
  node whose connection closes or falls silent is gone. The supervisor waits for every node
  before it starts a group, starts the group as one ``mpirun`` over the registered addresses
  (or, for the built-in engine, tells each node to start its part of vLLM:
  ``container.supervisor.engine_nodes``), and ends the group at once when a node goes.
- ``WorkerNode``: what ``sagelmi serve`` is on a worker node: ``/ping`` says "cluster worker"
  (never 200), the registration (reconnecting whenever the leader goes), and the launch
  service ``mpirun`` reaches through ``container.supervisor.rsh``, which runs Open MPI's
  daemon (``prted``, its arguments parsed by ``container.supervisor.prted``, no shell) and
  nothing else, and kills it and everything below it when the leader's side of the connection
  closes. A launch must prove it holds the next one-use key of this node's registration
  (``container.core.cluster.launch_key``), which only the leader it registered with can make.

Every accept loop (``AcceptLoop``) outlives a failed accept and a bad peer, and every
unauthenticated connection has a deadline to prove itself.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from container.core.accepting import AcceptLoop
from container.core.cluster import (
    HANDSHAKE_TIMEOUT,
    HEARTBEAT,
    LOST_AFTER,
    Channel,
    ClusterConfig,
    ClusterError,
    launch_key,
    recv_exactly,
)
from container.core.launch import EngineNodes
from container.supervisor.engine_nodes import HeadlessNode, start_message
from container.supervisor.processes import StartupError, _kill_family, _start
from container.supervisor.prted import LaunchRefused, installed_prted, parse_launch

log = logging.getLogger("sagelmi.cluster")

RETRY = 1.0  # seconds between a worker node's attempts to reach the leader
# A launch's opening, before its handshake: the node's index (server to client), then the
# launch's number (client to server), which picks the one-use key the handshake proves.
LAUNCH_INDEX = struct.Struct(">I")
LAUNCH_NUMBER = struct.Struct(">Q")


@dataclass
class Node:
    index: int
    address: str  # as the leader sees it: mpirun's --host
    hostname: str
    channel: Channel
    launch_key: bytes = field(repr=False, default=b"")  # this registration's, known to both ends alone
    launches: int = 0  # launch keys handed out so far


def _listen(config: ClusterConfig) -> socket.socket:
    host = config.node_address or "0.0.0.0"
    try:
        sock = socket.create_server((host, config.port))
    except OSError as exc:
        raise StartupError(f"cannot listen on the cluster port {host}:{config.port}: {exc.strerror}") from None
    return sock


class Leader:
    """The leader's view of its worker nodes (see the module's text)."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.nodes: dict[int, Node] = {}
        self.local_address: str | None = None  # this node's address as the workers reach it
        self.losses = 0  # how many times a node went away: a group started before a loss must end
        self.lost: dict[int, str] = {}  # index -> why, for nodes gone and not back
        self.failure = ""  # why the last loss happened, for when the node is back already
        self.engine_start = 0  # the start of the built-in engine's group the nodes were last told of
        self._lock = threading.Lock()
        self._service: AcceptLoop | None = None

    def start(self) -> Leader:
        self._service = AcceptLoop(_listen(self.config), self._serve, "cluster").start()
        threading.Thread(target=self._beat, name="cluster-heartbeat", daemon=True).start()
        log.info("cluster leader: waiting for %d worker node(s) on port %d", self.config.size - 1, self.config.port)
        return self

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
        with self._lock:
            for node in self.nodes.values():
                node.channel.close()

    # -- what the supervisor asks
    def missing(self) -> list[int]:
        with self._lock:
            return [i for i in range(1, self.config.size) if i not in self.nodes]

    def complete(self) -> bool:
        return not self.missing()

    def hosts(self, slots: int) -> list[str]:
        """``mpirun --host`` entries: this node first (rank 0 answers), then each worker node."""
        with self._lock:
            return [f"{self.local_address}:{slots}"] + [f"{self.nodes[i].address}:{slots}" for i in sorted(self.nodes)]

    def launch_keys(self) -> dict[int, tuple[int, bytes]]:
        """For a start of the group: each registered node's next launch (number, one-use key)."""
        with self._lock:
            keys = {}
            for index, node in self.nodes.items():
                node.launches += 1
                keys[index] = (node.launches, launch_key(node.launch_key, node.launches))
            return keys

    def write_launch_keys(self, path: Path) -> None:
        """What ``container.supervisor.rsh`` reads to reach the nodes for one start of the group:
        a file only this user reads, never the environment the ranks inherit."""
        keys = {str(i): [number, key.hex()] for i, (number, key) in self.launch_keys().items()}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"port": self.config.port, "nodes": keys}, f)

    def start_engines(self, incarnation: int, nodes: EngineNodes) -> None:
        """Tell every worker node to start its part of the built-in engine for this start of the
        group (``container.supervisor.engine_nodes``); ``nodes`` is the leader's own (rank 0)."""
        with self._lock:
            self.engine_start = incarnation
            targets = list(self.nodes.values())
        for node in targets:
            own = EngineNodes(nodes.nnodes, node.index, nodes.master_addr, nodes.master_port)
            self._tell(node, start_message(incarnation, own, node.address))

    def stop_engines(self) -> None:
        """Tell every worker node to stop its part of the built-in engine: the group ended."""
        with self._lock:
            self.engine_start = 0
            targets = list(self.nodes.values())
        for node in targets:
            self._tell(node, {"type": "engine-stop"})

    def _tell(self, node: Node, message: dict) -> None:
        try:
            node.channel.send(message)
        except OSError:
            node.channel.close()  # its reader thread then ends the registration at once

    def engine_exit(self, index: int, message: dict) -> None:
        """A worker node's part of the built-in engine ended by itself: the group cannot go on,
        so it counts as a loss (the group ends and starts again; the node stays registered)."""
        reason = str(message.get("reason", "?"))[:200]
        with self._lock:
            if message.get("incarnation") != self.engine_start or not self.engine_start:
                return  # of an older start of the group, ended already
            self.engine_start = 0
            self.losses += 1
            self.failure = f"worker node {index}: {reason}"
        log.error("cluster: worker node %d's part of the engine ended: %s", index, reason)

    def loss_reason(self) -> str:
        """Why the group had to end: the nodes it waits for, or what a node reported."""
        return self.describe_missing() or self.failure or "a worker node went away"

    def describe_missing(self) -> str:
        lost = self.lost
        return ", ".join(self.config.expected_name(i) + (f" ({lost[i]})" if i in lost else "") for i in self.missing())

    def wait(self, timeout: float, stopping) -> None:
        """Until every worker node registered; ``StartupError`` naming the missing ones after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.complete():
            if stopping():
                return
            if time.monotonic() > deadline:
                raise StartupError(
                    f"cluster: {self.describe_missing()} did not register with this leader within {timeout:g}s "
                    f"(SAGELMI_CLUSTER_JOIN_TIMEOUT); check that it runs with the same SAGELMI_CLUSTER_SECRET and "
                    f"reaches {self.config.leader}:{self.config.port}"
                )
            time.sleep(0.1)
        log.info("cluster: all %d worker node(s) registered", self.config.size - 1)

    # -- the registration service
    def _serve(self, conn: socket.socket, address) -> None:
        try:
            channel = Channel.accept(conn, self.config.secret)
            conn.settimeout(HANDSHAKE_TIMEOUT)
            hello = channel.receive()
        except (ClusterError, OSError, ValueError) as exc:
            log.error("cluster: refused a node at %s: %s", address[0], exc)
            conn.close()
            return
        if not hello or hello.get("type") != "register":
            channel.close()
            return
        with self._lock:
            wanted = hello.get("index")
            free = [i for i in range(1, self.config.size) if i not in self.nodes]
            index = wanted if isinstance(wanted, int) and 0 < wanted < self.config.size else (free[0] if free else None)
            if index is None:
                log.error("cluster: refused a node at %s: all %d places are taken", address[0], self.config.size - 1)
                channel.close()
                return
            try:  # before the node is listed: the heartbeats (``_beat``) must not reach it first
                channel.send({"type": "welcome", "index": index})
            except OSError as exc:
                log.error("cluster: could not welcome a node at %s: %s", address[0], exc)
                channel.close()
                return
            old = self.nodes.pop(index, None)
            node = Node(index, address[0], str(hello.get("hostname", "?")), channel, channel.derive(b"launch"))
            self.nodes[index] = node
            self.local_address = conn.getsockname()[0]
            self.lost.pop(index, None)
        if old is not None:
            old.channel.close()  # a node that restarted: its old connection is stale
            with self._lock:
                if self.engine_start:  # its part of the built-in engine ended with its registration
                    self.engine_start = 0
                    self.losses += 1
                    self.failure = f"worker node {index} registered again"
        log.info("cluster: worker node %d registered from %s (%s)", index, node.address, node.hostname)
        try:
            conn.settimeout(LOST_AFTER)  # a send's limit; silence is counted by receive()
            while (message := channel.receive(silence=LOST_AFTER)) is not None:
                if message.get("type") == "engine-exit":
                    self.engine_exit(index, message)
            why = "its connection closed"
        except (ClusterError, OSError, ValueError) as exc:
            why = f"silent for {LOST_AFTER:g} s" if isinstance(exc, TimeoutError) else f"its connection failed ({exc})"
        with self._lock:
            if self.nodes.get(index) is not node:
                return  # replaced by a newer registration
            del self.nodes[index]
            self.losses += 1
            self.lost[index] = f"{node.address} went away: {why}"
            self.failure = f"worker node {index} ({self.lost[index]})"  # the reason, once it is back
        channel.close()
        log.error("cluster: worker node %d (%s) went away: %s", index, node.address, why)

    def _beat(self) -> None:
        while True:
            time.sleep(HEARTBEAT)
            with self._lock:
                nodes = list(self.nodes.values())
            for node in nodes:
                try:
                    node.channel.send({"type": "heartbeat"})
                except OSError:
                    node.channel.close()  # its reader thread then ends the registration at once


class _WorkerPing(http.server.BaseHTTPRequestHandler):
    leader = ""

    def _answer(self) -> None:
        body = json.dumps(
            {
                "code": 503,
                "message": "cluster worker",
                "error": f"this node is a worker of the cluster led by {self.leader}: send requests to the leader",
            }
        ).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *args) -> None:  # no access log
        pass


@dataclass
class _Registration:
    """A worker node's current registration, as its launch service checks launches against it."""

    index: int
    key: bytes = field(repr=False)
    last_launch: int = 0  # the highest launch number used: each key works once


class WorkerNode:
    """``sagelmi serve`` on a worker node (see the module's text)."""

    def __init__(self, config: ClusterConfig, listener: socket.socket, stopping) -> None:
        self.config = config
        self.listener = listener  # the HTTP port
        self.stopping = stopping
        self._launches: set = set()
        self._lock = threading.Lock()
        self._registered: _Registration | None = None  # launches are refused while unregistered
        self._service: AcceptLoop | None = None
        self._ping: http.server.ThreadingHTTPServer | None = None
        self._prted = installed_prted()
        self.engine: HeadlessNode | None = None  # the built-in engine's part here (not MPI mode)

    def start(self) -> WorkerNode:
        handler = type("Ping", (_WorkerPing,), {"leader": self.config.leader})
        server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), handler, bind_and_activate=False)
        server.socket.close()
        server.socket = self.listener
        self._ping = server
        threading.Thread(target=server.serve_forever, name="worker-ping", daemon=True).start()
        self._service = AcceptLoop(_listen(self.config), self._launch, "cluster-launch").start()
        return self

    def run(self) -> None:
        """Register with the leader and stay registered until stopped."""
        while not self.stopping():
            try:
                self._registration()
            except ClusterError as exc:
                leader = f"{self.config.leader}:{self.config.port}"
                raise StartupError(f"cluster: the leader at {leader} refused this node: {exc}") from None
            except OSError as exc:
                log.debug("cluster: leader not reachable: %s", exc)
            for _ in range(int(RETRY * 10)):
                if self.stopping():
                    break
                time.sleep(0.1)

    def _registration(self) -> None:
        source = (self.config.node_address, 0) if self.config.node_address else None
        sock = socket.create_connection((self.config.leader, self.config.port), timeout=5, source_address=source)
        channel = Channel.connect(sock, self.config.secret)
        channel.send({"type": "register", "index": self.config.index, "hostname": socket.gethostname()})
        sock.settimeout(LOST_AFTER)
        welcome = channel.receive()
        if not welcome:
            raise OSError("the leader closed the connection")
        index = welcome.get("index")
        if not isinstance(index, int):
            raise OSError("the leader's welcome names no index")
        log.info("cluster: registered with the leader at %s as worker node %s", self.config.leader, index)
        with self._lock:
            self._registered = _Registration(index, channel.derive(b"launch"))
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(HEARTBEAT):
                try:
                    channel.send({"type": "heartbeat"})
                except OSError:
                    return

        threading.Thread(target=beat, name="cluster-heartbeat", daemon=True).start()
        try:
            while not self.stopping() and (message := channel.receive(silence=LOST_AFTER)) is not None:
                if self.engine is not None:
                    self.engine.handle(message, channel.send)
            log.warning("cluster: lost the leader at %s; registering again", self.config.leader)
        except (TimeoutError, ClusterError, OSError) as exc:
            log.warning("cluster: lost the leader at %s (%s); registering again", self.config.leader, exc)
        finally:
            stop.set()
            with self._lock:
                self._registered = None
            if self.engine is not None:
                self.engine.stop()  # its peers on the leader are gone, or going
            channel.close()

    def _launch(self, conn: socket.socket, address) -> None:
        try:
            channel = self._authenticate_launch(conn)
            conn.settimeout(HANDSHAKE_TIMEOUT)
            request = channel.receive() or {}
            if request.get("type") != "launch":
                raise LaunchRefused("it is not a launch request")
            if self._prted is None:
                raise LaunchRefused("Open MPI's prted is not installed on this node")
            daemon = parse_launch(str(request.get("command", "")), self._prted, os.environ)
        except (ClusterError, LaunchRefused, OSError, ValueError) as exc:
            log.error("cluster: refused a launch from %s: %s", address[0], exc)
            conn.close()
            return
        conn.settimeout(None)
        log.info("cluster: starting Open MPI's daemon for the leader at %s", address[0])
        process = _start(daemon.argv, env={**os.environ, **daemon.env}, stdin=subprocess.DEVNULL)
        with self._lock:
            self._launches.add(process)
        closed = threading.Event()

        def watch_leader() -> None:
            try:
                while channel.receive() is not None:
                    pass
            except (ClusterError, OSError, ValueError):
                pass
            closed.set()

        threading.Thread(target=watch_leader, name="cluster-launch-watch", daemon=True).start()
        while process.poll() is None and not closed.wait(0.1):
            pass
        code = process.poll()
        if code is None:
            log.info("cluster: the leader's side closed; stopping what it started here")
        _kill_family(process)
        with self._lock:
            self._launches.discard(process)
        if code is not None:
            try:
                channel.send({"type": "exit", "code": code})
            except OSError:
                pass
        channel.close()

    def _authenticate_launch(self, conn: socket.socket) -> Channel:
        """The launch's handshake with this registration's next one-use key: only the leader this
        node is registered with holds it. Raises ``ClusterError`` (or ``OSError``)."""
        with self._lock:
            registration = self._registered
        if registration is None:
            raise ClusterError("this node is not registered with a leader")
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        conn.settimeout(HANDSHAKE_TIMEOUT)
        conn.sendall(LAUNCH_INDEX.pack(registration.index))
        opening = recv_exactly(conn, LAUNCH_NUMBER.size, deadline)
        if opening is None:
            raise ClusterError("it closed the connection")
        (number,) = LAUNCH_NUMBER.unpack(opening)
        if number <= registration.last_launch:
            raise ClusterError(f"launch key {number} was used already")
        try:
            channel = Channel.accept(conn, launch_key(registration.key, number), max(0.0, deadline - time.monotonic()))
        except ClusterError:
            raise ClusterError("it is not the leader this node registered with") from None
        with self._lock:
            if self._registered is not registration or number <= registration.last_launch:
                raise ClusterError(f"launch key {number} was used already, or the registration ended")
            registration.last_launch = number
        return channel

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        if self._ping is not None:
            self._ping.shutdown()
        if self._service is not None:
            self._service.close()
        with self._lock:
            launches = list(self._launches)
        for process in launches:
            _kill_family(process)


def serve_worker_node(config: ClusterConfig, listener: socket.socket, prepare, stopping, engine=None) -> int:
    """``sagelmi serve`` on a worker node: ``/ping`` says so, ``prepare`` installs the
    requirements and fetches the model as on the leader (returning where it is), then the node
    registers and runs what the leader starts here (``mpirun``'s daemon; with ``engine``, which
    makes a ``HeadlessNode`` from the model's location, the built-in engine's part), until stopped."""
    node = WorkerNode(config, listener, stopping).start()
    try:
        log.info("cluster worker node of %s: preparing the model, then registering", config.leader)
        location = prepare()
        if engine is not None:
            node.engine = engine(location)
        node.run()
    finally:
        node.stop()
    return 0
