"""The scheduler's side of elastic data parallel (`spec.scheduling.elastic`), on a scripted runtime: a job that
lost a node and does not fit whole is re-placed on its largest smaller layout that fits, and grows back once
its whole layout fits again, after the queue had its pick; a job without the option waits as before."""

from __future__ import annotations

from pathlib import Path

from control_plane_fakes import ScriptedRuntime, make_scheduler
from prometheus_client import CollectorRegistry
from small_jobs import small_job

from trainctl.service.metrics import ServiceMetrics
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.spec.job import TrainingJob
from trainctl.workers.events import EventKind, JobState


def elastic(name: str, gpus: int, min_gpus: int | None) -> TrainingJob:
    """A `gpus`-rank FSDP job of global batch 8 (elastic down to `min_gpus` when given)."""
    scheduling = {} if min_gpus is None else {"elastic": {"min_gpus": min_gpus}}
    return small_job(name, gpus=gpus, training={"global_batch_size": 8}, checkpoint={"interval_steps": 2},
                     scheduling=scheduling)


def submit(scheduler: Scheduler, job: TrainingJob) -> str:
    return scheduler.store.create_job(job)[0].id


def nodes_of(placement) -> set[str]:
    return {a.node for a in placement.assignments}


def counter(registry: CollectorRegistry, name: str, job_id: str) -> float:
    return registry.get_sample_value(name, {"job_id": job_id, "tenant": "default"}) or 0.0


def lose_a_node_of(s: Scheduler, runtime: ScriptedRuntime, job_id: str) -> str:
    """Run `job_id`, then take one of its nodes away; returns that node."""
    s.tick()
    runtime.state(job_id, JobState.RUNNING)
    lost = sorted(nodes_of(dict(runtime.started)[job_id]))[-1]
    runtime.lose_node(job_id, lost)
    s.tick()
    return lost


def test_an_elastic_job_shrinks_to_the_gpus_left_and_grows_back_after_the_queue_had_its_pick(tmp_path: Path) -> None:
    runtime = ScriptedRuntime(nodes={"node-0", "node-1"})
    s = make_scheduler(tmp_path, runtime, nodes=2, gpus=2)  # 4 GPUs
    registry = CollectorRegistry()
    s.metrics = ServiceMetrics(registry)
    a = submit(s, elastic("a", 4, min_gpus=2))
    lost = lose_a_node_of(s, runtime, a)
    [(job_id, shrunk)] = runtime.plans
    assert job_id == a and len(shrunk.assignments) == 2 and lost not in nodes_of(shrunk)
    assert [(a_.rank, a_.node) for a_ in shrunk.assignments] == [(0, "node-0"), (1, "node-0")]
    record = s.store.get_job(a)
    assert record.reason == f"node(s) {lost} lost; re-placed 2 ranks on node-0 (shrunk: 2 of its 4 GPUs)", record.reason
    assert record.placement == shrunk.records() and len(s.pool.holders()) == 2
    assert [r["coords"]["dp_shard"] for r in record.placement] == [0, 1], "the coordinates of the dp_shard=2 grid"
    assert counter(registry, "trainctl_job_resizes_total", a) == 1

    # The node returns while a job is queued: the queue gets the GPUs first, and a does not grow.
    runtime.state(a, JobState.RUNNING, "2 ranks running")
    queued = submit(s, elastic("queued", 2, min_gpus=None))
    runtime.nodes.add(lost)
    s.tick()
    assert s.store.get_job(queued).state == JobState.SCHEDULED and runtime.resizes == []
    runtime.run(queued, [1.0])
    s.tick()
    [(job_id, grown)] = runtime.resizes
    assert job_id == a and len(grown.assignments) == 4 and nodes_of(grown) == {"node-0", "node-1"}
    record = s.store.get_job(a)
    assert record.reason == "growing back to 4 GPUs at the next step boundary" and record.placement == grown.records()
    assert sorted(holder for holder in s.pool.holders().values()) == [a] * 4, "its whole layout is held at once"
    assert counter(registry, "trainctl_job_resizes_total", a) == 2
    s.tick()
    assert len(runtime.resizes) == 1, "offered once"
    # The supervisor's PLAN event for the new plan is followed as any other (`adopt_plan`).
    rows = [{"rank": x.rank, "node": x.node, "gpu": x.gpu} for x in grown.assignments]
    runtime.logs[a].append(EventKind.STATE, state=JobState.RESTARTING, reason="resized: growing back to 4 GPUs")
    runtime.logs[a].append(EventKind.PLAN, lost_nodes=[], placement=rows, message="growing back to 4 GPUs")
    s.tick()
    assert s.store.get_job(a).placement == grown.records()
    assert counter(registry, "trainctl_job_restarts_total", a) == 1, "the node loss is a restart; the resize is not"


def test_an_elastic_job_stops_at_its_minimum_and_a_job_without_the_option_waits(tmp_path: Path) -> None:
    for min_gpus in (None, 4):
        runtime = ScriptedRuntime(nodes={"node-0", "node-1", "node-2"})
        s = make_scheduler(tmp_path / f"min-{min_gpus}", runtime, nodes=3, gpus=2)  # 6 GPUs
        job = elastic("a", 6, min_gpus=min_gpus)
        job.spec.training.global_batch_size = 12
        a = submit(s, job)
        first = lose_a_node_of(s, runtime, a)
        if min_gpus is None:
            assert runtime.plans == [] and s.store.get_job(a).reason.startswith(f"node(s) {first} lost; waiting for 6 GPUs")
            continue
        [(_, plan)] = runtime.plans
        assert len(plan.assignments) == 4 and first not in nodes_of(plan), "dp 4 splits the batch of 12; dp 5 would not"
        runtime.state(a, JobState.RUNNING)
        second = sorted(nodes_of(plan))[-1]
        runtime.lose_node(a, second)
        s.tick()
        assert len(runtime.plans) == 1, "2 GPUs are left: below elastic.min_gpus 4"
        assert s.store.get_job(a).reason == (
            f"node(s) {second} lost; waiting for 6 GPUs (at least 4: scheduling.elastic.min_gpus) to re-place the job: 2 of 6 free")
