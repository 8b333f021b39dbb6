"""The cluster's launch service and its accept loops, in this process: a real leader and a real
worker node (on 127.0.0.1 and 127.0.0.2), real sockets, the real ``rsh`` client. What a launch may
run is parsed, never handed to a shell; only the leader the node registered with may launch; no
bad peer and no failed accept ends a service. The cluster itself runs in
tests/integration/test_cluster.py."""

import json
import secrets
import socket
import threading
import time
from pathlib import Path

import pytest

from container.core.accepting import AcceptLoop
from container.core.cluster import Channel, ClusterConfig, ClusterError, launch_key
from container.supervisor import rsh
from container.supervisor.cluster import LAUNCH_INDEX, LAUNCH_NUMBER, Leader, WorkerNode
from container.supervisor.prted import LaunchRefused, installed_prted, parse_launch
from tests.server import NoDescriptorsLeft, free_port

PRTED = installed_prted()
PREFIX = PRTED.parent.parent if PRTED else Path("/nonexistent")
# What Open MPI 5.0.11's ssh launcher hands its agent (logged from tests/integration/test_cluster.py's
# cluster), with this installation's paths.
OPEN_MPI_5 = (
    f"PRTE_PREFIX={PREFIX};export PRTE_PREFIX;PMIX_PREFIX={PREFIX};export PMIX_PREFIX;"
    f"LD_LIBRARY_PATH={PREFIX}/lib:{PREFIX}/lib:$LD_LIBRARY_PATH;export LD_LIBRARY_PATH;"
    f"DYLD_LIBRARY_PATH={PREFIX}/lib:{PREFIX}/lib:$DYLD_LIBRARY_PATH;export DYLD_LIBRARY_PATH;{PRTED} "
    '--daemonize --allow-run-as-root --prtemca ess "env" --prtemca ess_base_nspace "prterun-vm-8301@0" '
    '--prtemca ess_base_vpid 1 --prtemca ess_base_num_procs "2" --prtemca prte_hnp_uri '
    '"prterun-vm-8301@0.0;tcp://192.0.2.2:52145:64,24;tcp6://[fd00::2]:58581:64,24" --prtemca PREFIXES '
    '"errmgr,ess,filem,grpcomm,iof,odls,oob,plm,prtebacktrace,prtedl,prteinstalldirs,prtereachable,ras,rmaps,rtc,'
    'schizo,state,hwloc,if,reachable" --prtemca plm_ssh_agent "/opt/venv/bin/python -m container.supervisor.rsh '
    '/tmp/sagelmi-x/group-0.launch" --prtemca plm_ssh_no_tree_spawn "1" --prtemca pmix_session_server "1" '
    '--prtemca plm "ssh"'
)

pytestmark = pytest.mark.skipif(PRTED is None, reason="needs Open MPI's prted (the mpi extra)")


def test_open_mpi_s_launch_command_runs_this_installation_s_prted_without_a_shell():
    daemon = parse_launch(OPEN_MPI_5, PRTED, {"LD_LIBRARY_PATH": "/usr/local/lib"})
    assert daemon.argv[0] == str(PRTED)
    assert daemon.argv[1:4] == ["--daemonize", "--allow-run-as-root", "--prtemca"]
    hnp = daemon.argv[daemon.argv.index("prte_hnp_uri") + 1]
    assert hnp == "prterun-vm-8301@0.0;tcp://192.0.2.2:52145:64,24;tcp6://[fd00::2]:58581:64,24"  # quotes gone
    assert daemon.env["PRTE_PREFIX"] == str(PREFIX)
    assert daemon.env["LD_LIBRARY_PATH"] == f"{PREFIX}/lib:{PREFIX}/lib:/usr/local/lib"  # its own value expanded
    assert daemon.env["DYLD_LIBRARY_PATH"] == f"{PREFIX}/lib:{PREFIX}/lib"  # unset: nothing, not an empty entry


