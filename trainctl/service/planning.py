"""PlanJob: what a valid job would look like on this pool, without recording anything; the same plan
offline, on a topology map alone (`trainctl plan FILE --cluster PRESET:N | --topology MAP`); and the
submit-time check that a job's ranks fit the largest GPU of the pool.

Placement comes from the pool (the placement solver on the whole pool, as if it were empty, and
whether it fits on the GPUs free now); memory per rank and the modelled step time come from the
engine's estimator (trainctl.parallelism.sizing.estimator: exact local shapes computed from the model's
configuration, never by building it). The modelled step time (trainctl.parallelism.sizing.step_time,
shared with the layout search) is compute at the device's peak FLOP rate, plus activation
recomputation, plus the pipeline bubble of the job's schedule over that busy time, plus the
placement's modelled communication, not overlapped: a lower bound on compute, an upper bound on
exposed communication. Devices without a known peak (CPUs) get no compute time, and the plan says so.

`plan_response` is the one answer of both the service's PlanJob and the offline plan; they differ only
in what they check first (the service also confines paths and reads the data and `init_from`; the
offline plan has no service, so no tenant paths, no data and no jobs to read).

Cost is bounded whatever the request: the spec's field bounds (trainctl.spec.job) cap the parameter
count per rank, ranks with the same estimate are estimated once (`rank_classes`), and at most
`MAX_ESTIMATED_PARAMS` parameter shapes are visited per plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from trainctl.parallelism.layouts.grid import DIMS, RankGrid
from trainctl.parallelism.sizing.device_memory import gpu_memory_bytes
from trainctl.parallelism.sizing.estimator import MemoryEstimate, estimate_memory, model_plan
from trainctl.parallelism.sizing.flops import peak_flops
from trainctl.parallelism.sizing.micro_batch import with_micro_batch_size
from trainctl.parallelism.sizing.step_time import modelled_step_time
from trainctl.service.pool import OFFLINE_BUDGET_S, GpuPool
from trainctl.spec.job import INT64_MAX, JobSpecBody, TrainingJob
from trainctl.spec.presets import ModelConfig, resolve_model
from trainctl.spec.validate import (
    FieldViolation,
    pretrained_violations,
    pretrained_warnings,
    semantic_violations,
)
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.topology import TopologyMap

MAX_MEMORY_RANKS = 64
"""Above this many ranks, memory is estimated for one data-parallel replica."""
MAX_ESTIMATED_PARAMS = 200_000
"""Parameter shapes one plan's memory estimate may visit (distinct ranks x parameters per rank);
beyond it only the first shard of each pipeline stage (the largest under FSDP padding) is estimated."""


def plan_response(job: TrainingJob | None, violations: list[FieldViolation], pool: GpuPool) -> pb.PlanJobResponse:
    """PlanJob's answer: the refusal naming every violation, or (with none) the plan of `job` on `pool`."""
    if violations or job is None:
        return pb.PlanJobResponse(
            valid=False,
            violations=[pb.Violation(field=v.field, description=v.description) for v in violations],
            pool_gpus=pool.total,
            free_gpus=pool.free_count,
        )
    return plan_job(job, pool)


def plan_on_map(job: TrainingJob, topology: TopologyMap, source: str) -> pb.PlanJobResponse:
    """The plan of `job` on an empty cluster described by `topology` alone, no service involved: the
    spec's rules against the map's GPU count, the `from_pretrained` directory, the fit on the map's
    largest GPU, then `plan_response` as the service answers."""
    pool = GpuPool(topology, source, solver_budget_s=OFFLINE_BUDGET_S)
    violations = semantic_violations(job, pool_gpus=pool.total, check_data=False) + pretrained_violations(job)
    if not violations:
        violations = fit_violations(job, pool)
    plan = plan_response(job, violations, pool)
    if plan.valid:
        plan.notes.extend(warning_notes(pretrained_warnings(job)))
    return plan


def warning_notes(warnings: list[FieldViolation]) -> list[str]:
    """A valid job's warnings (`trainctl.spec.validate.pretrained_warnings`) as plan notes."""
    return [f"warning: {w.field}: {w.description}" for w in warnings]


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
    if job.spec.command is not None:
        plan.notes.append("a command job runs its own program: no memory or step-time estimate")
        return plan
    _estimate(job, plan, pool.gpu_model(placement.assignments[0].node) if placement else None,
              placement.seconds_by_dim if placement else {})
    return plan


def rank_class(grid: RankGrid, rank: int) -> tuple[int, int]:
    """(pipeline stage, index in the dp_shard x cp group): ranks with the same class hold the same
    bytes (tensor, expert and replica splits are even, which validation guarantees)."""
    coords = grid.coords(rank)
    return coords["pp"], coords["dp_shard"] * grid.cp + coords["cp"]


