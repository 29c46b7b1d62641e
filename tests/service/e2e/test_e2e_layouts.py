"""The shipped MoE example spec trains to completion through the service, over real gRPC on loopback, on
an embedded 2-node Ray with 4 simulated GPUs per node (the demo's cluster): examples/moe.yaml (MoE,
dp_shard4 x ep2, 4 ranks), shortened to a few steps. Every rank runs where the placement put it, the
loss falls, and nothing of the job is left in Ray afterwards. examples/demo.yaml (pp2 x dp_shard2 x
tp2, 8 ranks) trains through `trainctl serve` as the README's commands run it, with the same checks
and tensor-parallel peers on one node (test_readme_commands.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_e2e import leftovers, states_of

from trainctl.cli.client import TrainctlClient
from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.spec.job import TrainingJob
from trainctl.spec.validate import load_job_file
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.embedded import EmbeddedRay

pytestmark = [pytest.mark.timeout(420), pytest.mark.cluster(nodes=2, gpus_per_node=4)]

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
STEPS = 6


def shortened(example: str) -> TrainingJob:
    """An example spec as users submit it, cut to a few steps with no mid-run checkpoint."""
    job = load_job_file(EXAMPLES / example).model_copy(deep=True)
    job.spec.training.steps = STEPS
    job.spec.training.warmup_steps = 1
    job.spec.training.log_interval = 1
    job.spec.checkpoint.interval_steps = 0
    return job


@pytest.mark.parametrize("example", ["moe.yaml"])
def test_example_layout_trains_through_the_service(client: TrainctlClient, cluster: EmbeddedRay, example: str) -> None:
    spec = shortened(example)
    created = client.create_job(spec)
    events = list(client.watch(created.id))
    status = client.get_job(created.id).status
    assert states_of(events) == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.SUCCEEDED], status.reason
    assert status.steps_done == STEPS
    assert status.last_loss < status.first_loss, (status.first_loss, status.last_loss)

    grid = RankGrid.from_spec(spec.spec.parallelism)
    where = {p.rank: p.node for p in status.placement}
    assert sorted(where) == list(range(grid.world_size))
    for group in grid.groups("tp"):
        assert len({where[r] for r in group}) == 1, f"TP group {group} straddles nodes: {where}"
    deadline = time.monotonic() + 30  # the supervisor is removed and the GPUs released after the last event
    while (any(leftovers(cluster, created.id)) or client.get_cluster().used_gpus) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert leftovers(cluster, created.id) == ([], [])
    assert client.get_cluster().used_gpus == 0
