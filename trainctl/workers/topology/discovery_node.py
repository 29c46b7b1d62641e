"""Build one node's topology entry from discovery outputs, and turn it into Ray node labels.

NVLink: a node is an NVLink domain when NVLink joins every pair of its GPUs (NVSwitch, or a full
mesh) or its GPUs report a fabric clique (multi-node NVLink); a GPU whose NVLinks are all inactive
there is marked failed. Otherwise the node keeps its NVLink pairs (bridges, a cube-mesh) and the PCIe
path class of every other pair, and placement prices each pair by its own link.

Rails: NICs that are nearest (PIX / PXB) to at least one GPU, or that some GPU's traffic leaves
through (its best NIC, below), are compute NICs, numbered 0.. in the order of the lowest GPU they serve
(on a DGX/HGX that is rail k for GPU k); other NICs (storage, management) get no rail. Rails are
confirmed or overridden by the switch tree at merge.

NIC affinity: every GPU gets the NIC at its best PCIe path class in the matrix's NIC columns, with that
class (`nic_paths`), so a GPU with no NIC at PIX / PXB still has its traffic priced through the NIC it
would use (NODE or SYS away).
"""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

from trainctl.workers.topology.discovery import (
    DiscoveryError,
    FabricInfo,
    IbPort,
    NvlinkStatus,
    TopoMatrix,
    parse_fabric_query,
    parse_nvlink_status,
    parse_topo_matrix,
    read_ib_sysfs,
)
from trainctl.workers.topology.model import Nic, Node

LABEL_PREFIX = "trainctl.io/"
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")


def build_node(
    name: str,
    matrix: TopoMatrix,
    nvlink: list[NvlinkStatus] | None = None,
    ib_ports: list[IbPort] | None = None,
    fabric: list[FabricInfo] | None = None,
    gpu_model: str | None = None,
) -> Node:
    """The node entry: GPUs, NUMA, NVLink pairs and domain (or the per-pair links), NICs with rails,
    rates, states and nearest GPUs."""
    pairs = matrix.nvlink_pairs()
    inactive: list[int] = []
    if nvlink:
        inactive = sorted(s.gpu for s in nvlink if s.active_links == 0)
        pairs = [p for p in pairs if p[0] not in inactive and p[1] not in inactive]
        gpu_model = gpu_model or nvlink[0].name
    linked = [g for g in matrix.gpus if g not in inactive]
    complete = len(linked) > 1 and len(pairs) == len(linked) * (len(linked) - 1) // 2
    domain = _domain(name, complete, fabric)
    ports = {p.device: p for p in ib_ports or [] if p.port == 1}
    nic_paths = matrix.nic_paths()
    serves: dict[str, list[int]] = {}
    for gpu, device, _ in nic_paths:
        serves.setdefault(device, []).append(gpu)
    for device in matrix.nics:
        serves.setdefault(device, []).extend(matrix.nearest_gpus(device))
    compute = sorted((n for n in matrix.nics if serves[n]), key=lambda n: (min(serves[n]), n))
    nics = []
    for device in matrix.nics:
        port = ports.get(device)
        nics.append(
            Nic(
                name=device,
                rate_gbps=port.rate_gbps if port and port.rate_gbps else 400.0,
                link_layer=port.link_layer if port and port.link_layer else "InfiniBand",
                state=(port.state or "ACTIVE").capitalize() if port else "Active",
                rail=compute.index(device) if device in compute else None,
                gpus=matrix.nearest_gpus(device),
            )
        )
    numa = {g: n for g in matrix.gpus if (n := matrix.numa_of(g)) is not None}
    return Node(
        name=name,
        gpus=list(matrix.gpus),
        gpu_model=gpu_model,
        numa=numa,
        nvlink_domain=domain,
        nvlink_pairs=pairs if domain is None or complete else [],
        pcie_paths=matrix.pcie_paths() if domain is None else [],
        nics=nics,
        nic_paths=nic_paths,
        failed_gpus=inactive if domain is not None else [],
    )


def _domain(name: str, complete: bool, fabric: list[FabricInfo] | None) -> str | None:
    """Multi-node NVLink (a registered fabric clique) names the domain after the clique; NVLink between
    every pair of the node's (active) GPUs makes the node its own domain; else there is none."""
    domains = {f.domain for f in fabric or []}
    if len(domains) > 1:
        raise DiscoveryError(f"node {name!r}: GPUs report different NVLink fabric cliques {sorted(map(str, domains))}")
    if domains and None not in domains:
        return domains.pop()
    return f"nvl-{name}" if complete else None


def node_labels(node: Node) -> dict[str, str]:
    """Ray node labels (Kubernetes label syntax) that carry what placement needs to pin ranks."""
    labels = {
        f"{LABEL_PREFIX}node": node.name,
        f"{LABEL_PREFIX}gpus": str(len(node.gpus)),
        f"{LABEL_PREFIX}nvlink-domain": node.nvlink_domain or "none",
    }
    if node.gpu_model:
        labels[f"{LABEL_PREFIX}gpu-model"] = re.sub(r"[^A-Za-z0-9_.-]+", "-", node.gpu_model).strip("-_.")[:63]
    for gpu in node.gpus:
        nic = node.nic_of(gpu)
        if nic is not None and nic.rail is not None:
            labels[f"{LABEL_PREFIX}rail-gpu{gpu}"] = str(nic.rail)
        if gpu in node.numa:
            labels[f"{LABEL_PREFIX}numa-gpu{gpu}"] = str(node.numa[gpu])
    for key, value in labels.items():
        if not _LABEL_VALUE.match(value):
            raise DiscoveryError(f"node {node.name!r}: label {key}={value!r} is not a valid label value")
    return labels


def _run(args: list[str]) -> str:
    try:
        return subprocess.run(args, check=True, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise DiscoveryError(f"`{' '.join(args)}` failed: {err}") from None


def discover_local_node(name: str, ib_root: str | Path = "/sys/class/infiniband") -> Node:
    """Run the discovery commands on this machine and build its node entry (needs nvidia-smi)."""
    matrix = parse_topo_matrix(_run(["nvidia-smi", "topo", "-m"]), "nvidia-smi topo -m")
    nvlink = parse_nvlink_status(_run(["nvidia-smi", "nvlink", "-s"]), "nvidia-smi nvlink -s") if matrix.nvlink_pairs() else None
    try:
        fabric = parse_fabric_query(
            _run(["nvidia-smi", "--query-gpu=index,fabric.clusterUuid,fabric.cliqueId", "--format=csv"]),
            "fabric query",
        )
    except DiscoveryError:
        fabric = None  # drivers before fabric support: single-node NVLink only
    ports = read_ib_sysfs(ib_root) if Path(ib_root).is_dir() else None
    return build_node(name, matrix, nvlink, ports, fabric)


def discover_and_label(name: str | None = None) -> dict[str, object]:
    """On a Ray node (e.g. as a task pinned there): discover it; return its entry and its labels.

    The node is named `name`, or the host name (the name the map and the `trainctl.io/node` label use).
    Ray fixes a node's labels when the node starts, so the same labels are what the node's start
    command passes (`ray start --labels-file`, or the KubeRay group's rayStartParams); this routine
    also reports whether the running node already carries them.
    """
    import ray  # lazily: the topology package imports without Ray

    context = ray.get_runtime_context()
    node = discover_local_node(name or socket.gethostname())
    labels = node_labels(node)
    current = context.get_node_labels()
    missing = {k: v for k, v in labels.items() if current.get(k) != v}
    return {"node": node.model_dump(mode="json"), "labels": labels, "labels_missing_on_node": missing}
