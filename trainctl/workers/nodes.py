"""The Ray nodes as trainctl sees them: each node's name label, its GPU slots, which of them no
placement group holds, whether it has real CUDA GPUs and whether it hosts supervisors. The runtime,
the supervisor's re-placement and the warm pool all read the cluster through `cluster_nodes`; nothing
else parses ``ray.nodes()``."""

from __future__ import annotations

from dataclasses import dataclass

import ray

from trainctl.workers.resources import CONTROL_RESOURCE, NODE_LABEL, slots_of


@dataclass(frozen=True)
class ClusterNode:
    """A Ray node as trainctl sees it."""

    name: str | None
    """The node's ``trainctl.io/node`` label (None when the node has none: trainctl does not use it)."""
    node_id: str
    address: str
    alive: bool
    labels: dict[str, str]
    gpus: list[int]
    """Local GPU indices the node offers (its ``trainctl_gpu_<i>`` slots)."""
    free_gpus: list[int]
    """Those not reserved right now (none on a dead node)."""
    cuda_gpus: int
    """Real CUDA GPUs Ray sees on the node (0 where the GPUs are simulated)."""
    control: bool
    """Whether the node advertises ``CONTROL_RESOURCE`` (supervisors are placed on such nodes)."""


def cluster_nodes() -> list[ClusterNode]:
    """The Ray nodes, sorted by name (unnamed last), with their labels and GPU slots."""
    available = ray._private.state.available_resources_per_node()  # no public per-node API
    nodes = []
    for info in ray.nodes():
        labels = dict(info.get("Labels") or {})
        node_id = info["NodeID"]
        total = info.get("Resources") or {}
        nodes.append(
            ClusterNode(
                name=labels.get(NODE_LABEL),
                node_id=node_id,
                address=info.get("NodeManagerAddress", ""),
                alive=bool(info.get("Alive")),
                labels=labels,
                gpus=slots_of(total),
                free_gpus=slots_of(available.get(node_id, {})) if info.get("Alive") else [],
                cuda_gpus=int(total.get("GPU", 0)),
                control=CONTROL_RESOURCE in total,
            )
        )
    return sorted(nodes, key=lambda n: (n.name is None, n.name or "", n.node_id))
