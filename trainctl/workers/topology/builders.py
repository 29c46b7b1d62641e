"""Generators of the standard fabrics: the example maps in deploy/topologies, the benchmark fleets and
the named cluster presets (presets.py).

Link parameters are nominal datasheet figures (per GPU, per direction): NVLink 4 (H100) 450 GB/s,
NVLink 5 (GB200) 900 GB/s, one NVLink 2-4 link 25 GB/s, ConnectX-7 NDR 400 Gb/s = 50 GB/s, PCIe Gen4
x16 ~25 GB/s, PCIe Gen5 x16 ~50 GB/s (the same ~80 % of the 32 / 64 GB/s raw rate). The PCIe path
classes scale that rate (`pcie_levels`). Latencies are modelling assumptions (docs/placement.md).

    python -m trainctl.workers.topology.builders deploy/topologies   # regenerate the example maps
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from trainctl.workers.topology.model import (
    PCIE_PATHS,
    Fabric,
    LinkLevel,
    Metadata,
    Nic,
    Node,
    NvlinkDomain,
    Switch,
    TopologyMap,
    TopologySpec,
    simulated_topology,
)

PCIE_SCALE: dict[str, tuple[float, float]] = {
    "PIX": (1.0, 2.0), "PXB": (1.0, 2.5), "PHB": (0.8, 3.0), "NODE": (0.7, 3.5), "SYS": (0.4, 5.0),
}
"""PCIe path class -> (fraction of the x16 rate a GPU pair gets, latency µs): peer-to-peer through one
or several switches runs at the link rate; through the CPU's host bridge, and between host bridges,
it loses some; across the inter-socket link NCCL stages through host memory (docs/placement.md)."""
NodeLinks = tuple[list[tuple[int, int, int]], list[tuple[int, int, str]]]
"""A node's (nvlink_pairs, pcie_paths)."""
NicClasses = dict[int, str]
"""GPU -> PCIe path class to the NIC its traffic leaves through, for GPUs not at PIX."""
NVLINK_LINK_GBS = 25.0
"""One NVLink 2 / 3 / 4 link, per direction (V100: 6 links, A100: 12, H100: 18)."""


def pcie_levels(x16_gbs: float) -> dict[str, LinkLevel]:
    """`fabric.pcie` for GPUs on PCIe links of `x16_gbs` GB/s per direction."""
    return {
        path: LinkLevel(bandwidth_gbytes_per_s=x16_gbs * PCIE_SCALE[path][0], latency_us=PCIE_SCALE[path][1])
        for path in PCIE_PATHS
    }


def nic_levels(x16_gbs: float) -> dict[str, LinkLevel]:
    """`fabric.nic` for GPUs on PCIe links of `x16_gbs` GB/s: the route from a GPU to its NIC crosses the
    PCIe hierarchy as a GPU pair of that class does (`PCIE_SCALE`'s bandwidth), and pays the latency it
    adds over a PIX route (0 at PIX, the GPUDirect RDMA path the network levels' latencies assume)."""
    pix_latency = PCIE_SCALE["PIX"][1]
    return {
        path: LinkLevel(bandwidth_gbytes_per_s=x16_gbs * scale, latency_us=latency - pix_latency)
        for path, (scale, latency) in PCIE_SCALE.items()
    }


def _levels(
    nvlink_gbs: float | None, nic_gbs: float, oversub: float, host_gbs: float | None = None, pair_links: bool = False
) -> Fabric:
    return Fabric(
        nvlink=LinkLevel(bandwidth_gbytes_per_s=nvlink_gbs, latency_us=2.0) if nvlink_gbs else None,
        host=LinkLevel(bandwidth_gbytes_per_s=host_gbs, latency_us=3.0) if host_gbs else None,
        nvlink_pair=LinkLevel(bandwidth_gbytes_per_s=NVLINK_LINK_GBS, latency_us=2.0) if pair_links else None,
        pcie=pcie_levels(host_gbs) if pair_links and host_gbs else {},
        nic=nic_levels(host_gbs) if pair_links and host_gbs else {},
        leaf=LinkLevel(bandwidth_gbytes_per_s=nic_gbs, latency_us=4.0, oversubscription=oversub),
        spine=LinkLevel(bandwidth_gbytes_per_s=nic_gbs, latency_us=5.0, oversubscription=oversub),
        core=LinkLevel(bandwidth_gbytes_per_s=nic_gbs, latency_us=6.5),
    )


