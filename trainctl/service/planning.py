"""PlanJob: what a valid job would look like on this pool, without recording anything.

Placement comes from the pool (the placement solver on the whole pool, as if it were empty, and
whether it fits on the GPUs free now); memory per rank and the modelled step time come from the
engine's estimator (trainctl.parallelism.estimator), which is pure arithmetic (no torch).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from trainctl.parallelism.grid import DIMS, RankGrid
from trainctl.service.pool import GpuPool
from trainctl.spec.job import TrainingJob
from trainctl.v1 import training_pb2 as pb

ESTIMATOR_MODULE = "trainctl.parallelism.estimator"


def plan_job(job: TrainingJob, pool: GpuPool) -> pb.PlanJobResponse:
    """The plan of a semantically valid job."""
    grid = RankGrid.from_spec(job.spec.parallelism)
    plan = pb.PlanJobResponse(
        valid=True,
        world_size=grid.world_size,
        grid={**{d: getattr(grid, d) for d in DIMS}, "ep": grid.ep},
        pool_gpus=pool.total,
        free_gpus=pool.free_count,
    )
    placement = pool.place(job, empty=True)
    if placement is None:
        plan.notes.append(f"no placement of {grid.world_size} ranks exists on this pool of {pool.total} GPUs")
    else:
        for row in placement.records():
            plan.placement.add(rank=row["rank"], node=row["node"], gpu=row["gpu"], coords=row["coords"])
        if placement.cost_seconds is not None:
            plan.placement_cost_seconds = placement.cost_seconds
    plan.fits_now = pool.place(job) is not None
    _estimate(job, plan)
    return plan


def _estimate(job: TrainingJob, plan: pb.PlanJobResponse) -> None:
    if importlib.util.find_spec(ESTIMATOR_MODULE) is None:
        plan.notes.append(f"memory and step-time estimates unavailable: {ESTIMATOR_MODULE} is not installed")
        return
    estimator: Any = importlib.import_module(ESTIMATOR_MODULE)
    estimate = estimator.estimate(job.spec)
    for rank, memory in enumerate(estimate.memory_per_rank):
        plan.memory.add(rank=rank, bytes={k: int(v) for k, v in memory.items()})
    if estimate.step_time_seconds is not None:
        plan.step_time_seconds = estimate.step_time_seconds
    plan.step_time_breakdown.update({k: float(v) for k, v in estimate.step_time_breakdown.items()})
