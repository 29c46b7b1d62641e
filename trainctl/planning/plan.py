"""The plan of a job (`JobPlan`): what a valid job would look like on a pool, without recording
anything. The service's PlanJob plans on its pool; `trainctl plan FILE --cluster PRESET:N | --topology
MAP` plans offline on a topology map alone (`plan_on_map`); the wire turns either into the API's
PlanJobResponse (trainctl.wire.plan_convert).

Placement comes from the pool (the placement solver on the whole pool, as if it were empty, and
whether it fits on the GPUs free now); memory per rank comes from `fit.estimate_ranks` (the engine's
estimator, bounded); the modelled step time (trainctl.parallelism.sizing.step_time, shared with the
layout search) is compute at the device's peak FLOP rate, plus activation recomputation, plus the
pipeline bubble of the job's schedule over that busy time, plus the placement's modelled
communication, not overlapped: a lower bound on compute, an upper bound on exposed communication.
Devices without a known peak (CPUs) get no compute time, and the plan says so.

`plan_response` is the one answer of both the service's PlanJob and the offline plan; they differ only
in what they check first (the service also confines paths and reads the data and `init_from`; the
offline plan has no service, so no tenant paths, no data and no jobs to read).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from trainctl.parallelism.layouts.grid import DIMS, RankGrid
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.parallelism.sizing.device_memory import gpu_memory_bandwidth
from trainctl.parallelism.sizing.estimator import MemoryEstimate
from trainctl.parallelism.sizing.flops import peak_flops
from trainctl.parallelism.sizing.step_time import modelled_step_time
from trainctl.planning.fit import estimable, estimate_ranks, fit_violations
from trainctl.planning.pool import OFFLINE_BUDGET_S, GpuPool, PlannedPlacement
from trainctl.spec.job import TrainingJob
from trainctl.spec.model_checks import pretrained_check, pretrained_warnings
from trainctl.spec.validate import FieldViolation, elastic_layouts, semantic_violations
from trainctl.workers.topology import TopologyMap

MAX_MEMORY_RANKS = 64
"""Above this many ranks, memory is estimated for one data-parallel replica."""


@dataclass(frozen=True)
class JobPlan:
    """A job's plan on a pool, or its refusal (`violations`, no `grid`)."""

    pool_gpus: int
    free_gpus: int
    violations: tuple[FieldViolation, ...] = ()
    """Every rule the job breaks (a refusal); empty for a plan."""
    grid: RankGrid | None = None
    """The job's rank grid; None for a refusal."""
    placement: PlannedPlacement | None = None
    """Rank -> (node, GPU) on the whole pool as if empty; None when no placement exists."""
    fits_now: bool = False
    """Whether the job would start now on the GPUs free now."""
    memory: tuple[MemoryEstimate, ...] = ()
    """Estimated bytes of each rank shown (the notes say when some are left out), by rank."""
    step_time_seconds: float | None = None
    """Modelled seconds per optimizer step; None when compute is not modelled (no peak FLOP rate)."""
    step_time_breakdown: Mapping[str, float] = field(default_factory=dict)
    """The step time's terms by name (`StepTime.terms()`; communication alone when compute is not modelled)."""
    notes: tuple[str, ...] = ()
    """What the plan could not compute, and why; a valid job's warnings (`warning: field: description`)."""

    @property
    def valid(self) -> bool:
        return self.grid is not None

    @property
    def world_size(self) -> int:
        return 0 if self.grid is None else self.grid.world_size

    @property
    def degrees(self) -> dict[str, int]:
        """The grid's degree along each dimension, `ep` included (empty for a refusal)."""
        return {} if self.grid is None else {**{d: getattr(self.grid, d) for d in DIMS}, "ep": self.grid.ep}

    def with_warnings(self, warnings: Iterable[FieldViolation]) -> JobPlan:
        """This plan with a valid job's warnings (`spec.model_checks.pretrained_warnings`) as notes."""
        return replace(self, notes=(*self.notes, *(f"warning: {w.field}: {w.description}" for w in warnings)))


def plan_response(job: ResolvedJob | None, violations: list[FieldViolation], pool: GpuPool) -> JobPlan:
    """PlanJob's answer: the refusal naming every violation, or (with none) the plan of `job` on `pool`."""
    if violations or job is None:
        return JobPlan(pool_gpus=pool.total, free_gpus=pool.free_count, violations=tuple(violations))
    return plan_job(job, pool)


