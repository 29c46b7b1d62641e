"""Preemption over a scripted runtime: which running jobs a queued job of higher priority stops (the
least lost work, only as many as its placement needs, never a protected one), what each state and
reason says, the requeue once a victim's run ended, and its resume. The same over real Ray, with the
losses checked, is tests/reliability/test_preemption_e2e.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from control_plane_fakes import ScriptedRuntime, eventually, make_scheduler
from prometheus_client import CollectorRegistry
from small_jobs import small_job

from trainctl.service import store as st
from trainctl.service.capacity import preemption
from trainctl.service.metrics import ServiceMetrics
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.scheduling.state import PreemptionPolicy
from trainctl.service.security.tenancy import Quota, tenant_shares
from trainctl.workers.events import EventKind, JobState


def submit(s: Scheduler, name: str, gpus: int, priority: int = 0, **spec: object) -> str:
    scheduling = {"priority": priority, **spec.pop("scheduling", {})}  # type: ignore[dict-item]
    return s.store.create_job(small_job(name, gpus=gpus, scheduling=scheduling, **spec))[0].id


def running(s: Scheduler, runtime: ScriptedRuntime, job_id: str, checkpoint: bool = False) -> None:
    """Admit `job_id`, and play its supervisor up to RUNNING with one step (that saved a checkpoint)."""
    s.tick()
    runtime.state(job_id, JobState.RUNNING, "ranks up")
    runtime.logs[job_id].append(EventKind.STEP, step={"step": 1, "loss": 2.0, "checkpoint_bytes": 10 if checkpoint else None})
    s.tick()
    assert record(s, job_id).state == JobState.RUNNING


def record(s: Scheduler, job_id: str) -> st.JobRecord:
    return s.store.get_job(job_id)


def stopped(runtime: ScriptedRuntime, job_id: str, step: int = 1) -> None:
    """Play the supervisor ending the preempted run with its checkpoint."""
    runtime.state(job_id, JobState.PREEMPTED, f"stopped at step {step} with a checkpoint")


def test_a_higher_priority_job_preempts_requeues_and_the_victim_resumes_after_it(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)  # 8 GPUs
    registry = CollectorRegistry()
    s.state.metrics = ServiceMetrics(registry)
    low = submit(s, "low", 8)
    running(s, runtime, low, checkpoint=True)
    high = submit(s, "high", 4, priority=10)
    s.tick()
    assert registry.get_sample_value("trainctl_scheduling_decisions_total", {"decision": "preempting"}) == 1
    assert registry.get_sample_value("trainctl_job_preemptions_total", {"job_id": low, "tenant": "default"}) == 1
    assert registry.get_sample_value("trainctl_job_state", {"job_id": low, "tenant": "default", "state": "PREEMPTED"}) == 1
    victim = record(s, low)
    assert victim.state == JobState.PREEMPTED
    assert victim.reason == f"preempted by job {high} (priority 10): checkpointing at its next step boundary"
    assert record(s, high).state == JobState.QUEUED
    assert record(s, high).reason == f"waiting for 4 GPUs held by preempted job(s) {low}, which checkpoint and stop"
    s.tick()
    assert [(j, g) for j, _, g in runtime.preempted] == [(low, PreemptionPolicy().grace_seconds)]  # sent once
    assert any(f"preempting job {low}" in e.payload.get("message", "") for e in s.store.events(high))

    runtime.step(low, 2, 1.9)  # the step it stops at is recorded; a late RUNNING does not undo the preemption
    runtime.state(low, JobState.RUNNING, "late")
    s.tick()
    assert record(s, low).state == JobState.PREEMPTED and record(s, low).steps_done == 2
    stopped(runtime, low, step=2)
    s.tick()
    requeued, placed = record(s, low), record(s, high)
    assert requeued.state == JobState.QUEUED and requeued.preemptions == 1 and requeued.preempt_time is not None
    assert requeued.reason == "waiting for 8 GPUs: 4 of 8 free"  # the same tick's admission pass
    assert requeued.placement == [] and placed.state == JobState.SCHEDULED
    assert s.pool.holders() and set(s.pool.holders().values()) == {high}
    changes = [(e.payload["to"], e.payload["reason"]) for e in s.store.events(low) if e.type == st.EVENT_STATE]
    assert [to for to, _ in changes] == [JobState.QUEUED, JobState.SCHEDULED, JobState.RUNNING, JobState.PREEMPTED, JobState.QUEUED]
    assert changes[-1][1] == "queued again after a preemption: stopped at step 2 with a checkpoint"

    runtime.run(high, [1.0])
    s.tick()  # high ends; low takes the GPUs again and resumes, its log followed on from where it was
    assert record(s, high).state == JobState.SUCCEEDED
    assert record(s, low).state == JobState.SCHEDULED
    relaunch = runtime.relaunches[low]
    assert relaunch.after_preemption and relaunch.count == 1
    assert relaunch.reason.startswith("resuming after preemption 1; no complete checkpoint yet")  # none on disk here
    runtime.state(low, JobState.RESTARTING, relaunch.reason)
    runtime.step(low, 3, 1.8)
    s.tick()
    assert [m["step"] for m in s.store.step_metrics(low)] == [1, 2, 3]  # nothing applied twice


def test_the_victims_are_the_least_lost_work_and_only_as_many_as_the_placement_needs(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)  # 2 nodes x 4 GPUs
    old_checkpoint = submit(s, "old-checkpoint", 4)
    running(s, runtime, old_checkpoint)  # no checkpoint since it started
    time.sleep(0.05)
    fresh_checkpoint = submit(s, "fresh-checkpoint", 4)
    running(s, runtime, fresh_checkpoint, checkpoint=True)
    submit(s, "high", 4, priority=1)
    s.tick()
    assert record(s, fresh_checkpoint).state == JobState.PREEMPTED  # it loses the least work
    assert record(s, old_checkpoint).state == JobState.RUNNING  # one victim frees enough


def test_protected_jobs_are_never_chosen_and_the_waiting_reason_says_so(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime, nodes=4, gpus=2)
    same_priority = submit(s, "same", 2, priority=5)
    not_preemptible = submit(s, "pinned", 2, scheduling={"preemptible": False})
    no_resume = submit(s, "no-resume", 2, checkpoint={"resume": False})
    recently = submit(s, "recent", 2)
    for job_id in (same_priority, not_preemptible, no_resume, recently):
        running(s, runtime, job_id)
    s.store.update_status(recently, preemptions=1, preempt_time=time.time() - 60)  # within the cooldown
    high = submit(s, "high", 2, priority=5)
    s.tick()
    assert [record(s, j).state for j in (same_priority, not_preemptible, no_resume, recently)] == [JobState.RUNNING] * 4
    assert record(s, high).reason == "waiting for 2 GPUs: 0 of 8 free"
    s.store.update_status(recently, preempt_time=time.time() - PreemptionPolicy().cooldown_seconds - 1)
    s.tick()  # the cooldown is over
    assert record(s, recently).state == JobState.PREEMPTED


def test_no_preemption_when_it_is_off_or_cannot_make_room(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)
    low = submit(s, "low", 4)
    running(s, runtime, low)
    too_big = submit(s, "too-big", 9, priority=10)  # no victim set makes room for more GPUs than the pool has
    s.tick()
    assert record(s, low).state == JobState.RUNNING
    s.store.update_status(too_big, state=JobState.CANCELLED)
    s.state.preemption = PreemptionPolicy(enabled=False)
    high = submit(s, "high", 8, priority=10)
    s.tick()
    assert record(s, low).state == JobState.RUNNING
    assert record(s, high).reason == "waiting for 8 GPUs: 4 of 8 free"


@pytest.mark.parametrize("when", ["stopping", "queued again"])
def test_a_preempted_job_can_be_cancelled(tmp_path: Path, when: str) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)
    low = submit(s, "low", 8)
    running(s, runtime, low)
    submit(s, "high", 8, priority=10)
    s.tick()
    if when == "queued again":
        stopped(runtime, low)
        s.tick()
        assert record(s, low).state == JobState.QUEUED
    s.request_cancel(low, "not needed")
    eventually(lambda: s.tick() or record(s, low).state == JobState.CANCELLED, "the cancel")  # sent on a thread
    assert low in runtime.cancelled or when == "queued again"
    assert low not in s.state.active and low not in s.state.preempting


def shares(s: Scheduler, **guaranteed: int) -> None:
    """Give each tenant its guaranteed GPUs (no other limit)."""
    s.state.quota_of = lambda tenant: Quota(guaranteed_gpus=guaranteed.get(tenant))


def submit_as(s: Scheduler, tenant: str, name: str, gpus: int, priority: int = 0) -> str:
    return s.store.create_job(small_job(name, gpus=gpus, scheduling={"priority": priority}), tenant=tenant)[0].id


def test_a_tenant_within_its_guarantee_reclaims_gpus_another_borrowed_whatever_the_priorities(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)  # 8 GPUs, 4 guaranteed to each tenant
    shares(s, a=4, b=4)
    borrower = submit_as(s, "a", "borrower", 8, priority=5)  # a borrows b's idle 4
    running(s, runtime, borrower)
    reclaimer = submit_as(s, "b", "reclaimer", 4, priority=0)
    s.tick()
    victim = record(s, borrower)
    assert victim.state == JobState.PREEMPTED
    assert victim.reason == (f"preempted by job {reclaimer}, whose tenant 'b' reclaims GPUs within its guaranteed "
                             "share: checkpointing at its next step boundary")
    assert any("borrowed beyond tenant 'a''s guarantee" in e.payload.get("message", "") for e in s.store.events(reclaimer))
    stopped(runtime, borrower)
    s.tick()
    assert record(s, reclaimer).state == JobState.SCHEDULED
    assert record(s, borrower).state == JobState.QUEUED  # 4 GPUs free, it needs 8: it waits, its work kept
    runtime.state(reclaimer, JobState.RUNNING, "ranks up")
    s.tick()  # the borrower, first in the queue with its higher priority, does not take b's guarantee back
    assert record(s, reclaimer).state == JobState.RUNNING
    assert record(s, borrower).reason == "waiting for 8 GPUs: 4 of 8 free"


def test_no_reclaim_beyond_the_guarantee_nor_from_a_tenant_within_its_own(tmp_path: Path) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)
    shares(s, a=4, b=4)
    within_a = submit_as(s, "a", "within-a", 4)
    running(s, runtime, within_a)
    within_b = submit_as(s, "b", "within-b", 4)
    running(s, runtime, within_b)
    over = submit_as(s, "b", "over", 4)  # b would hold 8, over its guarantee: nothing to reclaim for it
    s.tick()
    assert record(s, within_a).state == JobState.RUNNING and record(s, over).reason == "waiting for 4 GPUs: 0 of 8 free"
    s.store.update_status(over, state=JobState.CANCELLED)
    unguaranteed = submit_as(s, "c", "c", 4)  # c has no guarantee: it only borrows
    s.tick()
    assert [record(s, j).state for j in (within_a, within_b)] == [JobState.RUNNING] * 2
    assert record(s, unguaranteed).state == JobState.QUEUED


def test_a_guarantee_above_the_cap_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"guaranteed_gpus \(8\) is more than running_gpus \(4\)"):
        Quota(guaranteed_gpus=8, running_gpus=4)


def test_a_decision_tries_a_bounded_number_of_placements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = ScriptedRuntime()
    s = make_scheduler(tmp_path, runtime)
    lows = [submit(s, f"low-{i}", 2) for i in range(4)]
    for job_id in lows:
        running(s, runtime, job_id)
    tries: list[int] = []
    place = s.pool.place
    monkeypatch.setattr(s.pool, "place", lambda *a, **k: tries.append(1) or place(*a, **k))
    monkeypatch.setattr(preemption, "PLACEMENT_TRIALS", 0)
    high = submit(s, "high", 8, priority=1)
    s.tick()
    assert [record(s, j).state for j in lows] == [JobState.RUNNING] * 4 and record(s, high).state == JobState.QUEUED
    monkeypatch.setattr(preemption, "PLACEMENT_TRIALS", 8)
    before = len(tries)
    s.state.wake()
    s.tick()
    assert [record(s, j).state for j in lows] == [JobState.PREEMPTED] * 4
    assert len(tries) - before == 2  # the head's own placement, then one with all four victims (none to put back)


def test_tenant_shares_count_what_each_tenant_holds_against_its_guarantee() -> None:
    quotas = {"a": Quota(guaranteed_gpus=4), "b": Quota(guaranteed_gpus=8)}
    shares = tenant_shares([("b", 2), ("a", 4), ("a", 2), ("c", 1)], lambda tenant: quotas.get(tenant, Quota()))
    assert [(s.tenant, s.used_gpus, s.guaranteed_gpus, s.borrowed_gpus) for s in shares] == [
        ("a", 6, 4, 2), ("b", 2, 8, 0), ("c", 1, None, 1),
    ]
