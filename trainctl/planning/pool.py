"""The GPU pool as the scheduler and the planner see it: the topology map, which GPU each job holds,
and placement.

Capacity comes from the topology map (trainctl.workers.topology): a file given with `--topology`, or a
simulated map of the embedded cluster. Placement (trainctl.workers.placement) turns a resolved job (its
rank grid, model and workload) plus the free GPUs into rank -> (node, GPU); the pool reserves those GPUs
until the job ends.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainctl.parallelism.layouts.grid import DIMS, RankGrid
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.workers.placement import Placement, RankAssignment, place_job
from trainctl.workers.placement.fabric import FabricIndex
from trainctl.workers.topology.nccl import nccl_env

GpuSlot = tuple[str, int]
"""A GPU by (node name, local GPU index)."""


@dataclass(frozen=True)
class PlannedPlacement:
    """Where every rank of a job runs; `assignments` is what the runtime's start_job reads."""

    assignments: tuple[RankAssignment, ...]
    coords: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    """Rank -> its grid coordinates (dimension -> index)."""
    cost_seconds: float | None = None
    """The placement's modelled communication time per step, when the solver reports it."""
    level_by_dim: Mapping[str, str] = field(default_factory=dict)
    """Outermost fabric level each dimension's groups span (the solver's `Placement.level_by_dim`)."""
    seconds_by_dim: Mapping[str, float] = field(default_factory=dict)
    """Modelled communication seconds per step of each dimension (tp, cp, ep, pp, dp)."""
    split_dims: tuple[str, ...] = ()
    """Dimensions with a group that crosses an NVLink domain (tp, ep, cp; the solver avoids this)."""

    @classmethod
    def from_solver(cls, solved: Placement, grid: RankGrid) -> PlannedPlacement:
        assignments = tuple(sorted(solved.assignments, key=lambda a: a.rank))
        coords = {a.rank: _grid_coords(grid, a.rank) for a in assignments}
        return cls(
            assignments=assignments, coords=coords, cost_seconds=float(solved.comm_seconds),
            level_by_dim=dict(solved.level_by_dim), seconds_by_dim=dict(solved.comm_seconds_by_dim),
            split_dims=tuple(dict.fromkeys(g.dim for g in solved.split_groups)),
        )

    @classmethod
    def from_plan(cls, slots: list[dict[str, Any]], grid: RankGrid) -> PlannedPlacement:
        """A plan as a supervisor records it (a PLAN event: `{rank, node, gpu}` per rank) for a job of
        `grid`, with each rank's grid coordinates."""
        assignments = tuple(sorted((RankAssignment(**slot) for slot in slots), key=lambda a: a.rank))
        return cls(assignments=assignments, coords={a.rank: _grid_coords(grid, a.rank) for a in assignments})

    @classmethod
    def from_records(cls, records: list[dict[str, Any]]) -> PlannedPlacement:
        """Rebuild from stored records (after a service restart)."""
        return cls(
            assignments=tuple(RankAssignment(rank=r["rank"], node=r["node"], gpu=r["gpu"]) for r in records),
            coords={int(r["rank"]): dict(sorted(r.get("coords", {}).items())) for r in records},
        )

    @property
    def slots(self) -> list[GpuSlot]:
        return [(a.node, a.gpu) for a in self.assignments]

    def records(self) -> list[dict[str, Any]]:
        return [
            {"rank": a.rank, "node": a.node, "gpu": a.gpu, "coords": dict(self.coords.get(a.rank, {}))}
            for a in self.assignments
        ]


ADMISSION_BUDGET_S = 0.5
"""Seconds the placement solver may take per job in the scheduler's admission pass."""
OFFLINE_BUDGET_S = 30.0
"""Seconds it may take in an offline plan or layout search: large enough never to be reached on a
loaded machine, so an offline answer does not depend on the machine's load."""


