"""The topology map: the cluster's fabric as versioned YAML (`apiVersion: trainctl/v1, kind: TopologyMap`).

Inner to outer: GPU -> NVLink domain (one node, or a multi-node rack such as GB200 NVL72) -> host ->
leaf switch (one per rail in rail-optimized fabrics) -> spine -> core. Each level carries a bandwidth
per GPU per direction, a latency, and (for switch tiers) the oversubscription of its uplinks. Nodes list
their GPUs, NUMA affinity, NICs (device, rate, link layer, rail, nearest GPUs, the leaf they attach to)
and health. Pure pydantic + stdlib: the service loads maps without torch or Ray.

Inside a node outside any NVLink domain, GPU pairs may carry their own link: `nvlink_pairs` (NVLink
bridges, a V100 hybrid cube-mesh: dedicated links, priced per link by `fabric.nvlink_pair`) and
`pcie_paths` (the `nvidia-smi topo -m` path class PIX / PXB / PHB / NODE / SYS, priced by
`fabric.pcie`, falling back to `fabric.host`). A node in an NVLink domain has NVLink between every
pair of its GPUs; per-pair entries that say otherwise are refused naming the field.

GPU-NIC affinity: `nic_paths` gives, per GPU, the NIC its inter-node traffic leaves through and the
PCIe path class to it (PIX .. SYS, `nvidia-smi topo -m`'s NIC columns); `fabric.nic` prices the
classes (a cap on that GPU's inter-node bandwidth and a latency added to the network level's). A NIC's
`gpus` stay what they were: the GPUs it is nearest to (PIX / PXB), whose entries must agree.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainctl.spec import strict_yaml
from trainctl.spec.pydantic_violations import violations_from_pydantic

API_VERSION = "trainctl/v1"
KIND = "TopologyMap"
TIERS: tuple[str, ...] = ("leaf", "spine", "core")
"""Switch tiers, inner to outer."""

PCIE_PATHS: tuple[str, ...] = ("PIX", "PXB", "PHB", "NODE", "SYS")
"""PCIe path classes of `nvidia-smi topo -m`, best to worst: one PCIe switch, several bridges, through
the host bridge (CPU), across host bridges of one NUMA node, across the inter-socket link."""
PciePath = Literal["PIX", "PXB", "PHB", "NODE", "SYS"]
NEAR_NIC_PATHS: tuple[str, ...] = ("PIX", "PXB")
"""Classes at which a NIC is "nearest" to a GPU (`Nic.gpus`): PCIe bridges only, no host bridge, the
distance up to which NCCL uses GPUDirect RDMA by default."""

PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]


class TopologyError(ValueError):
    """A topology map that cannot be loaded or is inconsistent; the message names the node or level."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class LinkLevel(_Strict):
    """One level of the fabric as one GPU sees it."""

    bandwidth_gbytes_per_s: PositiveFloat
    """Bandwidth per GPU per direction at this level, GB/s (1e9 bytes/s)."""
    latency_us: Annotated[float, Field(ge=0)] = 1.0
    """One-way latency of a message crossing this level, microseconds."""
    oversubscription: Annotated[float, Field(ge=1)] = 1.0
    """Switch tiers: downlink / uplink bandwidth of a switch at this tier (1 = non-blocking; 2 = 2:1)."""