@pytest.mark.parametrize("command,why", [
    (OPEN_MPI_5 + " ; touch /tmp/pwned", "';' is not a flag"),
    (OPEN_MPI_5 + " $(touch /tmp/pwned)", "'$' is not a flag"),
    (OPEN_MPI_5 + ' --prtemca ess "$(touch /tmp/pwned)"', "is not an MCA parameter"),
    (OPEN_MPI_5 + "\ntouch /tmp/pwned", "control character"),
    (OPEN_MPI_5 + " `touch /tmp/pwned`", "command substitution"),
    (OPEN_MPI_5 + " | sh", "'|' is not a flag"),
    (OPEN_MPI_5 + " && id", "'&&' is not a flag"),
    (OPEN_MPI_5 + " > /tmp/pwned", "'>' is not a flag"),
    (OPEN_MPI_5 + " --tree-spawn", "'--tree-spawn' is not a flag"),
    (OPEN_MPI_5 + " --prtemca", "needs a key and a value"),
    (OPEN_MPI_5 + ' "unclosed', "does not parse"),
    (f"{PRTED};touch /tmp/pwned", "';' is not a flag"),
    ("/bin/sh -c id", "is not Open MPI's daemon of this installation"),
    ("prted --daemonize", "is not Open MPI's daemon of this installation"),
    (f"LD_PRELOAD=/tmp/x.so;export LD_PRELOAD;{PRTED}", "it sets LD_PRELOAD"),
    (f"LD_LIBRARY_PATH=/tmp:$LD_LIBRARY_PATH;export LD_LIBRARY_PATH;{PRTED}", "not a path inside this installation"),
    (f"PATH=$HOME;export PATH;{PRTED}", "not a path inside this installation"),
    (f"PRTE_PREFIX={PREFIX};export PMIX_PREFIX;{PRTED}", "is not NAME=value;export NAME"),
], ids=["semicolon", "substitution", "quoted-substitution", "newline", "backquote", "pipe", "and", "redirect",
        "tree-spawn", "missing-value", "unclosed-quote", "no-space", "other-program", "relative-path",
        "unknown-variable", "path-outside", "other-variable", "mismatched-export"])
def test_anything_but_the_daemon_and_its_flags_is_refused(command, why):
    with pytest.raises(LaunchRefused, match=why.replace("$", r"\$").replace("|", r"\|")):
        parse_launch(command, PRTED, {})


@pytest.fixture
def cluster(tmp_path):
    """A leader on 127.0.0.1 and a worker node on 127.0.0.2, registered, in this process."""
    secret, port = secrets.token_hex(16).encode(), free_port()
    leader = Leader(ClusterConfig(size=2, leader="127.0.0.1", secret=secret, port=port,
                                  node_address="127.0.0.1")).start()
    worker_config = ClusterConfig(size=2, leader="127.0.0.1", secret=secret, port=port, index=1,
                                  node_address="127.0.0.2")
    stopped = threading.Event()
    node = WorkerNode(worker_config, socket.create_server(("127.0.0.2", 0)), stopped.is_set).start()
    registration = threading.Thread(target=node.run, daemon=True)
    registration.start()
    leader.wait(10, lambda: False)
    keys = tmp_path / "group-0.launch"
    leader.write_launch_keys(keys)
    yield leader, node, keys
    stopped.set()
    leader.close()
    node.stop()
    registration.join(10)


