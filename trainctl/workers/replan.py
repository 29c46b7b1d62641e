"""Re-placing a job after a node is lost: which nodes Ray has alive, which GPU slots are free on them,
and a new plan from the placement solver that avoids the lost nodes.

A node counts as lost once Ray declares it dead (its raylet failed the GCS health checks: about 15 s
after it vanished, with Ray's defaults); until then its slots look merely taken. The supervisor uses
`replacement` itself only when it was given a topology map (no GPU accounting above it); under the
service the scheduler computes the new plan from its pool, so two jobs are never promised one GPU.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.workers.nodes import cluster_nodes
from trainctl.workers.placement import place_job
from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.topology.model import TopologyMap


def live_nodes() -> set[str]:
    """``trainctl.io/node`` names of the Ray nodes that are alive."""
    return {n.name for n in cluster_nodes() if n.alive and n.name}


def missing_nodes(slots: Sequence[RankAssignment]) -> list[str]:
    """Nodes of a plan that no live Ray node carries as its name, sorted."""
    return sorted({slot.node for slot in slots} - live_nodes())


def free_slots(*, cuda: bool) -> dict[str, set[int]]:
    """Unreserved GPU slots of the live named Ray nodes with (``cuda``) or without real CUDA GPUs."""
    return {n.name: set(n.free_gpus) for n in cluster_nodes() if n.alive and n.name and (n.cuda_gpus > 0) == cuda}


def replacement(
    job: ResolvedJob, topology: TopologyMap, free: Mapping[str, set[int]], lost: Collection[str]
) -> list[RankAssignment] | None:
    """A plan for every rank of ``job`` on the ``free`` GPUs of ``topology`` off the ``lost`` nodes
    (the solver's best), or None when they do not all fit now."""
    known = {node.name: set(node.gpus) for node in topology.nodes}
    usable = {node: gpus & known[node] for node, gpus in free.items() if node in known and node not in lost}
    solved = place_job(job, topology, usable)
    if solved is None:
        return None
    return sorted(solved.assignments, key=lambda a: a.rank)


def describe_move(old: Sequence[RankAssignment], new: Sequence[RankAssignment], lost: Collection[str]) -> str:
    """One line for the event log: which node was lost and where its ranks went, e.g.
    ``node node-1 lost; re-placed ranks 2,3 on node-2 (rank 2 -> node-2 GPU 0, ...)``."""
    if len(new) != len(old):
        nodes = "node" + ("s" if len(lost) > 1 else "")
        ranks = "rank" + ("s" if len(new) > 1 else "")
        return f"{nodes} {', '.join(sorted(lost))} lost; shrunk to {len(new)} {ranks} (new plan: {describe_plan(new)})"
    moved = [slot.rank for slot in old if slot.node in lost]
    where = sorted({slot.node for slot in new if slot.rank in moved})
    nodes = "node" + ("s" if len(lost) > 1 else "")
    ranks = "rank" + ("s" if len(moved) > 1 else "")
    return (
        f"{nodes} {', '.join(sorted(lost))} lost; re-placed {ranks} {','.join(map(str, moved))} "
        f"on {', '.join(where)} (new plan: {describe_plan(new)})"
    )


def describe_plan(slots: Sequence[RankAssignment]) -> str:
    """``rank 0 -> node-1 GPU 0, rank 1 -> ...`` in rank order."""
    return ", ".join(f"rank {slot.rank} -> {slot.node} GPU {slot.gpu}" for slot in sorted(slots, key=lambda s: s.rank))