class Fabric(_Strict):
    """Per-level link parameters. Levels a map does not use may be omitted."""

    nvlink: LinkLevel | None = None
    """GPU to GPU inside one NVLink domain."""
    host: LinkLevel | None = None
    """GPU to GPU inside one node without NVLink between them (PCIe / SMP interconnect), for pairs whose
    PCIe path class is not given (node `pcie_paths`) or has no `pcie` entry."""
    nvlink_pair: LinkLevel | None = None
    """ONE NVLink link between a GPU pair outside an NVLink domain (bridge, cube-mesh); a pair with
    n bonded links (NV<n>) gets n times this bandwidth."""
    pcie: dict[PciePath, LinkLevel] = Field(default_factory=dict)
    """GPU to GPU inside one node per PCIe path class of `nvidia-smi topo -m` (PIX, PXB, PHB, NODE, SYS)."""
    nic: dict[PciePath, LinkLevel] = Field(default_factory=dict)
    """A GPU to the NIC its inter-node traffic leaves through, per PCIe path class (node `nic_paths`):
    the bandwidth caps that GPU's share of any group crossing nodes, the latency is added to the network
    level's. A class without an entry costs nothing (the NIC's rate, as in maps without affinities)."""
    leaf: LinkLevel | None = None
    """Through a NIC and one leaf switch; `oversubscription` is that of the leaf's uplinks."""
    spine: LinkLevel | None = None
    """Through leaf -> spine -> leaf; `oversubscription` is that of the spine's uplinks to the core."""
    core: LinkLevel | None = None
    """Through the core tier."""

    def level(self, name: str) -> LinkLevel | None:
        """The parameters of level `name` (nvlink, host, leaf, spine, core)."""
        return getattr(self, name)

    def pcie_level(self, path: str) -> LinkLevel | None:
        """Parameters of a PCIe path class: its `pcie` entry, else the `host` level."""
        return self.pcie.get(path) or self.host  # type: ignore[call-overload]


class Switch(_Strict):
    """A switch of the tree; leaves attach NICs, every other switch attaches switches of the tier below."""

    name: str = Field(min_length=1)
    """Unique switch name."""
    tier: Literal["leaf", "spine", "core"]
    """Tier in the tree."""
    parent: str | None = None
    """The switch of the next tier up this one's uplinks go to (None at the top of the tree)."""
    rail: NonNegativeInt | None = None
    """Leaves of rail-optimized fabrics: the rail this leaf serves (NIC k of every node of the unit)."""


class Nic(_Strict):
    """A network adapter port of a node."""

    name: str = Field(min_length=1)
    """Device name, e.g. mlx5_0."""
    rate_gbps: PositiveFloat = 400.0
    """Port rate, Gb/s."""
    link_layer: Literal["InfiniBand", "Ethernet"] = "InfiniBand"
    """Link layer of the port."""
    state: str = "Active"
    """Port state as the driver reports it (Active, Down, ...)."""
    rail: NonNegativeInt | None = None
    """Rail index in rail-optimized fabrics."""
    leaf: str | None = None
    """Name of the leaf switch the port is cabled to."""
    gpus: list[NonNegativeInt] = Field(default_factory=list)
    """GPUs this NIC is nearest to (PIX / PXB in `nvidia-smi topo -m`)."""
    numa: int | None = None
    """NUMA node of the NIC, when known."""


