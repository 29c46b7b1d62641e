"""PlanJob: what a valid job would look like on this pool, without recording anything.

Placement comes from the pool (the placement solver on the whole pool, as if it were empty, and
whether it fits on the GPUs free now); memory per rank and the modelled step time come from the
engine's estimator (trainctl.parallelism.estimator: exact local shapes from a meta-device model).
The modelled step time is compute at the device's peak FLOP rate plus the placement's modelled
communication, not overlapped: a lower bound on what the job will see. Devices without a known
peak (CPUs) get no compute time, and the plan says so.
"""

from __future__ import annotations

from trainctl.parallelism.estimator import estimate_all, flops_per_step
from trainctl.parallelism.flops import peak_flops
from trainctl.parallelism.grid import DIMS, RankGrid
from trainctl.service.pool import GpuPool
from trainctl.spec.job import TrainingJob
from trainctl.spec.presets import resolve_model
from trainctl.v1 import training_pb2 as pb

MAX_MEMORY_RANKS = 64
"""Above this many ranks, memory is estimated for one data-parallel replica."""


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
    _estimate(job, plan, pool.gpu_model(placement.assignments[0].node) if placement else None)
    return plan


def _estimate(job: TrainingJob, plan: pb.PlanJobResponse, gpu_model: str | None) -> None:
    config = resolve_model(job.spec.model)
    grid = RankGrid.from_spec(job.spec.parallelism)
    ranks = list(range(grid.world_size))
    if grid.world_size > MAX_MEMORY_RANKS:
        ranks = sorted({grid.rank_of(pp=p, dp_replicate=0, dp_shard=0, cp=0, tp=t) for p in range(grid.pp) for t in range(grid.tp)})
        plan.notes.append(f"memory shown for the {len(ranks)} ranks of data-parallel replica 0 (the others match them)")
    for m in estimate_all(config, job.spec, ranks):
        plan.memory.add(rank=m.rank, bytes={
            "parameters": m.params_bytes, "gradients": m.grads_bytes, "optimizer": m.optimizer_bytes,
            "activations": m.activations_bytes, "total": m.total_bytes,
        })
    communication = plan.placement_cost_seconds if plan.HasField("placement_cost_seconds") else 0.0
    device = None if job.spec.resources.device == "cpu" else gpu_model
    peak = peak_flops(device, job.spec.training.dtype)
    if peak is None:
        plan.step_time_breakdown["communication"] = communication
        plan.notes.append(f"compute time not modelled: no peak FLOP rate for device {device or 'cpu'!r}")
        return
    compute = flops_per_step(config, job.spec) / grid.world_size / peak
    plan.step_time_breakdown.update({"compute_at_peak": compute, "communication": communication})
    plan.step_time_seconds = compute + communication