def rail_optimized_fleet(
    nodes: int,
    gpus_per_node: int = 8,
    su_nodes: int = 32,
    sus_per_pod: int = 4,
    oversubscription: float = 1.0,
    name: str = "h100-fleet",
    gpu_model: str = "H100-SXM5-80GB",
    nvlink_gbs: float | None = 450.0,
    nic_gbs: float = 50.0,
    host_gbs: float | None = None,
    gpus_per_nic: int = 1,
    links: Callable[[int], NodeLinks] | None = None,
    nic_classes: Callable[[int], NicClasses] | None = None,
) -> TopologyMap:
    """HGX nodes in scalable units of `su_nodes`, one rail leaf per NIC index per unit, units grouped
    `sus_per_pod` to a spine, pods joined by a core. `oversubscription` applies to leaf and spine uplinks.
    Each node is an NVLink domain, or has no NVLink domain with `nvlink_gbs` None (then `host_gbs` is
    its PCIe x16 rate, and `links(node index)` its per-pair links); a NIC serves `gpus_per_nic` GPUs
    (`nic_gbs` is per GPU); with per-pair links every GPU's NIC path is listed (`nic_classes(node
    index)`: the GPUs not at PIX)."""
    return _fleet(
        domains=[[f"{name}-n{i:04d}"] for i in range(nodes)],
        gpus_per_node=gpus_per_node,
        nodes_per_su=su_nodes,
        sus_per_pod=sus_per_pod,
        oversubscription=oversubscription,
        name=name,
        gpu_model=gpu_model,
        fabric=_levels(nvlink_gbs, nic_gbs, oversubscription, host_gbs, pair_links=links is not None),
        domain_name=(lambda i, members: f"nvl-{members[0]}") if nvlink_gbs else None,
        gpus_per_nic=gpus_per_nic,
        links=links,
        nic_classes=nic_classes or ((lambda i: {}) if links else None),
    )


def nvl72_fleet(
    racks: int,
    racks_per_su: int = 8,
    sus_per_pod: int = 4,
    oversubscription: float = 1.0,
    name: str = "gb200-nvl72",
) -> TopologyMap:
    """GB200 NVL72 racks (18 trays x 4 GPUs, one NVLink domain per rack), a 400G NIC per GPU on 4 rails."""
    trays = 18
    return _fleet(
        domains=[[f"{name}-r{r:03d}-t{t:02d}" for t in range(trays)] for r in range(racks)],
        gpus_per_node=4,
        nodes_per_su=racks_per_su * trays,
        sus_per_pod=sus_per_pod,
        oversubscription=oversubscription,
        name=name,
        gpu_model="GB200",
        fabric=_levels(900.0, 50.0, oversubscription),
        domain_name=lambda i, members: f"{name}-rack{i:03d}",
    )


