"""A command job's declared layout places its ranks with the same solver and guarantees as a built-in
job (issue 15): each tensor-parallel group inside one NVLink domain whenever the free GPUs allow it, and
the same plan as a built-in job of that layout."""

from __future__ import annotations

import pytest

from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.planning.pool import GpuPool, PlannedPlacement
from trainctl.spec.job import TrainingJob
from trainctl.workers.placement import RankAssignment
from trainctl.workers.topology import simulated_topology

OTHER_JOB = [("node-0", 3), ("node-2", 0), ("node-2", 1)]
"""GPUs another job holds: node-1 and node-3 are the only wholly free NVLink domains of 4 GPUs."""


def command_job(parallelism: dict[str, int]) -> TrainingJob:
    gpus = RankGrid(**parallelism).world_size
    spec = {"command": {"program": "python", "args": ["train.py"]}, "parallelism": parallelism, "resources": {"gpus": gpus}}
    return TrainingJob.model_validate({"metadata": {"name": "byo"}, "spec": spec})


def fragmented_pool() -> GpuPool:
    pool = GpuPool(simulated_topology(4, 4), "simulated")
    pool.reserve("other", PlannedPlacement(assignments=tuple(
        RankAssignment(rank=r, node=node, gpu=gpu) for r, (node, gpu) in enumerate(OTHER_JOB)
    )))
    return pool


@pytest.mark.parametrize("layout", [{"tp": 4, "dp_replicate": 2}, {"tp": 2, "dp_replicate": 3}, {"tp": 2, "pp": 2, "dp_replicate": 2}])
def test_declared_tp_groups_share_an_nvlink_domain(layout: dict[str, int]) -> None:
    pool = fragmented_pool()
    job = command_job(layout)
    planned = pool.place(ResolvedJob.resolve(job.spec))
    assert planned is not None
    domains = pool.domains()
    where = {a.rank: a for a in planned.assignments}
    grid = RankGrid.from_spec(job.spec.parallelism)
    for group in grid.groups("tp"):
        assert len({domains[where[rank].node] for rank in group}) == 1, (group, [where[r] for r in group])
    assert not set(planned.slots) & set(OTHER_JOB)


def test_a_command_job_is_placed_exactly_like_the_built_in_job_of_its_layout() -> None:
    pool = fragmented_pool()
    layout = {"tp": 4, "dp_replicate": 2}
    built_in = TrainingJob.model_validate({
        "metadata": {"name": "engine"},
        "spec": {"parallelism": layout, "resources": {"gpus": 8}, "training": {"global_batch_size": 8}},
    })
    command = ResolvedJob.resolve(command_job(layout).spec)
    assert pool.place(command) == pool.place(ResolvedJob.resolve(built_in.spec))
    assert sorted({node for node, _ in pool.place(command).slots}) == ["node-1", "node-3"]
