"""`JobPlan` without Ray: the layout a plan's size names, a resize taken once and only between replans, the
PLAN event and the layout line each change of plan records, and the refusals that name what is wrong."""

from __future__ import annotations

import threading

import pytest
from small_jobs import restartable_job

from trainctl.spec.job import ElasticSpec, TrainingJob
from trainctl.workers.events import EventKind, EventLog
from trainctl.workers.job_plan import JobPlan
from trainctl.workers.placement.plan import RankAssignment


def elastic() -> TrainingJob:
    job = restartable_job("plan", steps=4)
    job.spec.scheduling.elastic = ElasticSpec(min_gpus=1)
    return job


def slots(*where: tuple[str, int]) -> list[RankAssignment]:
    return [RankAssignment(rank=rank, node=node, gpu=gpu) for rank, (node, gpu) in enumerate(where)]


def test_a_resize_is_taken_once_recorded_as_a_plan_and_changes_the_layout() -> None:
    log = EventLog()
    plan = JobPlan(elastic(), slots(("a", 0)), log, use_gpu=False, topology=None)
    assert plan.body.parallelism.dp_replicate == 1 and plan.shrunk, "a plan of 1 GPU runs the elastic layout of 1"
    assert plan.ask_resize(slots(("a", 0), ("b", 0)), generation=2)
    assert not plan.ask_resize(slots(("a", 0), ("c", 0)), generation=2), "one resize at a time"
    assert not plan.shrunk
    assert plan.take_resize(generation=3) and not plan.take_resize(generation=3)
    assert plan.body.parallelism.dp_replicate == 2 and [s.node for s in plan.slots] == ["a", "b"]
    kinds = [(e.kind, e.message) for e in log.all()]
    assert kinds == [
        (EventKind.LOG, "growing back to 2 GPUs: stopping at the next step boundary with a checkpoint"),
        (EventKind.PLAN, "growing back to 2 GPUs: new plan rank 0 -> a GPU 0, rank 1 -> b GPU 0"),
        (EventKind.LOG, "layout 1 -> 2 GPUs (dp_replicate 1 -> 2): each replica accumulates 1 micro-batch instead of "
                        "2 micro-batches, the global batch of 4 unchanged; 2 of the job's 2 GPUs"),
    ]


def test_plans_of_a_size_with_no_layout_or_of_the_same_size_are_refused_naming_why() -> None:
    plan = JobPlan(elastic(), slots(("a", 0), ("a", 1)), EventLog(), use_gpu=False, topology=None)
    with pytest.raises(ValueError, match="runs on 2 GPUs already"):
        plan.ask_resize(slots(("b", 0), ("b", 1)), generation=1)
    with pytest.raises(ValueError, match=r"no layout on 3 GPUs \(resources.gpus 2, or an elastic layout of that size\)"):
        plan.ask_resize(slots(("b", 0), ("b", 1), ("b", 2)), generation=1)
    with pytest.raises(ValueError, match=r"no layout on 1 GPUs \(resources.gpus 2\)"):
        JobPlan(restartable_job("fixed", steps=4), slots(("a", 0)), EventLog(), use_gpu=False, topology=None)


def test_a_replan_takes_a_shrunk_plan_and_no_resize_meanwhile() -> None:
    log = EventLog()
    plan = JobPlan(elastic(), slots(("a", 0), ("b", 0)), log, use_gpu=False, topology=None)
    waiting = threading.Thread(target=plan.await_plan, args=(["b"], 1, None, lambda: None))
    waiting.start()
    while plan.awaiting is None:
        threading.Event().wait(0.01)
    assert not plan.ask_resize(slots(("a", 0)), generation=1), "a plan is awaited: no resize"
    with pytest.raises(ValueError, match="uses lost node"):
        plan.adopt(slots(("b", 0)), generation=1)
    assert plan.adopt(slots(("a", 0)), generation=1)
    waiting.join(5)
    assert not waiting.is_alive() and plan.body.parallelism.dp_replicate == 1
    assert [e.kind for e in log.all()] == [EventKind.REPLAN, EventKind.PLAN, EventKind.LOG]
    assert log.all()[1].message == "node b lost; shrunk to 1 rank (new plan: rank 0 -> a GPU 0)"
