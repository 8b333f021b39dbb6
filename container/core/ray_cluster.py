"""Ray across the cluster's nodes, for ``option.distributed_executor_backend=ray``: vLLM's Ray
executor places the engine's workers on a Ray cluster that the same image forms, as vLLM's
distributed guide describes it.

- The leader runs Ray's head (``ray start --head``), advertised at its cluster address, on
  ``option.ray_port``; each worker node joins it (``ray start --address=<leader>:<port>``). Both
  run with ``--block`` under sagelmi's supervisor, which restarts them when they die.
- Every Ray process of the cluster, and the leader's engine (a Ray driver), runs with Ray's token
  authentication (``RAY_AUTH_MODE=token``, Ray 2.52 and newer). The token is derived from the
  cluster's secret (``ray_token``), so every node that knows the secret has it and a node without
  it cannot join, connect a driver or submit work; it is a token of its own, so what Ray's worker
  processes hold cannot open sagelmi's own cluster channel. It reaches Ray through a file only
  this node's user can read (``RAY_AUTH_TOKEN_PATH``), never through the environment.
- Ray's servers listen on every interface of the node (Ray has no setting to bind them to one
  address); ``--node-ip-address`` is the address Ray advertises to the other nodes. None of them is
  published to clients: SageMaker forwards the HTTP port alone, and docs/cluster.md shows the
  Kubernetes network policy that keeps Ray's ports to the group's own pods.

vLLM's CPU build has no Ray device (``container.core.known_bad`` refuses the setting there).
"""

from __future__ import annotations

import hashlib
import hmac
import socket
from dataclasses import dataclass

from container.core.settings import Settings

RAY_BACKEND = "ray"


def uses_ray(settings: Settings) -> bool:
    """Whether the built-in engine's workers run on Ray (``option.distributed_executor_backend=ray``,
    an engine argument that passes through to vLLM)."""
    return settings.passthrough_options().get("distributed_executor_backend", "").strip().lower() == RAY_BACKEND


def ray_token(secret: bytes) -> str:
    """Ray's authentication token for the cluster whose secret is ``secret``: the same on every
    node, and no help to anyone who has it in learning the secret."""
    return hmac.new(secret, b"sagelmi ray token", hashlib.sha256).hexdigest()


def auth_environment(token_path: str) -> dict[str, str]:
    """What every Ray process of the cluster and every Ray driver needs in its environment: token
    authentication on, the token in ``token_path`` (a file of ``ray_token``), no usage reports."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path, "RAY_USAGE_STATS_ENABLED": "0"}


@dataclass(frozen=True)
class RayNode:
    """This node's part of the Ray cluster."""

    leader: str  # the leader's address as the nodes reach it (the cluster's, e.g. LWS_LEADER_ADDRESS)
    port: int  # the head's port on the leader (option.ray_port)
    head: bool  # this node is the leader
    node_address: str | None = None  # the address this node is reached at; None: Ray picks one

    @property
    def head_address(self) -> str:
        """Where worker nodes and drivers reach the head (``RAY_ADDRESS``)."""
        return f"{self.leader}:{self.port}"

    def start_command(self, ray: str = "ray") -> list[str]:
        """``ray start`` for this node, running until it is stopped (``--block``): the head on
        the leader, a node joining the head elsewhere."""
        if self.head:
            command = [ray, "start", "--head", f"--port={self.port}", "--include-dashboard=false"]
        else:
            command = [ray, "start", f"--address={self.head_address}"]
        if self.node_address:
            command.append(f"--node-ip-address={self.node_address}")
        return [*command, "--disable-usage-stats", "--log-style=record", "--block"]

    def driver_environment(self, token_path: str) -> dict[str, str]:
        """The environment of the leader's engine, a Ray driver: the head to connect to
        (``ray.init()`` reads ``RAY_ADDRESS``) and the token to connect with."""
        return {**auth_environment(token_path), "RAY_ADDRESS": self.head_address}


def ray_node(leader: str, port: int, head: bool, node_address: str | None) -> RayNode:
    """This node's ``RayNode``. The head advertises ``node_address`` or else the leader's address,
    which is its own (Ray's own guess on a host with several interfaces may be another), as an IP
    address: Ray's ``--node-ip-address`` takes no names."""
    if head and not node_address:
        try:
            node_address = socket.gethostbyname(leader)
        except OSError:
            node_address = None  # Ray's own guess
    return RayNode(leader=leader, port=port, head=head, node_address=node_address)