class GpuPool:
    """Thread-safe GPU accounting over one topology map; `solver_budget_s` caps the placement solver's
    time per job (it stops early only if the cap is reached; the result is otherwise deterministic)."""

    def __init__(self, topology: Any, source: str, *, solver_budget_s: float = ADMISSION_BUDGET_S):
        self.topology = topology
        self.solver_budget_s = solver_budget_s
        self.source = source
        self._lock = threading.Lock()
        self._held: dict[str, list[GpuSlot]] = {}
        self._slots: list[GpuSlot] = [(node, gpu) for node, gpus in node_gpus(topology) for gpu in gpus]
        self._index = FabricIndex.build(topology)

    @property
    def total(self) -> int:
        return len(self._slots)

    @property
    def free_count(self) -> int:
        with self._lock:
            return self.total - sum(len(s) for s in self._held.values())

    def free_slots(
        self, *, holder: str | None = None, down: Collection[str] = (), releasing: Collection[str] = ()
    ) -> set[GpuSlot]:
        """GPUs no job holds (those of ``holder`` count as free: it is being re-placed; so do those of the
        jobs in ``releasing``: what if they were stopped), off the ``down`` nodes."""
        freed = {holder, *releasing}
        with self._lock:
            used = {slot for job_id, slots in self._held.items() if job_id not in freed for slot in slots}
        return {slot for slot in self._slots if slot not in used and slot[0] not in down}

    def holders(self) -> dict[GpuSlot, str]:
        """Which job holds each used GPU."""
        with self._lock:
            return {slot: job_id for job_id, slots in self._held.items() for slot in slots}

    def place(
        self, job: ResolvedJob, *, empty: bool = False, holder: str | None = None, down: Collection[str] = (),
        releasing: Collection[str] = (),
    ) -> PlannedPlacement | None:
        """Where every rank of `job` would run on the free GPUs (or on the whole pool with `empty`) off
        the `down` nodes, counting `holder`'s GPUs as free (re-placing that job) and those of the jobs in
        `releasing` (preempting them); None when they do not all fit (gang scheduling: all or nothing)."""
        free: dict[str, set[int]] = {}
        for node, gpu in set(self._slots) if empty else self.free_slots(holder=holder, down=down, releasing=releasing):
            free.setdefault(node, set()).add(gpu)
        solved = place_job(job, self.topology, free, self.solver_budget_s, index=self._index)
        return None if solved is None else PlannedPlacement.from_solver(solved, job.grid)

    @property
    def index(self) -> FabricIndex:
        """The map compiled for placement (what the cost model reads)."""
        return self._index

    def reserve(self, job_id: str, placement: PlannedPlacement) -> None:
        with self._lock:
            self._held[job_id] = placement.slots

    def release(self, job_id: str) -> None:
        with self._lock:
            self._held.pop(job_id, None)

    def domains(self) -> dict[str, str]:
        """Each node's NVLink domain (the node itself when the map names none)."""
        return {node.name: self.topology.nvlink_group_of(node.name) or node.name for node in self.topology.nodes}

    def nccl_env(self) -> dict[str, dict[str, str]]:
        """Per node, the NCCL settings its ranks get from the topology map (`topology.nccl.nccl_env`)."""
        return {node.name: nccl_env(self.topology, node.name) for node in self.topology.nodes}

    def gpu_model(self, node: str) -> str | None:
        """The GPU model the map names for `node` (None when it names none)."""
        return self.topology.node(node).gpu_model

    def nodes(self) -> list[tuple[str, list[int]]]:
        """(node name, its GPU indices) in map order."""
        return [(node, list(gpus)) for node, gpus in node_gpus(self.topology)]


def _grid_coords(grid: RankGrid, rank: int) -> dict[str, int]:
    """`rank`'s coordinate along each grid dimension (without the derived expert ones)."""
    coords = grid.coords(rank)
    return {d: coords[d] for d in DIMS}


def node_gpus(topology: Any) -> list[tuple[str, list[int]]]:
    """(node name, GPUs that may get ranks) for every node of a topology map."""
    return [(node.name, list(node.usable_gpus)) for node in topology.nodes]
