"""A plan (trainctl.planning.plan.JobPlan) as the API's PlanJobResponse: what the service's PlanJob
answers and what `trainctl plan --cluster | --topology` prints offline. The planning layer is imported
for its types only, so loading the wire loads no planner."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainctl.spec.bounds import INT64_MAX
from trainctl.v1 import training_pb2 as pb

if TYPE_CHECKING:
    from trainctl.planning.plan import JobPlan


def plan_to_proto(plan: JobPlan) -> pb.PlanJobResponse:
    """`plan` field by field; memory byte counts are clamped to int64 (a job that large is refused anyway)."""
    message = pb.PlanJobResponse(
        valid=plan.valid,
        violations=[pb.Violation(field=v.field, description=v.description) for v in plan.violations],
        world_size=plan.world_size,
        grid=plan.degrees,
        pool_gpus=plan.pool_gpus,
        free_gpus=plan.free_gpus,
        fits_now=plan.fits_now,
        memory=[pb.RankMemory(rank=m.rank, bytes={name: min(value, INT64_MAX) for name, value in (
            ("parameters", m.params_bytes), ("gradients", m.grads_bytes), ("optimizer", m.optimizer_bytes),
            ("activations", m.activations_bytes), ("working_copies", m.working_bytes), ("total", m.total_bytes),
        )}) for m in plan.memory],
        step_time_breakdown=plan.step_time_breakdown,
        notes=plan.notes,
    )
    if plan.placement is not None:
        for row in plan.placement.records():
            message.placement.add(rank=row["rank"], node=row["node"], gpu=row["gpu"], coords=row["coords"])
        if plan.placement.cost_seconds is not None:
            message.placement_cost_seconds = plan.placement.cost_seconds
    if plan.step_time_seconds is not None:
        message.step_time_seconds = plan.step_time_seconds
    return message