class Node(_Strict):
    """One host."""

    name: str = Field(min_length=1)
    """Unique node name (the `trainctl.io/node` Ray label)."""
    gpus: list[NonNegativeInt] = Field(default_factory=list)
    """Local GPU indices (CUDA ordinal)."""
    gpu_model: str | None = None
    """GPU product name, informational."""
    numa: dict[NonNegativeInt, int] = Field(default_factory=dict)
    """GPU index -> NUMA node it is attached to."""
    nvlink_domain: str | None = None
    """The NVLink domain this node's GPUs belong to (None: GPUs talk over PCIe only)."""
    nvlink_pairs: list[tuple[NonNegativeInt, NonNegativeInt, NonNegativeInt]] = Field(default_factory=list)
    """NVLink pairs (gpu a, gpu b, bonded link count), a < b. Outside an NVLink domain these are the
    node's only NVLinks (bridges, cube-mesh) and are priced per link; in a domain they must cover
    every pair of the node's GPUs."""
    pcie_paths: list[tuple[NonNegativeInt, NonNegativeInt, PciePath]] = Field(default_factory=list)
    """PCIe path class (PIX, PXB, PHB, NODE, SYS) of GPU pairs (a, b), a < b, without NVLink between
    them; pairs not listed use `fabric.host`. Not allowed on a node of an NVLink domain."""
    nics: list[Nic] = Field(default_factory=list)
    """Network adapters."""
    nic_paths: list[tuple[NonNegativeInt, str, PciePath]] = Field(default_factory=list)
    """(gpu, NIC name, PCIe path class): the NIC each listed GPU's inter-node traffic leaves through and
    the path to it (PIX / PXB only for a NIC listing the GPU in its `gpus`). GPUs not listed use their
    nearest NIC (`nics[].gpus`) at class PXB, the farthest class `gpus` admits."""
    health: Literal["healthy", "unhealthy"] = "healthy"
    """An unhealthy node gets no ranks."""
    failed_gpus: list[NonNegativeInt] = Field(default_factory=list)
    """GPUs of a healthy node that get no ranks (XID errors, ECC, ...)."""

    @property
    def healthy(self) -> bool:
        return self.health == "healthy"

    @property
    def usable_gpus(self) -> list[int]:
        """GPUs that may get ranks: none on an unhealthy node, else those not failed."""
        if not self.healthy:
            return []
        failed = set(self.failed_gpus)
        return [g for g in self.gpus if g not in failed]

    def nic_of(self, gpu: int) -> Nic | None:
        """The NIC a GPU's inter-node traffic leaves through (`nic_path`)."""
        found = self.nic_path(gpu)
        return found[0] if found else None

    def nic_path(self, gpu: int) -> tuple[Nic, str] | None:
        """The NIC a GPU's inter-node traffic leaves through and the PCIe path class to it.

        The GPU's `nic_paths` entry when its NIC is active; else, among the active NICs listing the GPU
        as nearest (class PXB): GPUs that share the same NICs (two GPUs and two NICs behind one PCIe
        switch on a DGX A100) take them in order, the k-th GPU the k-th NIC. None: no NIC carries it.
        """
        for g, name, path in self.nic_paths:
            if g == gpu:
                nic = next(n for n in self.nics if n.name == name)
                if nic.state == "Active":
                    return nic, path
        candidates = [nic for nic in self.nics if gpu in nic.gpus and nic.state == "Active"]
        if not candidates:
            return None
        peers = sorted({g for nic in candidates for g in nic.gpus})
        return candidates[peers.index(gpu) % len(candidates)], "PXB"

    @model_validator(mode="after")
    def _check(self) -> Node:
        where = f"node {self.name!r}"
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"{where}: duplicate GPU indices {sorted(self.gpus)}")
        known = set(self.gpus)
        for label, indices in (("numa", self.numa), ("failed_gpus", self.failed_gpus)):
            unknown = sorted(set(indices) - known)
            if unknown:
                raise ValueError(f"{where}: {label} names GPUs {unknown} the node does not have")
        names = [n.name for n in self.nics]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: duplicate NIC names {names}")
        for nic in self.nics:
            unknown = sorted(set(nic.gpus) - known)
            if unknown:
                raise ValueError(f"{where}: NIC {nic.name!r} lists GPUs {unknown} the node does not have")
        for a, b, links in self.nvlink_pairs:
            if a not in known or b not in known or a >= b or links < 1:
                raise ValueError(f"{where}: invalid NVLink pair ({a}, {b}, {links}): need known GPUs a < b, links >= 1")
        for a, b, path in self.pcie_paths:
            if a not in known or b not in known or a >= b:
                raise ValueError(f"{where}: pcie_paths entry ({a}, {b}, {path}): need known GPUs a < b")
        nvlinked = [(a, b) for a, b, _ in self.nvlink_pairs]
        pcie = [(a, b) for a, b, _ in self.pcie_paths]
        for label, pairs in (("nvlink_pairs", nvlinked), ("pcie_paths", pcie)):
            if len(set(pairs)) != len(pairs):
                raise ValueError(f"{where}: {label} lists a GPU pair more than once")
        both = sorted(set(nvlinked) & set(pcie))
        if both:
            raise ValueError(f"{where}: GPU pairs {both} are in both nvlink_pairs and pcie_paths; a pair has one link")
        self._check_nic_paths(where, known)
        return self

    def _check_nic_paths(self, where: str, known: set[int]) -> None:
        """Each entry names a GPU and NIC of the node, each GPU once, and agrees with the NICs' `gpus`."""
        nics = {n.name: n for n in self.nics}
        listed: set[int] = set()
        for gpu, name, path in self.nic_paths:
            entry = f"{where}: nic_paths entry ({gpu}, {name!r}, {path})"
            if gpu not in known:
                raise ValueError(f"{entry}: the node has no GPU {gpu}")
            if name not in nics:
                raise ValueError(f"{entry}: the node has no NIC {name!r} (nics: {sorted(nics)})")
            if gpu in listed:
                raise ValueError(f"{entry}: GPU {gpu} is listed more than once; a GPU's traffic leaves through one NIC")
            listed.add(gpu)
            near = sorted(n.name for n in self.nics if gpu in n.gpus)
            if near and (name not in near or path not in NEAR_NIC_PATHS):
                raise ValueError(
                    f"{entry}: NICs {near} list GPU {gpu} among their nearest GPUs (nics[].gpus: PIX or PXB), "
                    f"so its NIC is one of them at PIX or PXB"
                )
            if not near and path in NEAR_NIC_PATHS:
                raise ValueError(f"{entry}: {path} makes GPU {gpu} near NIC {name!r}, but that NIC's gpus do not list it")

    def missing_nvlink_pairs(self) -> list[tuple[int, int]]:
        """Pairs of GPUs not failed that `nvlink_pairs` leaves without NVLink (all when it is empty)."""
        linked = {(a, b) for a, b, _ in self.nvlink_pairs}
        gpus = sorted(set(self.gpus) - set(self.failed_gpus))
        return [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1 :] if (a, b) not in linked]


