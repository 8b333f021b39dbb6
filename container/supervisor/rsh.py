"""What the leader's ``mpirun`` uses instead of ``ssh`` (``--mca plm_rsh_agent``):
``python -m container.supervisor.rsh HOST COMMAND...`` asks the worker node at HOST, over the
cluster's authenticated channel, to run COMMAND (Open MPI's daemon), and waits for it to end.
Its exit code is the command's, or 255 (as ``ssh``'s) when the node cannot be reached, refuses,
or goes away. When this process ends, the node stops what it started for it."""

from __future__ import annotations

import signal
import socket
import sys

from container.core.cluster import Channel, ClusterConfig, ClusterError


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m container.supervisor.rsh HOST COMMAND...", file=sys.stderr)
        return 255
    host, command = argv[0], " ".join(argv[1:])
    try:
        config = ClusterConfig.from_env()
    except ClusterError as exc:
        print(f"sagelmi rsh: {exc}", file=sys.stderr)
        return 255
    if config is None:
        print("sagelmi rsh: this node is not in a cluster (SAGELMI_CLUSTER_SIZE is unset)", file=sys.stderr)
        return 255
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(255))
    try:
        sock = socket.create_connection((host, config.port), timeout=10)
        channel = Channel.connect(sock, config.secret)
        channel.send({"type": "launch", "command": command})
        while (message := channel.receive()) is not None:
            if message.get("type") == "exit":
                return int(message.get("code", 255))
        print(f"sagelmi rsh: the node at {host} closed the connection", file=sys.stderr)
    except (ClusterError, OSError) as exc:
        print(f"sagelmi rsh: {host}:{config.port}: {exc}", file=sys.stderr)
    return 255


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