def plan_on_map(job: TrainingJob, topology: TopologyMap, source: str) -> JobPlan:
    """The plan of `job` on an empty cluster described by `topology` alone, no service involved: the
    spec's rules against the map's GPU count, the `from_pretrained` directory, the fit on the map's
    largest GPU, then `plan_response` as the service answers."""
    pool = GpuPool(topology, source, solver_budget_s=OFFLINE_BUDGET_S)
    model, problems = pretrained_check(job)
    violations = semantic_violations(job, pool_gpus=pool.total, check_data=False) + problems
    resolved = None
    if not violations:
        resolved = ResolvedJob.resolve(job.spec, model=model)
        violations = fit_violations(resolved, pool)
    plan = plan_response(resolved, violations, pool)
    return plan.with_warnings(pretrained_warnings(job, model)) if plan.valid else plan


def plan_job(job: ResolvedJob, pool: GpuPool) -> JobPlan:
    """The plan of a semantically valid job."""
    grid = job.grid
    notes: list[str] = []
    placement = pool.place(job, empty=True)
    if placement is None:
        notes.append(f"no placement of {grid.world_size} ranks exists on this pool of {pool.total} GPUs")
    plan = JobPlan(pool_gpus=pool.total, free_gpus=pool.free_count, grid=grid, placement=placement,
                   fits_now=pool.place(job) is not None)
    if job.spec.command is not None:
        notes.append("a command job runs its own program: no memory or step-time estimate")
        return replace(plan, notes=tuple(notes))
    if job.spec.scheduling.elastic is not None:
        notes.append(elastic_note(job, pool))
    gpu_model = pool.gpu_model(placement.assignments[0].node) if placement else None
    return _estimated(job, plan, gpu_model, notes)


def elastic_note(job: ResolvedJob, pool: GpuPool) -> str:
    """What an elastic job may shrink to after a node loss (`scheduling.elastic`), each smaller layout said to fit
    the pool's GPUs or not (the scheduler takes only one that fits)."""
    sizes = []
    for body in elastic_layouts(job.spec, job.spec.resources.gpus - 1):
        par = body.parallelism
        fits = "" if not fit_violations(job.with_spec(body), pool) else ", which does not fit the pool's GPUs"
        sizes.append(f"{body.resources.gpus} GPUs (dp_replicate {par.dp_replicate} x dp_shard {par.dp_shard}{fits})")
    return ("scheduling.elastic: after a node loss with no GPU to replace it, the job may shrink to " + "; ".join(sizes)
            + ", the global batch kept; it grows back when GPUs are free")


def _estimated(job: ResolvedJob, plan: JobPlan, gpu_model: str | None, notes: list[str]) -> JobPlan:
    """`plan` with its memory per rank and modelled step time, `notes` completed."""
    grid = job.grid
    ranks = list(range(grid.world_size))
    if grid.world_size > MAX_MEMORY_RANKS:
        ranks = sorted({grid.rank_of(pp=p, dp_replicate=0, dp_shard=0, cp=0, tp=t) for p in range(grid.pp) for t in range(grid.tp)})
        notes.append(f"memory shown for the {len(ranks)} ranks of data-parallel replica 0 (the others match them)")
    estimates, dropped = estimate_ranks(estimable(job), ranks)
    if job.spec.training.micro_batch_size == "auto":
        notes.append("micro_batch_size auto: activations and the pipeline bubble shown for micro-batch 1 (the engine picks "
                     "the largest that fits)")
    if dropped:
        notes.append("memory shown for the first dp_shard x cp rank of each stage (the largest under FSDP padding); the model is too "
                     "large to estimate every shard")
    plan = replace(plan, memory=tuple(estimates.values()))
    placement = plan.placement
    communication = placement.cost_seconds if placement is not None and placement.cost_seconds is not None else 0.0
    device = None if job.spec.resources.device == "cpu" else gpu_model
    peak = peak_flops(device, job.spec.training.dtype)
    if peak is None:
        notes.append(f"compute time not modelled: no peak FLOP rate for device {device or 'cpu'!r}")
        return replace(plan, step_time_breakdown={"communication": communication}, notes=tuple(notes))
    bandwidth = gpu_memory_bandwidth(device)
    if bandwidth is None:
        notes.append(f"optimizer step not modelled: no memory bandwidth known for device {device!r}")
    if job.spec.training.fp8 != "none" and peak_flops(device, "float8") is None:
        notes.append(f"training.fp8: {device!r} has no float8 tensor cores; the engine refuses the job there")
    step = modelled_step_time(job.config, estimable(job).spec, peak, placement.seconds_by_dim if placement else {},
                              memory_bandwidth=bandwidth)
    if step.overlapped:
        notes.append(f"{step.overlapped * 1e3:.2f} ms of data- and context-parallel communication overlaps compute "
                     "(not in the step time)")
    return replace(plan, step_time_seconds=step.total, step_time_breakdown=step.terms(), notes=tuple(notes))