class Partition(_Strict):
    """A slice of an NVLink domain (e.g. an NVL72 rack cut into isolated NVLink partitions)."""

    name: str = Field(min_length=1)
    """Partition name, unique within the map."""
    nodes: list[str] = Field(min_length=1)
    """Nodes in the partition."""


class NvlinkDomain(_Strict):
    """GPUs that reach each other over NVLink: one node (HGX) or many (NVL72 rack)."""

    name: str = Field(min_length=1)
    """Unique domain name."""
    nodes: list[str] = Field(min_length=1)
    """Nodes whose GPUs form the domain."""
    partitions: list[Partition] = Field(default_factory=list)
    """Optional isolated partitions; when present, NVLink reaches only within a partition."""


class Metadata(_Strict):
    name: str = Field(min_length=1)
    """Map name."""
    description: str = ""
    """Free text."""


class TopologySpec(_Strict):
    fabric: Fabric
    """Per-level bandwidth, latency, oversubscription."""
    nvlink_domains: list[NvlinkDomain] = Field(default_factory=list)
    """NVLink domains; a node not in any has no NVLink."""
    switches: list[Switch] = Field(default_factory=list)
    """The switch tree."""
    nodes: list[Node] = Field(min_length=1)
    """The hosts."""


class TopologyMap(_Strict):
    """A versioned, validated map of the cluster fabric."""

    apiVersion: Literal["trainctl/v1"] = API_VERSION  # noqa: N815 - Kubernetes-style key
    """Always trainctl/v1."""
    kind: Literal["TopologyMap"] = KIND
    """Always TopologyMap."""
    metadata: Metadata
    """Name and description."""
    spec: TopologySpec
    """The fabric."""

    @property
    def nodes(self) -> list[Node]:
        return list(self.spec.nodes)

    @cached_property
    def nodes_by_name(self) -> dict[str, Node]:
        """Every node by name (built on first use: a map is frozen, and a fleet's has thousands of nodes)."""
        return {node.name: node for node in self.spec.nodes}

    def node(self, name: str) -> Node:
        """The node called `name` (KeyError naming it when absent)."""
        try:
            return self.nodes_by_name[name]
        except KeyError:
            raise KeyError(f"node {name!r} is not in topology map {self.metadata.name!r}") from None

    def switch(self, name: str) -> Switch:
        for switch in self.spec.switches:
            if switch.name == name:
                return switch
        raise KeyError(f"switch {name!r} is not in topology map {self.metadata.name!r}")

    @cached_property
    def nvlink_groups(self) -> dict[str, str]:
        """Each node's NVLink reach (`nvlink_group_of`), for the nodes in an NVLink domain."""
        groups: dict[str, str] = {}
        for domain in self.spec.nvlink_domains:
            partition_of: dict[str, str] = {}
            for part in domain.partitions:
                for node in part.nodes:
                    partition_of.setdefault(node, part.name)
            for node in domain.nodes:
                if node not in groups:  # the first domain naming a node, as a scan in map order finds
                    groups[node] = f"{domain.name}/{partition_of[node]}" if node in partition_of else domain.name
        return groups

    def nvlink_group_of(self, node: str) -> str | None:
        """The NVLink reach of a node: its partition if the domain is partitioned, else its domain."""
        return self.nvlink_groups.get(node)

    def to_yaml(self) -> str:
        body = self.model_dump(mode="json", exclude_defaults=True)
        return yaml.safe_dump({"apiVersion": self.apiVersion, "kind": self.kind, **body}, sort_keys=False)

    @model_validator(mode="after")
    def _check(self) -> TopologyMap:
        _check_map(self.spec)
        return self