def pcie_tree_links(gpus_per_node: int = 8, nvlinked: list[tuple[int, int, int]] | None = None) -> NodeLinks:
    """Pair links of a two-socket PCIe server: GPUs 2k and 2k+1 share a PCIe switch (PIX), a socket's
    switches share its switch tree (PXB), the sockets talk over the inter-socket link (SYS); pairs in
    `nvlinked` (a, b, links) have NVLink instead."""
    nvlinked = nvlinked or []
    bridged = {(a, b) for a, b, _ in nvlinked}
    socket = {g: g * 2 // gpus_per_node for g in range(gpus_per_node)}
    paths = [
        (a, b, "PIX" if a // 2 == b // 2 else "PXB" if socket[a] == socket[b] else "SYS")
        for a in range(gpus_per_node) for b in range(a + 1, gpus_per_node) if (a, b) not in bridged
    ]
    return nvlinked, paths


def bridged_pairs(gpus_per_node: int = 8, bridge_links: int = 12) -> NodeLinks:
    """`pcie_tree_links` with NVLink bridges on pairs 0-1, 2-3, ... (H100 NVL: 3 bridges = NV12)."""
    if gpus_per_node % 2:
        raise ValueError(f"bridged pairs need an even gpus_per_node, got {gpus_per_node}")
    return pcie_tree_links(gpus_per_node, [(g, g + 1, bridge_links) for g in range(0, gpus_per_node, 2)])


def bridged_pcie_fleet(
    nodes: int,
    gpus_per_node: int = 8,
    oversubscription: float = 1.0,
    name: str = "pcie-h100-nvl",
    gpu_model: str = "H100 NVL",
    bridge_links: int = 12,
) -> TopologyMap:
    """PCIe Gen5 servers whose GPUs are NVLink-bridged in pairs (0-1, 2-3, ...; `bridged_pairs`), one 400G
    NIC per pair behind the pair's PCIe switch, in `rail_optimized_fleet`'s switch tree. No NVLink
    domain: each pair's link is priced on its own (a bridge, or its PCIe path class)."""
    links = bridged_pairs(gpus_per_node, bridge_links)
    return rail_optimized_fleet(
        nodes, gpus_per_node, oversubscription=oversubscription, name=name, gpu_model=gpu_model,
        nvlink_gbs=None, nic_gbs=50.0 / 2, host_gbs=50.0, gpus_per_nic=2, links=lambda i: links,  # a pair shares a 400G NIC
    )


def mixed_pcie_fleet(nodes: int, su_nodes: int = 32, oversubscription: float = 1.0, name: str = "mixed-pcie") -> TopologyMap:
    """PCIe Gen5 servers of three kinds, one kind per scalable unit in turn: NVLink-bridged pairs
    (`bridged_pairs`), no NVLink at all (`pcie_tree_links`) with all four NICs in socket 0's slots (GPUs
    4-7 reach theirs across the sockets, SYS), and NVLink on GPUs 0-3 only (an NV4 mesh among them; GPUs
    4-7 on PCIe). A 400G NIC per GPU pair, as `bridged_pcie_fleet`."""
    kinds = (bridged_pairs(), pcie_tree_links(), pcie_tree_links(nvlinked=[(a, b, 4) for a in range(4) for b in range(a + 1, 4)]))
    far: tuple[NicClasses, ...] = ({}, {g: "SYS" for g in range(4, 8)}, {})
    return rail_optimized_fleet(
        nodes, 8, su_nodes=su_nodes, oversubscription=oversubscription, name=name, gpu_model="H100 NVL",
        nvlink_gbs=None, nic_gbs=50.0 / 2, host_gbs=50.0, gpus_per_nic=2, links=lambda i: kinds[i // su_nodes % 3],
        nic_classes=lambda i: far[i // su_nodes % 3],
    )


def _fleet(
    domains: list[list[str]],
    gpus_per_node: int,
    nodes_per_su: int,
    sus_per_pod: int,
    oversubscription: float,
    name: str,
    gpu_model: str,
    fabric: Fabric,
    domain_name: Callable[[int, list[str]], str] | None,
    gpus_per_nic: int = 1,
    links: Callable[[int], NodeLinks] | None = None,
    nic_classes: Callable[[int], NicClasses] | None = None,
) -> TopologyMap:
    """Nodes in groups (`domains`: NVLink domains named by `domain_name`, or, with None, nodes without
    NVLink), one 400G NIC per `gpus_per_nic` GPUs on its own rail, rail leaves per scalable unit of
    `nodes_per_su` nodes, `sus_per_pod` units to a spine, one core; `links(node index)` gives a node's
    (nvlink_pairs, pcie_paths), `nic_classes(node index)` its GPUs' NIC paths (then listed in `nic_paths`;
    a NIC's `gpus` are those it serves at PIX)."""
    rails = gpus_per_node // gpus_per_nic
    nodes: list[Node] = []
    nv_domains: list[NvlinkDomain] = []
    switches: list[Switch] = [Switch(name=f"{name}-core", tier="core")]
    total = sum(len(d) for d in domains)
    n_su = -(-total // nodes_per_su)
    n_pod = -(-n_su // sus_per_pod)
    switches += [Switch(name=f"{name}-pod{p}-spine", tier="spine", parent=f"{name}-core") for p in range(n_pod)]
    for su in range(n_su):
        pod = su // sus_per_pod
        switches += [
            Switch(name=f"{name}-su{su}-rail{r}", tier="leaf", rail=r, parent=f"{name}-pod{pod}-spine")
            for r in range(rails)
        ]
    index = 0
    for d, members in enumerate(domains):
        dname = domain_name(d, members) if domain_name else None
        if dname:
            nv_domains.append(NvlinkDomain(name=dname, nodes=members))
        for node_name in members:
            su = index // nodes_per_su
            far = nic_classes(index) if nic_classes else {}
            nics = [
                Nic(name=f"mlx5_{r}", rate_gbps=400.0, rail=r, leaf=f"{name}-su{su}-rail{r}",
                    gpus=[g for g in range(r * gpus_per_nic, (r + 1) * gpus_per_nic) if g not in far])
                for r in range(rails)
            ]
            nic_paths = [(g, f"mlx5_{g // gpus_per_nic}", far.get(g, "PIX")) for g in range(gpus_per_node)] if nic_classes else []
            numa = {g: g * 2 // gpus_per_node for g in range(gpus_per_node)}
            nvlink_pairs, pcie_paths = links(index) if links else ([], [])
            nodes.append(Node(
                name=node_name, gpus=list(range(gpus_per_node)), gpu_model=gpu_model, numa=numa, nvlink_domain=dname,
                nvlink_pairs=nvlink_pairs, pcie_paths=pcie_paths, nics=nics, nic_paths=nic_paths,
            ))
            index += 1
    desc = f"{total} nodes x {gpus_per_node} GPUs, {n_su} scalable units, {rails} rails, uplinks {oversubscription:g}:1"
    return TopologyMap(
        metadata=Metadata(name=name, description=desc),
        spec=TopologySpec(fabric=fabric, nvlink_domains=nv_domains, switches=switches, nodes=nodes),
    )


def pcie_servers(servers: int = 4, gpus_per_node: int = 8, name: str = "pcie-l40s") -> TopologyMap:
    """PCIe-only servers (no NVLink): two 200G NICs each, half the GPUs behind each, one ToR leaf."""
    nodes = []
    half = gpus_per_node // 2
    for i in range(servers):
        nics = [
            Nic(name="mlx5_0", rate_gbps=200.0, leaf=f"{name}-tor", gpus=list(range(half)), numa=0),
            Nic(name="mlx5_1", rate_gbps=200.0, leaf=f"{name}-tor", gpus=list(range(half, gpus_per_node)), numa=1),
        ]
        numa = {g: g * 2 // gpus_per_node for g in range(gpus_per_node)}
        nodes.append(Node(name=f"{name}-{i}", gpus=list(range(gpus_per_node)), gpu_model="L40S", numa=numa, nics=nics))
    per_gpu_nic = 2 * 25.0 / gpus_per_node
    return TopologyMap(
        metadata=Metadata(name=name, description=f"{servers} PCIe servers x {gpus_per_node} GPUs, one ToR switch"),
        spec=TopologySpec(
            fabric=Fabric(
                host=LinkLevel(bandwidth_gbytes_per_s=25.0, latency_us=3.0),
                leaf=LinkLevel(bandwidth_gbytes_per_s=per_gpu_nic, latency_us=5.0),
            ),
            switches=[Switch(name=f"{name}-tor", tier="leaf")],
            nodes=nodes,
        ),
    )


def example_maps() -> dict[str, TopologyMap]:
    """File name -> map, for deploy/topologies."""
    return {
        "dgx-h100-superpod-su.yaml": rail_optimized_fleet(32, name="dgx-h100-su"),
        "gb200-nvl72-2racks.yaml": nvl72_fleet(2, racks_per_su=2, name="gb200-nvl72"),
        "pcie-servers.yaml": pcie_servers(),
        "simulated-local.yaml": simulated_topology(4, 4),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m trainctl.workers.topology.builders OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for file, topology in example_maps().items():
        (out / file).write_text(f"# Generated by `python -m trainctl.workers.topology.builders {argv[0]}`.\n" + topology.to_yaml())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
