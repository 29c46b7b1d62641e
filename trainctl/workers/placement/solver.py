"""The placement solver: a rank grid and the free GPUs of a topology -> which GPU each rank gets.

1. Atoms. TP groups (then EP blocks, then CP blocks) are contiguous rank blocks; an atom is the
   largest such block that every chosen NVLink unit can hold whole. Larger atoms are tried first, so a
   group is split only when no placement keeps it whole.
2. Hierarchical best-fit. The fabric is a tree: spine set -> leaf set (scalable unit) -> NVLink unit
   -> node. At each level the job goes into the fullest child that holds all of it (best fit, which
   limits fragmentation); when none does it takes the largest children in chunks aligned to the
   job's own blocks (a pipeline stage, then a data-parallel block), so data-parallel groups stay under
   one leaf set and pipeline boundaries fall between leaf sets.
3. Rails. Inside a node each rank prefers the GPU whose rail matches its position, so data-parallel
   and pipeline peers on other nodes are on the same rail (one leaf hop, no spine). On a node with
   per-pair links (NVLink bridges or mesh, PCIe path classes) the atoms take the best-connected free
   GPU sets first (a bridged pair, one PCIe switch), each next one the set best connected to those
   already taken (one NUMA node before the inter-socket link), rail matches breaking ties. On maps
   that price GPU-NIC paths, one more candidate uses on each node only the free GPUs nearest their
   NICs, so groups that cross nodes leave through PIX rather than SYS NICs when the choice exists.
4. Local search. Starting from the best candidate, swap the atoms of the worst group's outliers with
   atoms (used or free) inside the group's majority container while the modelled cost improves.
Deterministic: no randomness; the time budget only caps work and is not reached on typical inputs.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import product

from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.spec.model_spec import DEFAULT_PRESET
from trainctl.spec.presets import PRESETS, ModelConfig
from trainctl.workers.placement.cost import (
    SPLIT_DIMS,
    CostBreakdown,
    DimTraffic,
    Workload,
    build_traffic,
    evaluate,
    lower_bound,
)
from trainctl.workers.placement.fabric import LEVELS, FabricIndex, SlotId
from trainctl.workers.placement.plan import Placement, RankAssignment, SplitGroup
from trainctl.workers.topology.model import TopologyMap


class PlacementError(ValueError):
    """Inputs placement cannot use (names the node or GPU)."""


def capacity(topology: TopologyMap) -> int:
    """GPUs that can ever get ranks: healthy nodes, failed GPUs left out."""
    return sum(len(node.usable_gpus) for node in topology.nodes)


def place_job(
    job: ResolvedJob,
    topology: TopologyMap,
    free: Mapping[str, set[int]],
    time_budget_s: float = 0.5,
    *,
    index: FabricIndex | None = None,
) -> Placement | None:
    """`place` for a resolved job: its grid, its model and its per-step workload size the traffic."""
    return place(job.grid, topology, free, job.model, Workload.from_job(job), time_budget_s, index=index)


def place(
    grid: RankGrid,
    topology: TopologyMap,
    free: Mapping[str, set[int]],
    model: ModelConfig | None = None,
    workload: Workload | None = None,
    time_budget_s: float = 0.5,
    *,
    index: FabricIndex | None = None,
) -> Placement | None:
    """Place every rank of `grid` on a free GPU, or None when the free GPUs cannot hold the job now.

    `free` maps node name -> free local GPU indices (GPUs of unhealthy nodes or failed GPUs are never
    used). `model` / `workload` size the traffic; without them the default preset and `Workload()`.
    `index` lets a caller that places many jobs on one map compile it once.
    """
    started = time.perf_counter()
    index = index or FabricIndex.build(topology)
    free_ids = _free_by_node(free, index)
    if sum(len(g) for g in free_ids.values()) < grid.world_size:
        return None
    traffic = job_traffic(grid, model, workload)
    solver = _Solver(grid, index, free_ids, traffic, started + time_budget_s)
    slots = solver.solve()
    return make_placement(grid, index, traffic, slots)


def job_traffic(grid: RankGrid, model: ModelConfig | None, workload: Workload | None) -> list[DimTraffic]:
    """The cost model's traffic for a job of `model` (default: the default preset) and `workload`
    (default: `Workload()`) on `grid`."""
    return build_traffic(grid, model or PRESETS[DEFAULT_PRESET], workload or Workload())


def make_placement(grid: RankGrid, index: FabricIndex, traffic: list[DimTraffic], slots: list[SlotId]) -> Placement:
    """A `Placement` for rank r on `slots[r]`, with its modelled cost and lower bound."""
    cost = evaluate(traffic, slots, index)
    names = index.node_names
    splits = [
        SplitGroup(dim=dim, ranks=ranks, nodes=list(dict.fromkeys(names[slots[r][0]] for r in ranks)))
        for dim in SPLIT_DIMS
        for ranks in cost.split_groups.get(dim, [])
    ]
    return Placement(
        grid=grid.describe(),
        assignments=[RankAssignment(rank=r, node=names[n], gpu=g) for r, (n, g) in enumerate(slots)],
        split_groups=splits,
        comm_seconds_by_dim=cost.seconds_by_dim,
        comm_bytes_by_dim=cost.bytes_by_dim,
        level_by_dim=cost.level_by_dim,
        lower_bound_seconds_by_dim=lower_bound(traffic, index),
    )


def _free_by_node(free: Mapping[str, set[int]], index: FabricIndex) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name, gpus in free.items():
        if name not in index.node_id:
            raise PlacementError(f"free GPUs given for node {name!r}, which is not in the topology map")
        nid = index.node_id[name]
        usable = set(index.node_gpus[nid])
        if not usable.issuperset(gpus):  # only then read the node (a walk over the map's nodes)
            unknown = sorted(set(gpus) - set(index.topology.node(name).gpus))
            if unknown:
                raise PlacementError(f"node {name!r}: free GPUs {unknown} do not exist on it")
        chosen = sorted(g for g in gpus if g in usable)
        if chosen:
            out[nid] = chosen
    return out


ORDERS: tuple[tuple[str, ...], ...] = (
    ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
    ("dp_replicate", "dp_shard", "pp", "cp", "tp"),
)
"""Nesting orders tried, outer to inner: the grid's own (pipeline stages outermost, data-parallel
groups inside a stage's block) and pipeline inside data parallel (when stage boundaries carry more
than gradient sync, e.g. small models with long sequences). TP and CP stay innermost in both."""


def job_blocks(grid: RankGrid, order: tuple[str, ...] = ORDERS[0]) -> list[int]:
    """Contiguous position-block sizes of the grid in `order`, inner to outer (tp, tp*cp, ..., world)."""
    sizes, acc = [], 1
    for dim in reversed(order):
        degree = getattr(grid, dim)
        acc *= degree
        if degree > 1 or not sizes:
            sizes.append(acc)
    return sorted(set(sizes))


def positions(grid: RankGrid, order: tuple[str, ...]) -> list[int]:
    """The rank at each position when ranks are enumerated in `order` (outer to inner)."""
    return [
        grid.rank_of(**dict(zip(order, coords, strict=True)))
        for coords in product(*(range(getattr(grid, d)) for d in order))
    ]


def atom_sizes(grid: RankGrid) -> list[int]:
    """Candidate atoms, most protective first: blocks that keep TP+EP+CP, TP+EP, TP+CP, TP, nothing whole."""
    tp, ep_block, cp_block = grid.tp, grid.tp * grid.ep, grid.tp * grid.cp
    larger, smaller = max(ep_block, cp_block), min(ep_block, cp_block)
    both = larger if larger % smaller == 0 else 0  # one block nests in the other: keeping it keeps both
    ordered = [both, ep_block, cp_block, tp, 1]
    return list(dict.fromkeys(a for a in ordered if a >= 1 and grid.world_size % a == 0))


@dataclass
class _Box:
    """A container of the fabric tree with its free capacity in atoms (a unit when `unit` >= 0)."""

    cap: int
    unit: int = -1
    children: list[_Box] = field(default_factory=list)

    @classmethod
    def tree(cls, nested: list, caps: dict[int, int]) -> list[_Box]:
        """Boxes for nested lists of unit ids, capacities summed once."""
        out = []
        for item in nested:
            if isinstance(item, int):
                out.append(cls(caps[item], unit=item))
            else:
                kids = cls.tree(item, caps)
                out.append(cls(sum(k.cap for k in kids), children=kids))
        return out

    def best_unit(self, n: int, quality: Callable[[int, int], tuple[float, ...]]) -> tuple[float, ...]:
        """The best `quality(unit, atoms)` of the units under this box: of those holding all `n` atoms
        when some do, else of every unit with as many atoms as it holds."""
        if self.unit >= 0:
            return quality(self.unit, min(n, self.cap)) if self.cap else (0.0, 0.0, 0.0)
        holding = [k for k in self.children if k.cap >= n] or self.children
        return max((k.best_unit(n, quality) for k in holding), default=(0.0, 0.0, 0.0))

    def fit_depth(self, n: int) -> int:
        """How many levels further down one descendant still holds all `n` atoms."""
        inner = [k for k in self.children if k.cap >= n]
        return 1 + max(k.fit_depth(n) for k in inner) if inner else 0


class _Solver:
    """One placement problem (internal; `place` is the entry point)."""

    def __init__(
        self, grid: RankGrid, index: FabricIndex, free: dict[int, list[int]], traffic: list[DimTraffic], deadline: float
    ) -> None:
        self.grid, self.index, self.free, self.traffic, self.deadline = grid, index, free, traffic, deadline
        self.world = grid.world_size
        self.spans_seen: dict = {}

    # ---- top level ---------------------------------------------------------------------------------
    def solve(self) -> list[SlotId]:
        best: tuple[tuple[float, ...], list[SlotId], CostBreakdown] | None = None
        for order in ORDERS:
            if order != ORDERS[0] and (self.grid.pp == 1 or self.grid.ep > 1 or self.grid.dp == 1):
                continue
            perm = positions(self.grid, order)
            blocks = job_blocks(self.grid, order)
            whole = False
            sizes = atom_sizes(self.grid) if order == ORDERS[0] else atom_sizes(RankGrid(tp=self.grid.tp, cp=self.grid.cp))
            for atom in [a for a in sizes if a > 1 or self.grid.tp == 1]:
                if best is not None and time.perf_counter() > self.deadline:
                    break
                for aligned in (True, False):
                    slots = self._construct(self.free, atom, 0, self.world, blocks if aligned else [1])
                    best = self._keep_better(best, self._by_rank(perm, slots))
                whole = best is not None and not any(best[0][: len(SPLIT_DIMS)])
                if whole:
                    break
            if not whole and self.grid.tp > 1:
                # as many whole TP groups as fit, the rest GPU by GPU (covers atom size 1)
                best = self._keep_better(best, self._by_rank(perm, self._construct_mixed(self.grid.tp, blocks)))
            if self.index.pair_tables:
                # one socket of each node with per-pair links: rings that would cross sockets there
                # may do better across nodes (the cost model decides)
                local = self._construct(self._one_numa_node(), self.grid.tp, 0, self.world, blocks)
                best = self._keep_better(best, self._by_rank(perm, local))
            if self.index.gpu_nic:
                # only the GPUs nearest their NICs: groups crossing nodes get their best NIC paths
                near = self._near_nics()
                if near != self.free:
                    best = self._keep_better(best, self._by_rank(perm, self._construct(near, self.grid.tp, 0, self.world, blocks)))
        if best is None:
            raise AssertionError("unreachable: with enough free GPUs, atom size 1 always places")
        return self._improve(best[1], best[2])

    @staticmethod
    def _by_rank(perm: list[int], slots: list[SlotId] | None) -> list[SlotId] | None:
        """Slots by position -> slots by rank."""
        if slots is None:
            return None
        out: list[SlotId] = [slots[0]] * len(slots)
        for position, rank in enumerate(perm):
            out[rank] = slots[position]
        return out

    def _keep_better(
        self, best: tuple[tuple[float, ...], list[SlotId], CostBreakdown] | None, slots: list[SlotId] | None
    ) -> tuple[tuple[float, ...], list[SlotId], CostBreakdown] | None:
        if slots is None:
            return best
        cost = evaluate(self.traffic, slots, self.index, self.spans_seen)
        key = cost.objective()
        return (key, slots, cost) if best is None or _preferred(cost, best[2]) else best

    # ---- construction ------------------------------------------------------------------------------
    def _tree(self, free: dict[int, list[int]]) -> tuple[Counter[int], list]:
        """Free GPUs per NVLink unit, and the tree spine set -> leaf set -> units (validated nesting)."""
        units: Counter[int] = Counter()
        for nid, gpus in free.items():
            units[self.index.node_unit[nid]] += len(gpus)
        tree: dict[int, dict[int, list[int]]] = {}
        for unit in sorted(units):
            first = self.index.unit_nodes[unit][0]
            tree.setdefault(self.index.node_spineset[first], {}).setdefault(self.index.node_leafset[first], []).append(unit)
        return units, [[tree[s][ls] for ls in sorted(tree[s])] for s in sorted(tree)]

    def _construct(
        self, free: dict[int, list[int]], atom: int, first: int, count: int, blocks: list[int]
    ) -> list[SlotId] | None:
        """Slots for positions first .. first + count - 1 in atoms of `atom` positions, or None.

        `blocks` are the job's contiguous block sizes the split points align to ([1]: no alignment).
        """
        unit_free, tree = self._tree(free)
        caps = {u: f // atom for u, f in unit_free.items()}
        needed = count // atom
        if sum(caps.values()) < needed:
            return None
        in_atoms = [b // atom for b in blocks if b % atom == 0 and b >= atom] or [1]
        quality = (lambda unit, n: self._unit_quality(free, unit, n, atom)) if self.index.pair_tables else None
        picks = self._choose(_Box.tree(tree, caps), needed, in_atoms, quality)
        if picks is None:
            return None
        slots: list[SlotId] = []
        for unit, n_atoms in picks:
            slots.extend(self._fill_unit(free, unit, first + len(slots), n_atoms * atom, atom))
        return slots

    def _construct_mixed(self, atom: int, blocks: list[int]) -> list[SlotId] | None:
        """When not every atom fits whole: as many whole atoms as fit, the remaining ranks GPU by GPU."""
        unit_free, _ = self._tree(self.free)
        whole = min(self.world, sum(f // atom for f in unit_free.values()) * atom)
        head = self._construct(self.free, atom, 0, whole, blocks) if whole else []
        if head is None:
            return None
        taken = set(head)
        rest = {n: [g for g in gpus if (n, g) not in taken] for n, gpus in self.free.items()}
        tail = self._construct({n: g for n, g in rest.items() if g}, 1, whole, self.world - whole, blocks)
        return None if tail is None else head + tail

    def _choose(
        self, children: list[_Box], n: int, blocks: list[int], quality: Callable[[int, int], tuple[float, ...]] | None
    ) -> list[tuple[int, int]] | None:
        """Split `n` atoms over `children` -> [(unit, atoms)].

        If some child holds them all: the one whose units give the TP groups, then the atoms, the
        best links (`quality`, given on maps with per-pair links), then the one in which they fit deepest
        (a single unit beats a single leaf set), then the best-connected set, then the fullest
        (best fit). Otherwise the largest children first, in chunks aligned to the job's blocks, and
        a best-fit child for the remainder.
        """
        avail = [i for i, c in enumerate(children) if c.cap > 0]
        picks: list[tuple[int, int]] = []
        remaining = n
        while remaining > 0:
            if not avail:
                return None
            fitting = [i for i in avail if children[i].cap >= remaining]
            if fitting:
                def rank(j: int, need: int = remaining, several: bool = len(fitting) > 1) -> tuple:
                    child = children[j]
                    links = child.best_unit(need, quality) if several and quality else (0.0, 0.0, 0.0)
                    return (-links[0], -links[1], -child.fit_depth(need), -links[2], child.cap, j)

                i = min(fitting, key=rank)
                picks.append((i, remaining))
                break
            i = max(avail, key=lambda j: (children[j].cap, -j))
            take = children[i].cap
            unit = max((b for b in blocks if b <= take), default=1)
            aligned_take = take // unit * unit
            if aligned_take and sum(children[j].cap for j in avail if j != i) >= remaining - aligned_take:
                take = aligned_take
            picks.append((i, take))
            avail.remove(i)
            remaining -= take
        out: list[tuple[int, int]] = []
        for i, count in picks:
            child = children[i]
            if child.unit >= 0:
                out.append((child.unit, count))
            else:
                sub = self._choose(child.children, count, blocks, quality)
                if sub is None:
                    return None
                out.extend(sub)
        return out

    def _fill_unit(self, free: dict[int, list[int]], unit: int, first: int, count: int, atom: int) -> list[SlotId]:
        """GPUs of one NVLink unit for positions first .. first+count-1, rail-matched per node
        (by connectivity first on a node with per-pair links)."""
        nodes = [n for n in self.index.unit_nodes[unit] if n in free]
        nodes.sort(key=lambda n: (-len(free[n]), n))
        slots: list[SlotId] = []
        rank = first
        for nid in nodes:
            if len(slots) == count:
                break
            take = min(len(free[nid]), count - len(slots))
            ranks = list(range(rank, rank + take))
            if self.index.node_links[nid] >= 0:
                gpus = self._pick_connected(free[nid], nid, ranks, atom if take % atom == 0 else 1)
            else:
                gpus = self._match_rails(free[nid], nid, ranks)
            slots.extend((nid, g) for g in gpus)
            rank += take
        return slots

    def _one_numa_node(self) -> dict[int, list[int]]:
        """The free GPUs, on nodes with per-pair links only those of the NUMA node with the most free."""
        out: dict[int, list[int]] = {}
        for nid, gpus in self.free.items():
            numa = self.index.topology.spec.nodes[nid].numa
            if self.index.node_links[nid] < 0 or not numa:
                out[nid] = gpus
                continue
            by_numa: dict[int, list[int]] = {}
            for g in gpus:
                by_numa.setdefault(numa.get(g, -1), []).append(g)
            out[nid] = max(by_numa.values(), key=lambda members: (len(members), -members[0]))
        return out

    def _near_nics(self) -> dict[int, list[int]]:
        """The free GPUs, on each node only those with the best path to their NIC among its free ones."""
        out: dict[int, list[int]] = {}
        for nid, gpus in self.free.items():
            paths = [self.index.gpu_nic.get((nid, g), (float("inf"), 0.0)) for g in gpus]
            best = max(paths, key=lambda path: (path[0], -path[1]))
            out[nid] = [g for g, path in zip(gpus, paths, strict=True) if path == best]
        return out

    def _unit_quality(self, free: dict[int, list[int]], unit: int, atoms: int, atom: int) -> tuple[float, ...]:
        """Bytes/s of the worst TP group, of the worst atom and of the whole set that `atoms` atoms
        would get on `unit`'s free GPUs (maps with per-pair links)."""
        index = self.index
        nid = index.unit_nodes[unit][0]
        if index.unit_has_nvlink[unit] or index.node_links[nid] < 0 or nid not in free:
            bw = index.level_bw.get("nvlink" if index.unit_has_nvlink[unit] else "host", 0.0)
            return bw, bw, bw
        count = atoms * atom
        gpus = self._pick_connected(free[nid], nid, list(range(count)), atom)
        table = index.pair_tables[index.node_links[nid]]

        def worst(size: int) -> float:
            if size < 2 or count % size:
                return float("inf")
            return min(table.ring(tuple(gpus[i : i + size])).bandwidth for i in range(0, count, size))

        return worst(self.grid.tp), worst(atom), worst(count)

    def _pick_connected(self, free: list[int], nid: int, ranks: list[int], atom: int) -> list[int]:
        """Local GPUs among `free` for `ranks` on a node with per-pair links (`PairLinks.pick`), rank r
        wanting GPU r mod gpus_per_node (its rail)."""
        all_gpus = self.index.topology.spec.nodes[nid].gpus
        wanted = tuple(all_gpus[r % len(all_gpus)] for r in ranks)
        return self.index.pair_tables[self.index.node_links[nid]].pick(tuple(free), wanted, atom)

    def _match_rails(self, free: list[int], nid: int, ranks: list[int]) -> list[int]:
        """Local GPUs among `free` for `ranks` on node `nid`: rank r prefers GPU (r mod GPUs per node)."""
        all_gpus = self.index.topology.spec.nodes[nid].gpus
        wanted = [all_gpus[r % len(all_gpus)] for r in ranks]
        chosen: dict[int, int] = {}
        taken: set[int] = set()
        for r, want in zip(ranks, wanted, strict=True):
            if want in free and want not in taken:
                chosen[r] = want
                taken.add(want)
        spare = [g for g in free if g not in taken]
        for r in ranks:
            if r not in chosen:
                chosen[r] = spare.pop(0)
        return [chosen[r] for r in ranks]

    # ---- local search ------------------------------------------------------------------------------
    def _improve(self, slots: list[SlotId], cost: CostBreakdown) -> list[SlotId]:
        """Swap the worst group's outlier atoms into its majority container while the cost improves."""
        atom = self.grid.tp if not cost.split_groups.get("tp") else 1
        key = cost.objective()
        bound = lower_bound(self.traffic, self.index)
        tried: set[tuple[str, tuple[int, ...]]] = set()
        failures = 0
        while failures < _MAX_FAILED_GROUPS and time.perf_counter() < self.deadline:
            target = self._worst_group(slots, cost, bound, tried)
            if target is None:
                break
            dim, group = target
            tried.add((dim, tuple(group)))
            better = self._try_moves(slots, group, atom, key)
            if better is None:
                failures += 1
                continue
            slots, cost = better
            key = cost.objective()
            tried.clear()
            failures = 0
        return slots

    def _worst_group(
        self, slots: list[SlotId], cost: CostBreakdown, bound: dict[str, float], tried: set
    ) -> tuple[str, list[int]] | None:
        gaps = sorted(
            ((cost.seconds_by_dim[d] - bound.get(d, 0.0), d) for d in cost.seconds_by_dim), reverse=True
        )
        for gap, dim in gaps:
            if gap <= 1e-12:
                return None
            for entry in self.traffic:
                if entry.dim != dim:
                    continue
                ranked = sorted(
                    entry.groups,
                    key=lambda g: (-LEVELS.index(self.index.level([slots[r] for r in g])), g[0]),
                )
                for group in ranked[:4]:
                    if (dim, tuple(group)) not in tried and len({self._container(slots[r]) for r in group}) > 1:
                        return dim, group
        return None

    def _container(self, slot: SlotId) -> tuple[int, int]:
        return self.index.node_leafset[slot[0]], self.index.gpu_rail[slot]

    def _try_moves(
        self, slots: list[SlotId], group: list[int], atom: int, key: tuple[float, ...]
    ) -> tuple[list[SlotId], CostBreakdown] | None:
        majority = Counter(self._container(slots[r]) for r in group).most_common(1)[0][0]
        outliers = [r for r in group if self._container(slots[r]) != majority]
        used = set(slots)
        spare = [(n, g) for n, gpus in sorted(self.free.items()) for g in gpus if (n, g) not in used]
        best: tuple[tuple[float, ...], list[SlotId], CostBreakdown] | None = None
        evaluations = 0
        for r in outliers:
            start = r - r % atom
            mine = slots[start : start + atom]
            for other in self._partners(slots, spare, majority, atom, start):
                trial = list(slots)
                if isinstance(other, int):
                    trial[start : start + atom], trial[other : other + atom] = trial[other : other + atom], mine
                else:
                    trial[start : start + atom] = other
                cost = evaluate(self.traffic, trial, self.index, self.spans_seen)
                evaluations += 1
                k = cost.objective()
                if k < key and (best is None or k < best[0]):
                    best = (k, trial, cost)
                if evaluations >= 6 or time.perf_counter() > self.deadline:
                    break
            if best is not None or time.perf_counter() > self.deadline:
                break
        return (best[1], best[2]) if best else None

    def _partners(self, slots: list[SlotId], spare: list[SlotId], majority: tuple[int, int], atom: int, start: int) -> list:
        """Atoms to swap with: spare GPU sets in the majority container first, then used atoms there."""
        out: list = []
        if atom == 1:
            out += [[s] for s in spare if self._container(s) == majority][:3]
        else:
            by_unit: dict[int, list[SlotId]] = {}
            for s in spare:
                by_unit.setdefault(self.index.unit_of(s), []).append(s)
            for unit_slots in by_unit.values():
                if len(unit_slots) >= atom and self.index.node_leafset[unit_slots[0][0]] == majority[0]:
                    out.append(unit_slots[:atom])
                if len(out) >= 3:
                    break
        for other in range(0, self.world, atom):
            if other != start and self._container(slots[other]) == majority:
                out.append(other)
            if len(out) >= 6:
                break
        return out


_MAX_FAILED_GROUPS = 3
TIE_TOLERANCE = 0.02
"""Candidates whose modelled times are within this fraction count as tied; the tie goes to the one
sending fewer bytes through leaf uplinks (what other tenants' traffic, which the map cannot see,
would slow): with non-blocking fabrics this keeps data-parallel rings under one leaf set and puts
pipeline boundaries across."""


def _preferred(a: CostBreakdown, b: CostBreakdown) -> bool:
    """Whether candidate `a` beats `b`: fewer split groups, then time, near-ties by uplink bytes."""
    splits_a, splits_b = a.objective()[:-1], b.objective()[:-1]
    if splits_a != splits_b:
        return splits_a < splits_b
    ta, tb = a.total_seconds, b.total_seconds
    if abs(ta - tb) <= TIE_TOLERANCE * min(ta, tb) and a.uplink_bytes != b.uplink_bytes:
        return a.uplink_bytes < b.uplink_bytes
    return ta < tb
"""Local search stops after this many worst groups in a row admit no improving swap."""
