"""Topology-aware rank placement: cost model and solver (pure Python; no torch, no Ray).

`place_job(job, topology, free, time_budget_s=0.5) -> Placement | None` (a `ResolvedJob`: its grid,
model and workload), `place(grid, topology, free, model=None, workload=None, ...)` for a bare grid, and
`capacity(topology) -> int` are what the planner, re-placement and the rank group call.
"""

from trainctl.workers.placement.plan import Placement, RankAssignment, SplitGroup
from trainctl.workers.placement.solver import PlacementError, capacity, place, place_job

__all__ = ["Placement", "PlacementError", "RankAssignment", "SplitGroup", "capacity", "place", "place_job"]