def estimable(job: TrainingJob) -> JobSpecBody:
    """The job's spec as the estimator takes it: micro_batch_size `auto` as 1, the smallest the engine
    may pick (so the estimate is a lower bound of what `auto` will use)."""
    return with_micro_batch_size(job.spec, 1) if job.spec.training.micro_batch_size == "auto" else job.spec


def estimate_ranks(config: ModelConfig, body: JobSpecBody, ranks: Iterable[int]) -> tuple[dict[int, MemoryEstimate], bool]:
    """The memory estimate of each of `ranks` (one computation per `rank_class`) within the
    `MAX_ESTIMATED_PARAMS` budget, and whether the budget dropped some (then only ranks of shard 0 are in)."""
    grid = RankGrid.from_spec(body.parallelism)
    plan = model_plan(config, body)
    classes: dict[tuple[int, int], list[int]] = {}
    for rank in ranks:
        classes.setdefault(rank_class(grid, rank), []).append(rank)
    per_rank = len(plan.shapes) // grid.pp + 1
    dropped = len(classes) * per_rank > MAX_ESTIMATED_PARAMS
    if dropped:
        classes = {key: members for key, members in classes.items() if key[1] == 0}
    out: dict[int, MemoryEstimate] = {}
    for members in classes.values():
        first = estimate_memory(config, body, members[0], plan)
        for rank in members:
            out[rank] = replace(first, rank=rank)
    return dict(sorted(out.items())), dropped


def fit_violations(job: TrainingJob, pool: GpuPool) -> list[FieldViolation]:
    """The job's largest per-rank estimate against the largest GPU memory of the pool (known GPU models
    only): a job that cannot fit on its own layout is refused with both numbers. A command job's memory is
    its program's, unknown here: never refused."""
    capacity = max((gpu_memory_bytes(pool.gpu_model(node)) or 0 for node, _ in pool.nodes()), default=0)
    if not capacity or job.spec.resources.device == "cpu" or job.spec.command is not None:
        return []
    config = resolve_model(job.spec.model)
    grid = RankGrid.from_spec(job.spec.parallelism)
    first_shards = [grid.rank_of(pp=p) for p in range(grid.pp)]
    estimates, _ = estimate_ranks(config, estimable(job), first_shards)
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


def _estimate(job: TrainingJob, plan: pb.PlanJobResponse, gpu_model: str | None, seconds_by_dim: Mapping[str, float]) -> None:
    config = resolve_model(job.spec.model)
    grid = RankGrid.from_spec(job.spec.parallelism)
    ranks = list(range(grid.world_size))
    if grid.world_size > MAX_MEMORY_RANKS:
        ranks = sorted({grid.rank_of(pp=p, dp_replicate=0, dp_shard=0, cp=0, tp=t) for p in range(grid.pp) for t in range(grid.tp)})
        plan.notes.append(f"memory shown for the {len(ranks)} ranks of data-parallel replica 0 (the others match them)")
    estimates, dropped = estimate_ranks(config, estimable(job), ranks)
    if job.spec.training.micro_batch_size == "auto":
        plan.notes.append("micro_batch_size auto: activations and the pipeline bubble shown for micro-batch 1 (the engine picks "
                          "the largest that fits)")
    if dropped:
        plan.notes.append("memory shown for the first dp_shard x cp rank of each stage (the largest under FSDP padding); the model is too "
                          "large to estimate every shard")
    for m in estimates.values():
        plan.memory.add(rank=m.rank, bytes={  # RankMemory.bytes is int64: clamp (such a job is refused anyway)
            name: min(value, INT64_MAX) for name, value in (
                ("parameters", m.params_bytes), ("gradients", m.grads_bytes), ("optimizer", m.optimizer_bytes),
                ("activations", m.activations_bytes), ("working_copies", m.working_bytes), ("total", m.total_bytes),
            )
        })
    communication = plan.placement_cost_seconds if plan.HasField("placement_cost_seconds") else 0.0
    device = None if job.spec.resources.device == "cpu" else gpu_model
    peak = peak_flops(device, job.spec.training.dtype)
    if peak is None:
        plan.step_time_breakdown["communication"] = communication
        plan.notes.append(f"compute time not modelled: no peak FLOP rate for device {device or 'cpu'!r}")
        return
    step = modelled_step_time(config, estimable(job), peak, seconds_by_dim)
    plan.step_time_breakdown.update(step.terms())
    plan.step_time_seconds = step.total
    if step.overlapped:
        plan.notes.append(f"{step.overlapped * 1e3:.2f} ms of data- and context-parallel communication overlaps compute "
                          "(not in the step time)")