def _unique(kind: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{kind} name {name!r} is used more than once; names must be unique")
        seen.add(name)


def _check_map(spec: TopologySpec) -> None:
    """Cross-object rules: unique names, strict nesting of the tree, consistent rails, levels present."""
    _unique("node", [n.name for n in spec.nodes])
    _unique("switch", [s.name for s in spec.switches])
    _unique("NVLink domain", [d.name for d in spec.nvlink_domains])
    switches = {s.name: s for s in spec.switches}
    nodes = {n.name: n for n in spec.nodes}
    # Strict nesting of the switch tree: each switch's parent exists and is exactly one tier up.
    for sw in spec.switches:
        if sw.rail is not None and sw.tier != "leaf":
            raise ValueError(f"switch {sw.name!r} ({sw.tier}): only leaf switches carry a rail")
        if sw.parent is None:
            continue
        parent = switches.get(sw.parent)
        if parent is None:
            raise ValueError(f"switch {sw.name!r} ({sw.tier}): parent {sw.parent!r} is not a switch of the map")
        if TIERS.index(parent.tier) != TIERS.index(sw.tier) + 1:
            raise ValueError(
                f"switch {sw.name!r} ({sw.tier}): parent {parent.name!r} is a {parent.tier} switch; "
                f"a {sw.tier} switch's parent must be one tier up ({TIERS[TIERS.index(sw.tier) + 1] if sw.tier != 'core' else 'none'})"
            )
    if len(spec.nodes) > 1 and not any(spec.fabric.level(t) for t in TIERS):
        raise ValueError("fabric: the map has several nodes but no network level (leaf, spine or core)")
    tiers_used = {s.tier for s in spec.switches}
    for tier in tiers_used:
        if spec.fabric.level(tier) is None:
            raise ValueError(f"level {tier!r}: the map has {tier} switches but fabric.{tier} is not given")
    roots = {_root(switches, s.name) for s in spec.switches if s.tier == "leaf"}
    if len(roots) > 1:
        raise ValueError(f"switch tree: leaves reach {len(roots)} separate tops {sorted(roots)}; the tree must have one root")
    # NVLink domains: each node in at most one; nodes exist; partitions nest inside their domain.
    in_domain: dict[str, str] = {}
    for domain in spec.nvlink_domains:
        where = f"NVLink domain {domain.name!r}"
        for name in domain.nodes:
            if name not in nodes:
                raise ValueError(f"{where}: node {name!r} is not in the map")
            if name in in_domain:
                raise ValueError(f"node {name!r} is in two NVLink domains: {in_domain[name]!r} and {domain.name!r}")
            in_domain[name] = domain.name
            if nodes[name].nvlink_domain not in (None, domain.name):
                raise ValueError(f"node {name!r}: nvlink_domain {nodes[name].nvlink_domain!r} but listed in {where}")
        covered: set[str] = set()
        for part in domain.partitions:
            outside = sorted(set(part.nodes) - set(domain.nodes))
            if outside:
                raise ValueError(f"{where}: partition {part.name!r} has nodes {outside} outside the domain")
            overlap = sorted(covered & set(part.nodes))
            if overlap:
                raise ValueError(f"{where}: nodes {overlap} are in more than one partition")
            covered |= set(part.nodes)
    if in_domain and spec.fabric.nvlink is None:
        raise ValueError("level 'nvlink': the map has NVLink domains but fabric.nvlink is not given")
    for node in spec.nodes:
        where = f"node {node.name!r}"
        if node.nvlink_domain is not None and in_domain.get(node.name) != node.nvlink_domain:
            raise ValueError(f"{where}: nvlink_domain {node.nvlink_domain!r} is not an NVLink domain listing this node")
        _check_pair_links(spec.fabric, node, in_domain.get(node.name))
        for nic in node.nics:
            if nic.leaf is None:
                continue
            leaf = switches.get(nic.leaf)
            if leaf is None:
                raise ValueError(f"{where}: NIC {nic.name!r} is cabled to {nic.leaf!r}, which is not a switch of the map")
            if leaf.tier != "leaf":
                raise ValueError(f"{where}: NIC {nic.name!r} is cabled to {leaf.name!r}, a {leaf.tier} switch, not a leaf")
            if leaf.rail is not None and nic.rail != leaf.rail:
                raise ValueError(
                    f"{where}: NIC {nic.name!r} has rail {nic.rail} but is cabled to leaf {leaf.name!r} of rail {leaf.rail}"
                )
        rails = [nic.rail for nic in node.nics if nic.rail is not None]
        if len(set(rails)) != len(rails):
            raise ValueError(f"{where}: rails {rails} repeat; each NIC of a node serves a different rail")
    _check_domain_nesting(spec, nodes)


def _check_pair_links(fabric: Fabric, node: Node, domain: str | None) -> None:
    """Per-pair links agree with the node's NVLink domain, and every link the node uses is priced."""
    where = f"node {node.name!r}"
    if domain is not None:
        missing = node.missing_nvlink_pairs() if node.nvlink_pairs else []
        if missing:
            raise ValueError(
                f"{where}: nvlink_pairs leaves GPU pairs {missing[:4]}{' ...' if len(missing) > 4 else ''} without "
                f"NVLink, but the node is in NVLink domain {domain!r}, where every GPU pair has NVLink; "
                "take the node out of the domain to price its pairs one by one"
            )
        if node.pcie_paths:
            raise ValueError(
                f"{where}: pcie_paths gives PCIe paths between GPUs of NVLink domain {domain!r}, whose GPU pairs "
                "all have NVLink; take the node out of the domain to price its pairs one by one"
            )
        return
    if node.nvlink_pairs and fabric.nvlink_pair is None:
        raise ValueError(f"{where}: nvlink_pairs outside an NVLink domain need fabric.nvlink_pair (one link's bandwidth)")
    for path in sorted({p for _, _, p in node.pcie_paths}):
        if fabric.pcie_level(path) is None:
            raise ValueError(f"{where}: pcie_paths uses {path} but neither fabric.pcie.{path} nor fabric.host is given")
    covered = len(node.nvlink_pairs) + len(node.pcie_paths)
    if covered < len(node.gpus) * (len(node.gpus) - 1) // 2 and fabric.host is None:
        raise ValueError(f"{where}: GPUs without NVLink need fabric.host (the PCIe level) to be given")


def _root(switches: dict[str, Switch], name: str) -> str:
    while switches[name].parent is not None:
        name = switches[name].parent  # type: ignore[assignment]
    return name


def _check_domain_nesting(spec: TopologySpec, nodes: dict[str, Node]) -> None:
    """A multi-node NVLink domain sits under one set of leaves (its nodes share rails and leaves)."""
    for domain in spec.nvlink_domains:
        leafsets = {frozenset((nic.rail, nic.leaf) for nic in nodes[n].nics if nic.leaf) for n in domain.nodes}
        if len(leafsets) > 1:
            raise ValueError(
                f"NVLink domain {domain.name!r}: its nodes are cabled to different leaf switches / rails; "
                "a domain must nest inside one set of leaves"
            )


def parse_topology(data: object, source: str = "<topology>") -> TopologyMap:
    """Validate a parsed YAML document as a TopologyMap; TopologyError names what is wrong."""
    if not isinstance(data, dict):
        raise TopologyError(f"{source}: a topology map is a YAML mapping, got {type(data).__name__}")
    try:
        return TopologyMap.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(map(str, violations_from_pydantic(err, root="<map>")))
        raise TopologyError(f"{source}: {problems}") from None


def load_topology(path: str | Path) -> TopologyMap:
    """Load and validate a topology map from a YAML file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise TopologyError(f"{path}: cannot read topology map: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise TopologyError(f"{path}: not a topology map: not UTF-8 text (byte {err.start})") from None
    try:
        data = strict_yaml.load(text, fast=True)
    except yaml.YAMLError as err:
        raise TopologyError(f"{path}: not valid YAML: {err}") from None
    return parse_topology(data, str(path))


def simulated_topology(nodes: int, gpus_per_node: int) -> TopologyMap:
    """The embedded default: node-0.., one NVLink domain per node, one NIC per node on one leaf switch.

    Link parameters are those of an HGX H100 node (NVLink 450 GB/s per direction, 400 Gb/s NDR NICs),
    so plans made on a laptop read like plans on the real thing.
    """
    if nodes < 1 or gpus_per_node < 1:
        raise TopologyError(f"simulated topology needs nodes >= 1 and gpus_per_node >= 1, got {nodes} x {gpus_per_node}")
    node_list = []
    domains = []
    for i in range(nodes):
        name = f"node-{i}"
        gpus = list(range(gpus_per_node))
        node_list.append(
            Node(
                name=name,
                gpus=gpus,
                gpu_model="simulated",
                nvlink_domain=f"nvl-{name}",
                nics=[Nic(name="sim0", rate_gbps=400.0, leaf="leaf-0", gpus=gpus)],
            )
        )
        domains.append(NvlinkDomain(name=f"nvl-{name}", nodes=[name]))
    return TopologyMap(
        metadata=Metadata(name="simulated", description=f"simulated {nodes} x {gpus_per_node} GPUs"),
        spec=TopologySpec(
            fabric=Fabric(
                nvlink=LinkLevel(bandwidth_gbytes_per_s=450.0, latency_us=2.0),
                leaf=LinkLevel(bandwidth_gbytes_per_s=50.0, latency_us=5.0),
            ),
            nvlink_domains=domains,
            switches=[Switch(name="leaf-0", tier="leaf")],
            nodes=node_list,
        ),
    )
