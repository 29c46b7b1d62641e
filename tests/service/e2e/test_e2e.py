"""End to end over real gRPC on loopback, with the real RayRuntime on an embedded 2-node Ray
(1 simulated GPU per node, so 2-rank jobs span both nodes) and the real engine: lifecycle, gang
queueing and priority (one test: the job whose lifecycle is checked holds the pool the others queue
for), cancel without leaks. Small models, few ranks and few steps keep it to about
a minute and a half on a 2-core machine."""

from __future__ import annotations

import json
import time

import pytest
from ray.util.state import list_actors, list_placement_groups
from small_jobs import small_job

from trainctl.cli.client import TrainctlClient
from trainctl.cli.main import main
from trainctl.spec.job import TrainingJob
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.embedded import EmbeddedRay
from trainctl.workers.rank_group import owned_by
from trainctl.workers.supervisor import supervisor_name

pytestmark = pytest.mark.timeout(240)


def job(name: str, gpus: int, steps: int, priority: int = 0, preemptible: bool = True) -> TrainingJob:
    return small_job(name, gpus=gpus, steps=steps, labels={"suite": "e2e"}, data={"max_files": 20},
                     training={"lr": 0.005}, scheduling={"priority": priority, "preemptible": preemptible})


def states_of(events: list[pb.JobEvent]) -> list[int]:
    return [e.state_change.to_state for e in events if e.WhichOneof("payload") == "state_change"]


def leftovers(cluster: EmbeddedRay, job_id: str) -> tuple[list[str], list[str]]:
    """Names of the job's live actors and not-removed placement groups, from Ray's state API."""
    actors = [
        a.name for a in list_actors(address=cluster.address, filters=[("state", "!=", "DEAD")], limit=10_000)
        if a.name and (a.name == supervisor_name(job_id) or owned_by(a.name, job_id))
    ]
    groups = [
        g.name for g in list_placement_groups(address=cluster.address, filters=[("state", "!=", "REMOVED")], limit=10_000)
        if g.name and owned_by(g.name, job_id)
    ]
    return actors, groups


def test_job_lifecycle_gang_queueing_and_priority(client: TrainctlClient, capsys: pytest.CaptureFixture[str]) -> None:
    """One job that holds the whole pool, then two queued behind it. Lifecycle: the first job goes
    QUEUED, SCHEDULED, RUNNING, SUCCEEDED, reports every step (its loss falls), is placed on both nodes
    and `get -o json` shows its steps. Gang queueing and priority: the later jobs wait while it runs
    (the 1-GPU one for free GPUs, the 2-GPU one behind it), nothing runs beside it, and the
    higher-priority job, submitted later, runs first. The first job is not preemptible (preemption is
    test_preemption_e2e.py's)."""
    first = client.create_job(job("whole-pool", gpus=2, steps=10, preemptible=False))
    deadline = time.monotonic() + 60
    while client.get_job(first.id).status.state == pb.QUEUED:  # it holds the pool before the others queue
        assert time.monotonic() < deadline
        time.sleep(0.05)
    low = client.create_job(job("low", gpus=2, steps=2, priority=0))
    high = client.create_job(job("high", gpus=1, steps=2, priority=5))  # submitted later, runs earlier
    while client.get_job(first.id).status.state not in (pb.RUNNING, pb.SUCCEEDED):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    waiting_low, waiting_high = client.get_job(low.id).status, client.get_job(high.id).status
    if client.get_job(first.id).status.state == pb.RUNNING:
        assert waiting_low.state == pb.QUEUED and waiting_high.state == pb.QUEUED
        assert waiting_high.reason == "waiting for 1 GPUs: 0 of 2 free"
        assert waiting_low.reason.startswith(f"waiting behind {high.id}")

    # the first job's lifecycle
    events = list(client.watch(first.id))
    assert states_of(events) == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.SUCCEEDED]
    steps = [e.step for e in events if e.WhichOneof("payload") == "step"]
    assert [s.step for s in steps] == list(range(1, 11))
    final = client.get_job(first.id, full=True)
    s = final.status
    assert s.state == pb.SUCCEEDED and s.steps_done == 10 and s.total_steps == 10
    assert s.last_loss < 0.9 * s.first_loss, (s.first_loss, s.last_loss)
    assert s.first_loss == steps[0].loss and s.last_loss == steps[-1].loss
    assert [m.step for m in final.metrics] == list(range(1, 11))
    assert sorted((p.node, p.gpu) for p in s.placement) == [("node-0", 0), ("node-1", 0)]
    assert s.start_time.seconds and s.end_time.ToNanoseconds() >= s.start_time.ToNanoseconds()

    assert main(["--server", client.target, "get", first.id, "-o", "json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [m["loss"] for m in document["metrics"]] == [m.loss for m in final.metrics]
    assert all(m["tokens_per_second"] > 0 for m in document["metrics"])

    # gang queueing and priority
    for j in (high, low):
        for _ in client.watch(j.id):
            pass
    done = {j.id: client.get_job(j.id).status for j in (first, low, high)}
    assert all(s.state == pb.SUCCEEDED for s in done.values()), {k: s.reason for k, s in done.items()}
    end_first = done[first.id].end_time.ToNanoseconds()
    assert done[high.id].schedule_time.ToNanoseconds() >= end_first  # gang: nothing ran beside the first
    assert done[low.id].schedule_time.ToNanoseconds() >= done[high.id].schedule_time.ToNanoseconds()
    assert done[low.id].schedule_time.ToNanoseconds() >= done[high.id].end_time.ToNanoseconds()


def test_cancel_while_running_leaves_nothing_behind(client: TrainctlClient, cluster: EmbeddedRay) -> None:
    created = client.create_job(job("cancelled", gpus=2, steps=100_000))
    for event in client.watch(created.id):
        if event.WhichOneof("payload") == "step":
            break
    assert client.get_job(created.id).status.state == pb.RUNNING
    asked = time.monotonic()
    assert client.cancel_job(created.id).status.state == pb.CANCELLING
    tail = list(client.watch(created.id))  # ends at the terminal state
    took = time.monotonic() - asked
    assert states_of(tail)[-2:] == [pb.CANCELLING, pb.CANCELLED]
    assert took < 30, f"cancel took {took:.1f} s"
    assert leftovers(cluster, created.id) == ([], [])
    assert client.get_cluster().used_gpus == 0
