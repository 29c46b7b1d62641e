"""Scheduler unit tests over a scripted runtime: priority then age, gang admission, reasons, cancel,
release, recovery. The same behaviour over real Ray is in test_e2e.py."""

from __future__ import annotations

from pathlib import Path

from control_plane_fakes import ScriptedRuntime, make_scheduler

from trainctl.service import store as st
from trainctl.service.scheduler import Scheduler
from trainctl.spec.job import TrainingJob
from trainctl.workers.events import JobPhase


def job(name: str, gpus: int, priority: int = 0) -> TrainingJob:
    return TrainingJob.model_validate({
        "metadata": {"name": name},
        "spec": {
            "parallelism": {"dp_shard": gpus},
            "training": {"global_batch_size": gpus, "steps": 3},
            "resources": {"gpus": gpus, "device": "cpu"},
            "scheduling": {"priority": priority},
        },
    })


def submit(scheduler: Scheduler, name: str, gpus: int, priority: int = 0) -> str:
    return scheduler.store.create_job(job(name, gpus, priority))[0].id


def state(scheduler: Scheduler, job_id: str) -> st.JobRecord:
    return scheduler.store.get_job(job_id)


def test_priority_then_age_and_strict_gang_admission(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)  # 8 GPUs
    a = submit(s, "a", 8)
    s.tick()
    assert state(s, a).state == st.SCHEDULED and s.pool.free_count == 0
    b = submit(s, "b", 4, priority=0)
    c = submit(s, "c", 4, priority=5)
    d = submit(s, "d", 4, priority=5)
    small = submit(s, "small", 1, priority=-1)
    s.tick()
    assert [state(s, j).state for j in (b, c, d, small)] == [st.QUEUED] * 4
    assert state(s, c).reason == "waiting for 4 GPUs: 0 of 8 free"
    assert state(s, d).reason.startswith(f"waiting behind {c}")
    assert state(s, b).reason.startswith(f"waiting behind {c}")

    runtime.run(a, [3.0, 2.0, 1.0])
    s.tick()  # a ends and frees 8 GPUs; c then d (priority 5, in submission order) take them all
    assert state(s, a).state == st.SUCCEEDED
    assert [state(s, j).state for j in (c, d)] == [st.SCHEDULED, st.SCHEDULED]
    assert [j for j, _ in runtime.started] == [a, c, d]
    assert state(s, b).state == st.QUEUED and state(s, b).reason == "waiting for 4 GPUs: 0 of 8 free"
    runtime.run(c, [1.0])
    s.tick()  # c's 4 GPUs go to b (priority 0) before small (priority -1)
    assert state(s, b).state == st.SCHEDULED
    assert state(s, small).state == st.QUEUED and state(s, small).reason == "waiting for 1 GPUs: 0 of 8 free"
    runtime.run(d, [1.0])
    s.tick()
    assert state(s, small).state == st.SCHEDULED and s.pool.free_count == 3


def test_gang_scheduling_never_starts_part_of_a_job(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime, nodes=2, gpus=2)  # 4 GPUs
    first = submit(s, "first", 2)
    big = submit(s, "big", 4)
    small = submit(s, "small", 1)
    s.tick()
    assert state(s, first).state == st.SCHEDULED
    assert state(s, big).state == st.QUEUED and state(s, big).reason == "waiting for 4 GPUs: 2 of 4 free"
    # strict queue: the 1-GPU job would fit, but does not overtake the job at the head
    assert state(s, small).state == st.QUEUED and state(s, small).reason.startswith(f"waiting behind {big}")
    assert [j for j, _ in runtime.started] == [first]
    runtime.run(first, [1.0])
    s.tick()
    assert state(s, big).state == st.SCHEDULED and state(s, small).state == st.QUEUED
    placement = dict(runtime.started)[big]
    assert sorted((a.node, a.gpu) for a in placement.assignments) == [
        ("node-0", 0), ("node-0", 1), ("node-1", 0), ("node-1", 1),
    ]
    assert [a.rank for a in placement.assignments] == [0, 1, 2, 3]


def test_follows_events_into_the_store(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)
    j = submit(s, "j", 2)
    s.tick()
    runtime.state(j, JobPhase.RUNNING, "ranks up")
    runtime.step(j, 1, 5.0)
    s.tick()
    record = state(s, j)
    assert (record.state, record.steps_done, record.last_loss) == (st.RUNNING, 1, 5.0)
    assert record.start_time is not None and record.placement and record.run_dir
    runtime.step(j, 2, 4.0)
    runtime.state(j, JobPhase.SUCCEEDED, "all ranks finished")
    s.tick()
    record = state(s, j)
    assert (record.state, record.reason, record.steps_done, record.first_loss, record.last_loss) == (
        st.SUCCEEDED, "all ranks finished", 2, 5.0, 4.0,
    )
    types = [(e.type, e.payload.get("to") or e.payload.get("step")) for e in s.store.events(j)]
    assert types == [
        ("state", st.QUEUED), ("state", st.SCHEDULED), ("state", st.RUNNING), ("step", 1), ("step", 2),
        ("state", st.SUCCEEDED),
    ]
    assert s.pool.free_count == 8


def test_cancel_queued_and_running(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)
    running = submit(s, "running", 8)
    queued = submit(s, "queued", 8)
    s.tick()
    runtime.state(running, JobPhase.RUNNING)
    s.tick()
    assert s.request_cancel(queued, "by test").state == st.CANCELLED
    assert s.request_cancel(running, "by test").state == st.CANCELLING
    for _ in range(50):
        s.tick()
        if state(s, running).terminal:
            break
        s._wake.wait(0.05)
    assert runtime.cancelled == [running]
    assert state(s, running).state == st.CANCELLED
    assert [j for j, _ in runtime.started] == [running]
    assert s.pool.free_count == 8


def test_a_start_failure_fails_the_job_and_frees_its_gpus(tmp_path: Path) -> None:
    runtime = ScriptedRuntime(fail_start=True)
    s = make_scheduler(tmp_path, runtime)
    j = submit(s, "j", 4)
    s.tick()
    record = state(s, j)
    assert record.state == st.FAILED and "no Ray today" in record.reason
    assert s.pool.free_count == 8


def test_restart_reattaches_without_duplicates(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)
    j = submit(s, "j", 4)
    queued = submit(s, "q", 8)
    s.tick()
    runtime.state(j, JobPhase.RUNNING)
    runtime.step(j, 1, 2.0)
    s.tick()
    s.store.close()

    again = make_scheduler(tmp_path, runtime)
    again.recover()
    assert runtime.attached == [j]
    assert [x for x, _ in runtime.started] == [j]  # its supervisor is alive: not started twice
    assert again.pool.free_count == 4
    runtime.step(j, 2, 1.5)
    runtime.state(j, JobPhase.SUCCEEDED)
    again.tick()
    assert state(again, j).state == st.SUCCEEDED and state(again, j).steps_done == 2
    assert [e.payload["step"] for e in again.store.events(j) if e.type == "step"] == [1, 2]  # no replay
    assert state(again, queued).state == st.SCHEDULED
    assert len(again.store.list_jobs()) == 2