def _wait_for(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("attack", [
    "{prted} --daemonize ; touch {target}",
    "{prted} --daemonize $(touch {target})",
    '{prted} --prtemca ess "$(touch {target})"',
    "{prted} --daemonize\ntouch {target}",
    "{prted} --daemonize `touch {target}`",
], ids=["semicolon", "substitution", "quoted-substitution", "newline", "backquote"])
def test_a_launch_from_the_leader_with_a_shell_command_runs_nothing(cluster, tmp_path, caplog, attack):
    leader, node, keys = cluster
    target = tmp_path / "pwned"
    assert rsh.main([str(keys), "127.0.0.2", attack.format(prted=PRTED, target=target)]) == 255
    time.sleep(0.5)  # what a shell would have run, it would have run by now
    assert not target.exists()
    assert "cluster: refused a launch from 127.0.0.1" in caplog.text
    assert not node._launches


def _launch_with(host: str, port: int, number: int, key: bytes) -> Channel:
    sock = socket.create_connection((host, port), timeout=5)
    opening = sock.recv(LAUNCH_INDEX.size)
    assert LAUNCH_INDEX.unpack(opening) == (1,)
    sock.sendall(LAUNCH_NUMBER.pack(number))
    return Channel.connect(sock, key)


def test_only_the_leader_the_node_registered_with_may_launch(cluster, caplog):
    leader, node, keys = cluster
    port = leader.config.port
    # Another node that knows the cluster's secret (a registered peer) is not the leader.
    with pytest.raises(ClusterError, match="the cluster secrets differ"):
        _launch_with("127.0.0.2", port, 1, leader.config.secret)
    # Nor is anyone with a key of another registration (this node's next start of the leader ...).
    with pytest.raises(ClusterError, match="the cluster secrets differ"):
        _launch_with("127.0.0.2", port, 1, launch_key(secrets.token_bytes(32), 1))
    _wait_for(lambda: caplog.text.count("it is not the leader this node registered with") == 2)
    # The leader's key works once: a second launch with it (a copy of the key file) is refused.
    number, key = json.loads(keys.read_text())["nodes"]["1"]
    channel = _launch_with("127.0.0.2", port, number, bytes.fromhex(key))
    channel.close()
    with pytest.raises(ClusterError):
        _launch_with("127.0.0.2", port, number, bytes.fromhex(key))
    _wait_for(lambda: f"launch key {number} was used already" in caplog.text)


def test_a_node_that_is_not_registered_refuses_every_launch(cluster, caplog):
    leader, node, keys = cluster
    leader.close()  # the registration ends: the node waits for a leader again
    _wait_for(lambda: node._registered is None)
    assert rsh.main([str(keys), "127.0.0.2", f"{PRTED} --daemonize"]) == 255
    _wait_for(lambda: "this node is not registered with a leader" in caplog.text)


def test_the_registration_service_outlives_a_failed_accept_and_bad_peers(caplog):
    secret, port = secrets.token_hex(16).encode(), free_port()
    leader = Leader(ClusterConfig(size=3, leader="127.0.0.1", secret=secret, port=port,
                                  node_address="127.0.0.1")).start()
    try:
        victim = socket.socket()
        with NoDescriptorsLeft() as descriptors:
            victim.connect(("127.0.0.1", port))  # the leader's accept() gets EMFILE
            failed = "cluster: accepting a connection failed ([Errno 24] Too many open files)"
            _wait_for(lambda: descriptors.take() or failed in caplog.text)
        victim.close()
        silent = socket.create_connection(("127.0.0.1", port))  # never says a word
        garbage = socket.create_connection(("127.0.0.1", port))
        garbage.sendall(b"GET / HTTP/1.1\r\n" * 8)
        wrong = socket.create_connection(("127.0.0.1", port))
        with pytest.raises(ClusterError):
            Channel.connect(wrong, b"another secret of thirty-two characters")
        nodes = [Channel.connect(socket.create_connection(("127.0.0.1", port), timeout=5), secret) for _ in (1, 2)]
        for index, channel in enumerate(nodes, 1):
            channel.send({"type": "register", "index": index, "hostname": f"node-{index}"})
            assert channel.receive() == {"type": "welcome", "index": index}
        assert leader.complete()
        for sock in (silent, garbage, *(channel.sock for channel in nodes)):
            sock.close()
    finally:
        leader.close()


def test_an_accept_loop_outlives_a_handler_that_raises(caplog):
    listener = socket.create_server(("127.0.0.1", 0))
    served = []

    def handle(conn, address):
        data = conn.recv(16)
        if data == b"bad":
            raise ValueError("a peer this handler did not expect")
        served.append(data)
        conn.close()

    loop = AcceptLoop(listener, handle, "test").start()
    try:
        for data in (b"bad", b"good"):
            with socket.create_connection(listener.getsockname()) as client:
                client.sendall(data)
                _wait_for(lambda: served or "a peer this handler did not expect" in caplog.text)
        _wait_for(lambda: served == [b"good"])
    finally:
        loop.close()
    with pytest.raises(OSError):
        socket.create_connection(listener.getsockname(), timeout=1)  # closed: nothing listens
