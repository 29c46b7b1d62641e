"""The GPU pairs of one node outside an NVLink domain, and what a collective over a set of them gets.

Each pair has one link: NVLink with n dedicated links (`fabric.nvlink_pair` per link: a bridge, the
cube-mesh of a DGX-1), the PCIe path class of `nvidia-smi topo -m` (`fabric.pcie`, else `fabric.host`),
or, when the map does not say, the `host` level. A collective over a set G of the node's GPUs runs as
NCCL rings through G:

- when NVLink alone closes a ring through G (a Hamiltonian cycle of G's NVLink pairs), NCCL's
  channels use every NVLink a GPU has into G: per-GPU bandwidth min over v in G of the sum of v's
  NVLink bandwidth to the rest of G (a bridged pair: its bridge; a cube-mesh quad: four links);
- otherwise the ring needs other hops and runs at its weakest one: the best ring's bottleneck
  (a bottleneck Hamiltonian cycle over all of G's pairs), at that hop's level and latency.

Exact for sets of up to `EXACT_GPUS` GPUs (a bitmask dynamic programme, memoised per set); larger
sets get their weakest pair, which no ring through them can be slower than.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations

from trainctl.workers.topology.model import PCIE_PATHS, Fabric, Node

NVLINK_PAIR = "nvlink_pair"
PAIR_LEVELS: tuple[str, ...] = (NVLINK_PAIR, *PCIE_PATHS, "host")
"""Levels of a pair link, best to worst."""
EXACT_GPUS = 10


@dataclass(frozen=True)
class Link:
    """What a set of GPUs gets: the level that bounds it, bytes/s per GPU per direction, seconds."""

    level: str
    bandwidth: float
    latency: float


@dataclass
class PairLinks:
    """The pair links of one node (nodes with the same links share one table)."""

    gpus: tuple[int, ...]
    links: dict[tuple[int, int], Link]
    """(a, b), a < b -> the pair's link."""
    nvlink: dict[tuple[int, int], float] = field(default_factory=dict)
    """(a, b), a < b -> NVLink bytes/s between them (pairs with NVLink only)."""
    _rings: dict[tuple[int, ...], Link] = field(default_factory=dict, repr=False)
    _bounds: dict[int, tuple[float, float]] = field(default_factory=dict, repr=False)
    _picks: dict[tuple, list[int]] = field(default_factory=dict, repr=False)

    @classmethod
    def of_node(cls, node: Node, fabric: Fabric) -> PairLinks:
        """The table of `node` under `fabric` (the map's validation guarantees every level it needs)."""
        gpus = tuple(sorted(node.gpus))
        links: dict[tuple[int, int], Link] = {}
        nvlink: dict[tuple[int, int], float] = {}
        if fabric.host is not None:
            host = Link("host", fabric.host.bandwidth_gbytes_per_s * 1e9, fabric.host.latency_us * 1e-6)
            links = {(a, b): host for i, a in enumerate(gpus) for b in gpus[i + 1 :]}
        for a, b, path in node.pcie_paths:
            level = fabric.pcie_level(path)
            assert level is not None, "validated by the map"
            links[(a, b)] = Link(path, level.bandwidth_gbytes_per_s * 1e9, level.latency_us * 1e-6)
        per_link = fabric.nvlink_pair
        for a, b, count in node.nvlink_pairs:
            assert per_link is not None, "validated by the map"
            nvlink[(a, b)] = count * per_link.bandwidth_gbytes_per_s * 1e9
            links[(a, b)] = Link(NVLINK_PAIR, nvlink[(a, b)], per_link.latency_us * 1e-6)
        return cls(gpus, links, nvlink)

    def signature(self) -> tuple:
        """Equal for nodes whose tables are equal (maps share one table per kind of node)."""
        return self.gpus, tuple(sorted(self.links.items()))

    def link(self, a: int, b: int) -> Link:
        """The link between GPUs a and b (either order)."""
        return self.links[(min(a, b), max(a, b))]

    def ring(self, gpus: tuple[int, ...]) -> Link:
        """What a collective over `gpus` (distinct GPUs of this node) gets; see the module docstring."""
        key = tuple(sorted(gpus))
        found = self._rings.get(key)
        if found is None:
            found = self._rings[key] = self._ring(key)
        return found

    def _ring(self, gpus: tuple[int, ...]) -> Link:
        if len(gpus) == 1:  # nothing to send
            return Link(NVLINK_PAIR, float("inf"), 0.0)
        pairs = [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1 :]]
        if len(gpus) <= EXACT_GPUS:
            nv = [[self.nvlink.get((min(a, b), max(a, b)), 0.0) for b in gpus] for a in gpus]
            if _bottleneck_cycle(nv) > 0:
                per_gpu = min(sum(row) for row in nv)
                some = next(self.links[p] for p in pairs if p in self.nvlink)
                return Link(NVLINK_PAIR, per_gpu, some.latency)
            weights = [[self._bandwidth(a, b) for b in gpus] for a in gpus]
            bottleneck = _bottleneck_cycle(weights)
        else:
            bottleneck = min(self._bandwidth(a, b) for a, b in pairs)
        # the weakest hop: every pair has a link (the map requires fabric.host for pairs it leaves out)
        at = [self.links[p] for p in pairs if self.links[p].bandwidth == bottleneck]
        return max(at, key=lambda lk: (PAIR_LEVELS.index(lk.level), lk.latency))

    def pick(self, free: tuple[int, ...], wanted: tuple[int, ...], atom: int) -> list[int]:
        """GPUs among `free` for `len(wanted)` positions, `atom` positions at a time: the set with the
        best ring of its own, then the best ring with the sets already taken (one socket before the
        next), then the most positions getting their `wanted` GPU (rails), then the lowest indices;
        inside a set, each position its wanted GPU when the set has it."""
        key = (free, wanted, atom)
        if key in self._picks:
            return self._picks[key]
        chosen: list[int] = []
        left = list(free)
        while len(chosen) < len(wanted):
            want = wanted[len(chosen) : len(chosen) + atom]

            def score(group: tuple[int, ...], want: tuple[int, ...] = want) -> tuple:
                together = self.ring((*chosen, *group)).bandwidth if chosen else 0.0
                return (self.ring(group).bandwidth, together, len(set(want) & set(group)), [-g for g in group])

            best = max(combinations(left, atom), key=score)
            spare = [g for g in best if g not in want]
            chosen.extend(w if w in best else spare.pop(0) for w in want)
            left = [g for g in left if g not in best]
        self._picks[key] = chosen
        return chosen

    def block_group(self, size: int, stride: int) -> Link | None:
        """What a group of `size` GPUs gets when its whole block (`size x stride` positions, the group
        every `stride`-th: a CP or EP group with TP innermost) sits on an empty node, picked as the
        solver picks; None when the node is too small."""
        count = size * stride
        if count > len(self.gpus):
            return None
        block = self.pick(self.gpus, self.gpus[:count], stride)
        return self.ring(tuple(block[::stride]))

    def _bandwidth(self, a: int, b: int) -> float:
        return 0.0 if a == b else self.link(a, b).bandwidth

    def bound(self, size: int) -> tuple[float, float]:
        """Memoised `_bound`."""
        if size not in self._bounds:
            self._bounds[size] = self._bound(size)
        return self._bounds[size]

    def _bound(self, size: int) -> tuple[float, float]:
        """(most bytes/s, least seconds) a set of `size` GPUs of this node can get (lower-bound reasoning).

        Exact (the best ring over every set of that size) on nodes of up to `EXACT_GPUS` GPUs; on
        larger ones, the best GPU's `size - 1` fastest NVLinks summed or the fastest pair link, which
        no ring through `size` GPUs exceeds.
        """
        latency = min((lk.latency for lk in self.links.values()), default=0.0)
        if len(self.gpus) <= EXACT_GPUS:
            return max(self.ring(group).bandwidth for group in combinations(self.gpus, size)), latency
        nv_sum = 0.0
        for g in self.gpus:
            mine = sorted((bw for (a, b), bw in self.nvlink.items() if g in (a, b)), reverse=True)
            nv_sum = max(nv_sum, sum(mine[: size - 1]))
        fastest = max((lk.bandwidth for lk in self.links.values()), default=0.0)
        return max(nv_sum, fastest), latency


def _bottleneck_cycle(weights: list[list[float]]) -> float:
    """The largest w such that a cycle through every vertex uses only edges of weight >= w (0: none).

    `weights[a][b]` symmetric, 0 for a missing edge. Dynamic programme over (visited set, last vertex)
    from vertex 0: the best bottleneck of a path; closed back to 0.
    """
    n = len(weights)
    if n == 2:
        return weights[0][1]
    full = (1 << n) - 1
    best: dict[tuple[int, int], float] = {(1, 0): float("inf")}
    for mask in range(1, full + 1, 2):
        for last in range(n):
            value = best.get((mask, last))
            if not value:
                continue
            for nxt in range(1, n):
                if mask >> nxt & 1 or not weights[last][nxt]:
                    continue
                key = (mask | 1 << nxt, nxt)
                candidate = min(value, weights[last][nxt])
                if candidate > best.get(key, 0.0):
                    best[key] = candidate
    return max((min(best.get((full, v), 0.0), weights[v][0]) for v in range(1, n)), default=0.0)
