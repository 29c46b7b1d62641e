"""Topology-aware rank placement: cost model and solver (pure Python; no torch, no Ray).

`place(grid, topology, free, model=None, job_spec=None, time_budget_s=0.5) -> Placement | None` and
`capacity(topology) -> int` are what the scheduler and the rank group call.
"""

from trainctl.workers.placement.plan import Placement, RankAssignment, SplitGroup
from trainctl.workers.placement.solver import PlacementError, capacity, place

__all__ = ["Placement", "PlacementError", "RankAssignment", "SplitGroup", "capacity", "place"]
