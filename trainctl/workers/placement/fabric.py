"""A topology map compiled for placement: integer ids, containers, and the level a group of GPUs spans.

Levels, inner to outer: `nvlink` (one NVLink domain or partition), the pair levels of one node
outside an NVLink domain (`nvlink_pair`, `PIX`, `PXB`, `PHB`, `NODE`, `SYS`: pair_links.py), `host`
(one node, PCIe between its GPUs), `leaf`, `spine`, `core`. A group inside one node with per-pair
links gets what its best ring through them gets (`PairLinks.ring`). A group that spans nodes reaches
the `leaf` level only when it is rail-aligned: every node contributes the same multiset of rails, and
for each rail all members sit under one leaf. Otherwise its traffic meets at the lowest common switch
of all its members' leaves. Its bandwidth is also capped by the ring through its members inside each
node with per-pair links (a ring enters and leaves a node once, crossing those members on the way),
and by the PCIe path of each member to its NIC (`fabric.nic`): every member's traffic leaves through
its own NIC, so the group gets no more than its worst-placed member's path and pays that path's latency.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from trainctl.workers.placement.pair_links import PAIR_LEVELS, Link, PairLinks
from trainctl.workers.topology.model import TIERS, LinkLevel, TopologyMap

LEVELS: tuple[str, ...] = ("nvlink", *PAIR_LEVELS, *TIERS)
"""Fabric levels, inner to outer: within a node (NVLink domain, pair links, host), then the switch tiers."""

SlotId = tuple[int, int]
"""A GPU by (node id in the `FabricIndex`, local GPU index)."""


@dataclass
class FabricIndex:
    """Integer-indexed view of a `TopologyMap`; built once per map, read by the cost model and solver."""

    topology: TopologyMap
    node_names: list[str] = field(default_factory=list)
    node_id: dict[str, int] = field(default_factory=dict)
    node_gpus: list[list[int]] = field(default_factory=list)
    """Usable GPUs per node (healthy nodes, failed GPUs left out)."""
    node_unit: list[int] = field(default_factory=list)
    """NVLink reach of each node (domain or partition id); nodes without NVLink get a unit of their own."""
    unit_has_nvlink: list[bool] = field(default_factory=list)
    unit_nodes: list[list[int]] = field(default_factory=list)
    node_leafset: list[int] = field(default_factory=list)
    """Id of the set of leaves a node is cabled to (a scalable unit in rail-optimized fabrics)."""
    node_spineset: list[int] = field(default_factory=list)
    leafset_nodes: list[list[int]] = field(default_factory=list)
    spineset_leafsets: list[list[int]] = field(default_factory=list)
    gpu_leaf: dict[SlotId, int] = field(default_factory=dict)
    """Leaf switch id of each GPU's NIC (-1 - node id when the GPU has no cabled NIC)."""
    gpu_rail: dict[SlotId, int] = field(default_factory=dict)
    """Rail of each GPU's NIC (-1 when not rail-optimized)."""
    leaf_spine: dict[int, int] = field(default_factory=dict)
    """Spine id above each leaf (-1 when none)."""
    leaf_ports: Counter[int] = field(default_factory=Counter)
    """GPUs whose traffic enters each leaf."""
    spine_ports: Counter[int] = field(default_factory=Counter)
    level_bw: dict[str, float] = field(default_factory=dict)
    """Bytes/s per GPU per direction of a group spanning each level (network levels: slowest on the path)."""
    level_latency: dict[str, float] = field(default_factory=dict)
    """Seconds."""
    oversub: dict[str, float] = field(default_factory=dict)
    """Uplink oversubscription of the leaf and spine tiers."""
    level_capacity: dict[str, int] = field(default_factory=dict)
    """Most GPUs any one unit of each level holds (lower-bound reasoning)."""
    outermost: str = "host"
    """The outermost level the map defines (what a group with no common switch pays)."""
    unit_bw_seen: dict[tuple[int, int], float | None] = field(default_factory=dict)
    """Memo of `unit_bandwidth` by (group size, stride)."""
    plain_capacity: int = 0
    """Most usable GPUs of a node with neither an NVLink domain nor per-pair links (0: none)."""
    node_links: list[int] = field(default_factory=list)
    """Per node, its table in `pair_tables` (-1: in an NVLink domain, or no per-pair links)."""
    pair_tables: list[PairLinks] = field(default_factory=list)
    gpu_nic: dict[SlotId, tuple[float, float]] = field(default_factory=dict)
    """(bytes/s cap, added seconds) of each GPU's path to its NIC, for GPUs whose class `fabric.nic`
    prices (empty on maps that price none: NVLink fleets, maps without affinities)."""
    nic_best: tuple[float, float] = (float("inf"), 0.0)
    """The best NIC path any usable GPU of the map has (lower-bound reasoning)."""

    @classmethod
    def build(cls, topology: TopologyMap) -> FabricIndex:
        index = cls(topology=topology)
        index._index_nodes()
        index._index_levels()
        return index

    # ---- construction ------------------------------------------------------------------------------
    def _index_nodes(self) -> None:
        topo = self.topology
        switches = {s.name: s for s in topo.spec.switches}
        leaf_ids: dict[str, int] = {}
        spine_ids: dict[str, int] = {}
        units: dict[str, int] = {}
        leafsets: dict[frozenset[int], int] = {}
        spinesets: dict[frozenset[int], int] = {}
        tables: dict[tuple, int] = {}
        for nid, node in enumerate(topo.spec.nodes):
            self.node_names.append(node.name)
            self.node_id[node.name] = nid
            self.node_gpus.append(node.usable_gpus)
            group = topo.nvlink_group_of(node.name)
            key = group if group is not None else f"\0node:{node.name}"
            if key not in units:
                units[key] = len(self.unit_nodes)
                self.unit_nodes.append([])
                self.unit_has_nvlink.append(group is not None)
            self.node_unit.append(units[key])
            self.unit_nodes[units[key]].append(nid)
            if group is None and (node.nvlink_pairs or node.pcie_paths):
                table = PairLinks.of_node(node, topo.spec.fabric)
                tid = tables.setdefault(table.signature(), len(self.pair_tables))
                if tid == len(self.pair_tables):
                    self.pair_tables.append(table)
                self.node_links.append(tid)
            else:
                self.node_links.append(-1)
            leaves: set[int] = set()
            for gpu in node.gpus:
                found = node.nic_path(gpu)
                nic = found[0] if found else None
                priced = topo.spec.fabric.nic.get(found[1]) if found else None  # type: ignore[call-overload]
                if priced is not None:
                    self.gpu_nic[(nid, gpu)] = (priced.bandwidth_gbytes_per_s * 1e9, priced.latency_us * 1e-6)
                if nic is None or nic.leaf is None:
                    self.gpu_leaf[(nid, gpu)] = -1 - nid
                    self.gpu_rail[(nid, gpu)] = -1
                    continue
                lid = leaf_ids.setdefault(nic.leaf, len(leaf_ids))
                leaf = switches[nic.leaf]
                if lid not in self.leaf_spine:
                    spine = leaf.parent
                    self.leaf_spine[lid] = spine_ids.setdefault(spine, len(spine_ids)) if spine else -1
                self.gpu_leaf[(nid, gpu)] = lid
                self.gpu_rail[(nid, gpu)] = nic.rail if nic.rail is not None else -1
                leaves.add(lid)
                if gpu in node.usable_gpus:
                    self.leaf_ports[lid] += 1
                    self.spine_ports[self.leaf_spine[lid]] += 1
            lkey = frozenset(leaves) if leaves else frozenset({-1 - nid})
            if lkey not in leafsets:
                leafsets[lkey] = len(self.leafset_nodes)
                self.leafset_nodes.append([])
                skey = frozenset(self.leaf_spine.get(leaf, -1) for leaf in lkey)
                sid = spinesets.setdefault(skey, len(spinesets))
                if sid == len(self.spineset_leafsets):
                    self.spineset_leafsets.append([])
                self.spineset_leafsets[sid].append(leafsets[lkey])
            self.node_leafset.append(leafsets[lkey])
            self.leafset_nodes[leafsets[lkey]].append(nid)
        for nid in range(len(self.node_names)):
            ls = self.node_leafset[nid]
            self.node_spineset.append(next(s for s, members in enumerate(self.spineset_leafsets) if ls in members))

    def _index_levels(self) -> None:
        fabric = self.topology.spec.fabric
        network: list[LinkLevel] = []
        for name in ("nvlink", "host", *TIERS):  # pair levels are priced per node (pair_tables)
            level = fabric.level(name)
            if name in TIERS:
                if level is not None:
                    network.append(level)
                if not network:
                    continue
                bw = min(lv.bandwidth_gbytes_per_s for lv in network)
                latency = (level or network[-1]).latency_us
            elif level is None:
                continue
            else:
                bw, latency = level.bandwidth_gbytes_per_s, level.latency_us
            self.level_bw[name] = bw * 1e9
            self.level_latency[name] = latency * 1e-6
        for tier in ("leaf", "spine"):
            level = fabric.level(tier)
            self.oversub[tier] = level.oversubscription if level else 1.0
        self.outermost = next((lv for lv in reversed(LEVELS) if lv in self.level_bw), "host")
        usable = [len(g) for g in self.node_gpus]
        cap: dict[str, int] = {}
        if any(self.unit_has_nvlink):
            cap["nvlink"] = max(
                sum(usable[n] for n in nodes) for u, nodes in enumerate(self.unit_nodes) if self.unit_has_nvlink[u]
            )
        cap["host"] = max(usable)
        self.plain_capacity = max(
            (n for nid, n in enumerate(usable) if not self.unit_has_nvlink[self.node_unit[nid]] and self.node_links[nid] < 0),
            default=0,
        )
        cap["leaf"] = max(sum(usable[n] for n in nodes) for nodes in self.leafset_nodes)
        spine_gpus = Counter()
        for nid, n in enumerate(usable):
            spine_gpus[self.node_spineset[nid]] += n
        cap["spine"] = max(spine_gpus.values())
        cap["core"] = sum(usable)
        self.level_capacity = {lv: c for lv, c in cap.items() if lv in self.level_bw}
        if self.gpu_nic:
            paths = [self.gpu_nic.get((nid, g), (float("inf"), 0.0)) for nid, gpus in enumerate(self.node_gpus) for g in gpus]
            self.nic_best = (max((bw for bw, _ in paths), default=float("inf")), min((lat for _, lat in paths), default=0.0))

    # ---- queries -----------------------------------------------------------------------------------
    def unit_of(self, slot: SlotId) -> int:
        return self.node_unit[slot[0]]

    def pair_bound(self, size: int) -> tuple[float, float] | None:
        """(most bytes/s, least seconds) any `size` GPUs of one node with pair links get; None if none can."""
        found = [t.bound(size) for t in self.pair_tables if len(t.gpus) >= size]
        if not found:
            return None
        return max(bw for bw, _ in found), min(latency for _, latency in found)

    def unit_bandwidth(self, size: int, stride: int = 1) -> float | None:
        """Most bytes/s a group of `size` GPUs gets inside one unit (NVLink domain or node) with its
        block (`size x stride` positions: a CP / EP group with TP innermost has stride tp) there too;
        None when no unit holds it. A group spanning units is split only when it gets less."""
        key = (size, stride)
        if key in self.unit_bw_seen:
            return self.unit_bw_seen[key]
        options = []
        if self.level_capacity.get("nvlink", 0) >= size:
            options.append(self.level_bw["nvlink"])
        if self.plain_capacity >= size and "host" in self.level_bw:
            options.append(self.level_bw["host"])
        for table in self.pair_tables:
            inside = table.block_group(size, stride)
            if inside is not None:
                options.append(inside.bandwidth)
        self.unit_bw_seen[key] = found = max(options, default=None)
        return found

    def link(self, slots: list[SlotId]) -> Link:
        """Level, bytes/s per GPU and latency of a group of GPUs (see the module docstring)."""
        first = slots[0][0]
        if len(slots) == 1:  # nothing to send
            return Link(self.level(slots), float("inf"), 0.0)
        one_node = all(s[0] == first for s in slots)
        if one_node and self.node_links[first] >= 0:
            return self.pair_tables[self.node_links[first]].ring(tuple(g for _, g in slots))
        level = self.level(slots)
        bw = self.level_bw[level]
        if not one_node:
            members: dict[int, list[int]] = {}
            for nid, gpu in slots:
                if self.node_links[nid] >= 0:
                    members.setdefault(nid, []).append(gpu)
            for nid, gpus in members.items():
                if len(gpus) > 1:
                    bw = min(bw, self.pair_tables[self.node_links[nid]].ring(tuple(gpus)).bandwidth)
            if self.gpu_nic and level != "nvlink":
                paths = [self.gpu_nic[s] for s in slots if s in self.gpu_nic]
                if paths:
                    bw = min(bw, *(cap for cap, _ in paths))
                    return Link(level, bw, self.level_latency[level] + max(extra for _, extra in paths))
        return Link(level, bw, self.level_latency[level])

    def network(self, level: str) -> tuple[float, float]:
        """(most bytes/s, least seconds) a group crossing nodes at network `level` can get: the level's
        figures with the best NIC path of the map (lower-bound reasoning)."""
        return min(self.level_bw[level], self.nic_best[0]), self.level_latency[level] + self.nic_best[1]

    def level(self, slots: list[SlotId]) -> str:
        """The outermost level a group of GPUs spans (see the module docstring)."""
        first = slots[0][0]
        if all(s[0] == first for s in slots):
            if self.unit_has_nvlink[self.node_unit[first]] or len(slots) == 1:
                return "nvlink"
            if self.node_links[first] >= 0:
                return self.pair_tables[self.node_links[first]].ring(tuple(g for _, g in slots)).level
            return "host"
        unit = self.node_unit[first]
        if self.unit_has_nvlink[unit] and all(self.node_unit[s[0]] == unit for s in slots):
            return "nvlink"
        leaves = {self.gpu_leaf[s] for s in slots}
        if len(leaves) == 1 or len({self.gpu_rail[s] for s in slots}) == 1:
            return self._network_level(self._lca_tier(leaves))
        per_node: dict[int, Counter[int]] = {}
        for s in slots:
            per_node.setdefault(s[0], Counter())[self.gpu_rail[s]] += 1
        rail_sets = list(per_node.values())
        if all(r == rail_sets[0] for r in rail_sets[1:]):
            by_rail: dict[int, set[int]] = {}
            for s in slots:
                by_rail.setdefault(self.gpu_rail[s], set()).add(self.gpu_leaf[s])
            tier = max(self._lca_tier(leaves) for leaves in by_rail.values())
        else:
            tier = self._lca_tier({self.gpu_leaf[s] for s in slots})
        return self._network_level(tier)

    def _lca_tier(self, leaves: set[int]) -> int:
        if len(leaves) == 1 and next(iter(leaves)) >= 0:
            return 0
        if any(leaf < 0 for leaf in leaves):
            return 3
        spines = {self.leaf_spine[leaf] for leaf in leaves}
        return 1 if len(spines) == 1 and -1 not in spines else 2

    def _network_level(self, tier: int) -> str:
        """Tier 0/1/2 -> leaf/spine/core, moved outward to a level the map defines; 3 = no common switch."""
        for name in TIERS[min(tier, 2):]:
            if name in self.level_bw and tier < 3:
                return name
        return self.outermost
