"""Elastic data parallel where the supervisor plans by itself (it was given a topology map): after a node loss,
a plan for the job's whole layout or, for an elastic job (`spec.scheduling.elastic`), for the largest of its
smaller layouts that fits the free GPUs; while it runs shrunk, the plan to grow back; and the lines the event
log gives each change of layout. Under the service the scheduler makes the same choices from its pool
(trainctl.service.scheduling.replacement). A plan's size names its layout (`trainctl.spec.validate.layout_on`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.spec.job import JobSpecBody
from trainctl.spec.validate import elastic_layouts
from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.replan import replacement
from trainctl.workers.topology.model import TopologyMap


def replacement_or_shrunk(
    resolved: ResolvedJob, topology: TopologyMap, free: Mapping[str, set[int]], lost: Collection[str],
) -> list[RankAssignment] | None:
    """A plan off the `lost` nodes on the `free` GPUs for the whole layout (`resolved`: the submitted job),
    else, for an elastic job, for its largest smaller layout that fits; None when none fits now."""
    slots = replacement(resolved, topology, free, lost)
    if slots is not None:
        return slots
    mapped = {node.name: set(node.gpus) for node in topology.nodes}
    usable = sum(len(gpus & mapped[node]) for node, gpus in free.items() if node in mapped and node not in lost)
    for body in elastic_layouts(resolved.spec, usable):
        slots = replacement(resolved.with_spec(body), topology, free, lost)
        if slots is not None:
            return slots
    return None


def grown_plan(
    resolved: ResolvedJob, topology: TopologyMap, free: Mapping[str, set[int]], own: list[RankAssignment],
) -> list[RankAssignment] | None:
    """A plan for the whole layout of a job running shrunk on `own`, on the `free` GPUs and its own; None
    when it does not fit yet."""
    usable = {node: set(gpus) for node, gpus in free.items()}
    for slot in own:
        usable.setdefault(slot.node, set()).add(slot.gpu)
    return replacement(resolved, topology, usable, ())


def layout_line(full: JobSpecBody, old: JobSpecBody, new: JobSpecBody) -> str:
    """How a change of layout reads in the event log, e.g. ``layout 4 -> 2 GPUs (dp_shard 4 -> 2): each replica
    accumulates 4 micro-batches instead of 2, the global batch of 8 unchanged; 2 of the job's 4 GPUs``."""
    before, after = old.parallelism, new.parallelism
    dims = ", ".join(
        f"{dim} {getattr(before, dim)} -> {getattr(after, dim)}" for dim in ("dp_replicate", "dp_shard")
        if getattr(before, dim) != getattr(after, dim)
    )
    line = f"layout {old.resources.gpus} -> {new.resources.gpus} GPUs ({dims})"
    train = full.training
    if train.micro_batch_size != "auto":
        line += (
            f": each replica accumulates {_micro(micro_batches(new))} instead of {_micro(micro_batches(old))}, "
            f"the global batch of {train.global_batch_size} unchanged"
        )
    return f"{line}; {new.resources.gpus} of the job's {full.resources.gpus} GPUs"


def micro_batches(body: JobSpecBody) -> int:
    """Micro-batches each data-parallel replica runs per step (a fixed micro-batch size)."""
    return body.training.global_batch_size // (body.parallelism.dp * int(body.training.micro_batch_size))


def _micro(count: int) -> str:
    return f"{count} micro-batch" + ("" if count == 1 else "es")
