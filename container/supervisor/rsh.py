"""What the leader's ``mpirun`` uses instead of ``ssh`` (``--mca plm_rsh_agent``):
``python -m container.supervisor.rsh KEYS HOST COMMAND...`` asks the worker node at HOST, over
an authenticated channel, to run COMMAND (Open MPI's daemon), and waits for it to end. Its exit
code is the command's, or 255 (as ``ssh``'s) when the node cannot be reached, refuses, or goes
away. When this process ends, the node stops what it started for it.

KEYS is the file the leader's supervisor wrote for this start of the group
(``Leader.write_launch_keys``): the cluster port and, per worker node, the number and one-use key
of this launch. The node says which node it is first; this process proves that node's key. It
never holds the cluster's secret."""

from __future__ import annotations

import json
import signal
import socket
import sys
from pathlib import Path

from container.core.cluster import Channel, ClusterError, recv_exactly
from container.supervisor.cluster import LAUNCH_INDEX, LAUNCH_NUMBER


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: python -m container.supervisor.rsh KEYS HOST COMMAND...", file=sys.stderr)
        return 255
    keys_path, host, command = argv[0], argv[1], " ".join(argv[2:])
    try:
        keys = json.loads(Path(keys_path).read_text())
        port, nodes = int(keys["port"]), keys["nodes"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"sagelmi rsh: cannot read the launch keys {keys_path}: {exc}", file=sys.stderr)
        return 255
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(255))
    try:
        sock = socket.create_connection((host, port), timeout=10)
        opening = recv_exactly(sock, LAUNCH_INDEX.size)
        if opening is None:
            raise ClusterError("the node refused the launch (see its log)")
        (index,) = LAUNCH_INDEX.unpack(opening)
        if str(index) not in nodes:
            raise ClusterError(f"it is worker node {index}, which was not registered when the group started")
        number, key = nodes[str(index)]
        sock.sendall(LAUNCH_NUMBER.pack(number))
        channel = Channel.connect(sock, bytes.fromhex(key))
        sock.settimeout(None)
        channel.send({"type": "launch", "command": command})
        while (message := channel.receive()) is not None:
            if message.get("type") == "exit":
                return int(message.get("code", 255))
        print(f"sagelmi rsh: the node at {host} closed the connection (see its log)", file=sys.stderr)
    except (ClusterError, OSError) as exc:
        print(f"sagelmi rsh: {host}:{port}: {exc}", file=sys.stderr)
    return 255


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
