"""A supervisor the service relaunched after its Ray cluster ended (`SupervisorConfig.relaunch`): the
service's relaunches (and an elastic job's changes of size) are in the job's restart count but not in its `scheduling.max_restarts` budget.
The driver loop runs here without Ray, its generations scripted."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from small_jobs import restartable_job

from trainctl.workers.events import EventKind, EventLog, JobState
from trainctl.workers.group_keeper import GroupKeeper
from trainctl.workers.job_plan import JobPlan
from trainctl.workers.outcomes import Outcome
from trainctl.workers.placement.plan import RankAssignment
from trainctl.workers.relaunch import Relaunch
from trainctl.workers.supervisor import LOG_TALLIES, JobSupervisor, SupervisorConfig
from trainctl.workers.watchdog import Watchdog


def relaunched_supervisor(
    relaunches: int, max_restarts: int, outcomes: Iterator[tuple[Outcome, str]], after_preemption: bool = False,
) -> JobSupervisor:
    """A supervisor whose log holds `relaunches` service relaunches (after a cluster loss, or resumes after
    a preemption), its generations ending as `outcomes` say."""
    job = restartable_job("relaunched", steps=10, max_restarts=max_restarts)
    log = EventLog(tallies=LOG_TALLIES)
    log.append(EventKind.STATE, state=JobState.RUNNING, reason="ranks up")
    relaunch = None
    for count in range(1, relaunches + 1):
        relaunch = Relaunch(resume="resuming from checkpoint step 4", count=count, after_preemption=after_preemption)
        log.append(EventKind.STATE, state=JobState.RESTARTING, reason=relaunch.reason, generation=count)
    supervisor = JobSupervisor.__new__(JobSupervisor)  # the driver loop alone: no actor, no rank group
    supervisor._cfg = SupervisorConfig(
        job_id="relaunched", job_json=job.model_dump_json(), slots=[], run_dir="unused", use_gpu=False, relaunch=relaunch,
    )
    supervisor._job = job
    supervisor._log = log
    supervisor._cancel = threading.Event()
    supervisor._lock = threading.Lock()
    supervisor._groups = GroupKeeper("relaunched", False, programs=False, placement_timeout=1.0, call_timeout=1.0)
    supervisor._watchdog = Watchdog(job, startup_grace=300.0)
    supervisor._plan = JobPlan(job, [RankAssignment(rank=r, node="node-0", gpu=r) for r in range(2)], log, use_gpu=False,
                               topology=None)
    supervisor._generation = relaunches
    supervisor._run_generation = lambda: next(outcomes)  # type: ignore[method-assign]
    return supervisor


@pytest.mark.parametrize("after_preemption", [False, True], ids=["cluster-loss", "preemption"])
def test_relaunches_do_not_spend_the_jobs_restarts(after_preemption: bool) -> None:
    died = (Outcome.FAILED, "rank 1 died")
    supervisor = relaunched_supervisor(
        2, max_restarts=1, outcomes=iter([died, (Outcome.SUCCEEDED, "all 2 ranks finished")]), after_preemption=after_preemption,
    )
    supervisor._supervise()
    status = supervisor._log.status(0, 1)
    assert status.state is JobState.SUCCEEDED and status.restarts == 3, status
    [own] = [e.reason for e in supervisor._log.all() if e.state is JobState.RESTARTING and "died" in e.reason]
    assert own == "rank 1 died; restart 1 of 1 from the last complete checkpoint"


def test_the_jobs_own_restarts_are_still_limited_after_relaunches() -> None:
    died = (Outcome.FAILED, "rank 1 died")
    supervisor = relaunched_supervisor(2, max_restarts=1, outcomes=iter([died, died]))
    supervisor._supervise()
    status = supervisor._log.status(0, 1)
    assert status.state is JobState.FAILED and status.restarts == 3, status
    assert status.reason == "rank 1 died; giving up after 1 restart(s) (scheduling.max_restarts=1)"



def test_an_elastic_jobs_resizes_do_not_spend_its_restarts_either() -> None:
    """A generation that stopped for a change of size (`Outcome.RESIZED`) starts the next one without spending the
    budget, and a supervisor restarted later does not count it against the budget (`LOG_TALLIES`)."""
    resized = (Outcome.RESIZED, "growing back to 2 GPUs")
    supervisor = relaunched_supervisor(0, max_restarts=0, outcomes=iter([resized, resized, (Outcome.SUCCEEDED, "done")]))
    supervisor._supervise()
    status = supervisor._log.status(0, 1)
    assert status.state is JobState.SUCCEEDED and status.restarts == 2, status
    reasons = [e.reason for e in supervisor._log.all() if e.state is JobState.RESTARTING]
    assert reasons == ["resized: growing back to 2 GPUs; resuming from the checkpoint it saved"] * 2
    assert sum(supervisor._log.tally(name) for name in LOG_TALLIES) == 2
