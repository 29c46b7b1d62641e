"""NCCL environment hints derived from the topology map, for the ranks on one node.

- `NCCL_IB_HCA`: exactly the node's active compute NICs (those nearest to a GPU, or named as a GPU's
  NIC in `nic_paths`), port 1, in rail order, so storage / management adapters carry no collective traffic.
- `NCCL_CROSS_NIC=0` on rail-optimized fabrics: rings and trees keep to one rail between nodes
  (the placement keeps data-parallel and pipeline peers same-rail for this reason).
- `NCCL_MNNVL_ENABLE=1` when the node's NVLink domain spans nodes (GB200 NVL72): use multi-node NVLink.
"""

from __future__ import annotations

from trainctl.workers.topology.model import TopologyMap


def nccl_env(topology: TopologyMap, node: str) -> dict[str, str]:
    """Environment variables for NCCL on `node` (KeyError naming the node when it is not in the map)."""
    entry = topology.node(node)
    env: dict[str, str] = {}
    named = {name for _, name, _ in entry.nic_paths}
    compute = sorted(
        (nic for nic in entry.nics if (nic.gpus or nic.name in named) and nic.state == "Active"),
        key=lambda nic: (nic.rail if nic.rail is not None else 1 << 30, nic.name),
    )
    if compute:
        env["NCCL_IB_HCA"] = "=" + ",".join(f"{nic.name}:1" for nic in compute)
    if any(sw.rail is not None for sw in topology.spec.switches if sw.tier == "leaf"):
        env["NCCL_CROSS_NIC"] = "0"
    for domain in topology.spec.nvlink_domains:
        if node in domain.nodes and len(domain.nodes) > 1:
            env["NCCL_MNNVL_ENABLE"] = "1"
    return env
