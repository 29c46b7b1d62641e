"""Memory per rank within a bounded cost, and the submit-time check that a job's ranks fit the largest
GPU of the pool (CreateJob, PlanJob, the offline plan, a sweep's trials).

Estimates come from the engine's estimator (trainctl.parallelism.sizing.estimator: exact local shapes
computed from the model's configuration, never by building it). Cost is bounded whatever the request:
the spec's field bounds (trainctl.spec.bounds) cap the parameter count per rank, ranks with the same
estimate are estimated once (`rank_class`), and at most `MAX_ESTIMATED_PARAMS` parameter shapes are
visited per call.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.parallelism.sizing.device_memory import gpu_memory_bytes
from trainctl.parallelism.sizing.estimator import MemoryEstimate, estimate_memory, model_plan
from trainctl.parallelism.sizing.micro_batch import with_micro_batch_size
from trainctl.planning.pool import GpuPool
from trainctl.spec.validate import FieldViolation

MAX_ESTIMATED_PARAMS = 200_000
"""Parameter shapes one plan's memory estimate may visit (distinct ranks x parameters per rank);
beyond it only the first shard of each pipeline stage (the largest under FSDP padding) is estimated."""


def rank_class(grid: RankGrid, rank: int) -> tuple[int, int]:
    """(pipeline stage, index in the dp_shard x cp group): ranks with the same class hold the same
    bytes (tensor, expert and replica splits are even, which validation guarantees)."""
    coords = grid.coords(rank)
    return coords["pp"], coords["dp_shard"] * grid.cp + coords["cp"]


def estimable(job: ResolvedJob) -> ResolvedJob:
    """The job as the estimator takes it: micro_batch_size `auto` as 1, the smallest the engine may pick
    (so the estimate is a lower bound of what `auto` will use)."""
    auto = job.spec.training.micro_batch_size == "auto"
    return job.with_spec(with_micro_batch_size(job.spec, 1)) if auto else job


def estimate_ranks(job: ResolvedJob, ranks: Iterable[int]) -> tuple[dict[int, MemoryEstimate], bool]:
    """The memory estimate of each of `ranks` (one computation per `rank_class`) within the
    `MAX_ESTIMATED_PARAMS` budget, and whether the budget dropped some (then only ranks of shard 0 are in)."""
    grid = job.grid
    plan = model_plan(job.config, job.spec)
    classes: dict[tuple[int, int], list[int]] = {}
    for rank in ranks:
        classes.setdefault(rank_class(grid, rank), []).append(rank)
    per_rank = len(plan.shapes) // grid.pp + 1
    dropped = len(classes) * per_rank > MAX_ESTIMATED_PARAMS
    if dropped:
        classes = {key: members for key, members in classes.items() if key[1] == 0}
    out: dict[int, MemoryEstimate] = {}
    for members in classes.values():
        first = estimate_memory(job, members[0], plan)
        for rank in members:
            out[rank] = replace(first, rank=rank)
    return dict(sorted(out.items())), dropped


def fit_violations(job: ResolvedJob, pool: GpuPool) -> list[FieldViolation]:
    """The job's largest per-rank estimate against the largest GPU memory of the pool (known GPU models
    only): a job that cannot fit on its own layout is refused with both numbers. A command job's memory is
    its program's, unknown here: never refused."""
    capacity = max((gpu_memory_bytes(pool.gpu_model(node)) or 0 for node, _ in pool.nodes()), default=0)
    if not capacity or job.spec.resources.device == "cpu" or job.model is None:
        return []
    first_shards = [job.grid.rank_of(pp=p) for p in range(job.grid.pp)]
    estimates, _ = estimate_ranks(estimable(job), first_shards)
    worst = max(estimates.values(), key=lambda m: m.total_bytes)
    if worst.total_bytes <= capacity:
        return []
    return [FieldViolation(
        "spec.resources.gpus",
        f"rank {worst.rank} needs an estimated {worst.total_bytes / 2**30:.1f} GiB (parameters "
        f"{worst.params_bytes / 2**30:.1f}, gradients {worst.grads_bytes / 2**30:.1f}, optimizer "
        f"{worst.optimizer_bytes / 2**30:.1f}, activations {worst.activations_bytes / 2**30:.1f}, working copies "
        f"{worst.working_bytes / 2**30:.1f}) but the pool's "
        f"largest GPU has {capacity / 2**30:.1f} GiB: shard the model further (dp_shard, tp, pp) or shrink it",
    )]
