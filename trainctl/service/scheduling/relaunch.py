"""Jobs whose supervisor ended with the Ray cluster it ran on: what a starting service does with them,
and what a stopping service says will happen to its running jobs.

With the embedded Ray (`trainctl serve` without --ray-address) the cluster stops with the service, and
every job's supervisor and ranks with it. The next start on the same data directory finds the store's
active jobs with no supervisor in its new cluster (`RayRuntime.lost_with_cluster`: the run directory
names another Ray session), and `after_cluster_loss` decides for each one:

- a job whose log ended before the cluster went: nothing here; following it records its end (or, for a
  preempted one, queues it again);
- a job being cancelled (CANCELLING in the store or in its log): CANCELLED, not relaunched;
- any other: relaunched in a new generation that resumes from its newest complete checkpoint (a
  command job's program from what it saved in $TRAINCTL_CHECKPOINT_DIR), recorded as a restart whose
  reason says why and from which step.

A relaunch is not the job's fault, so it does not count against ``scheduling.max_restarts``. So that a
service that keeps dying (the embedded ranks run beside it and may exhaust the host's memory) cannot
relaunch a job forever, a job relaunched `RELAUNCHES_WITHOUT_PROGRESS` times in a row without reporting
a new step in between fails instead. The job's event log is the record of its relaunches (their
RESTARTING states, `trainctl.workers.relaunch.is_relaunch`) and of its steps; the decision reads what the
log derives from them (its newest step, its relaunches, and those since that step was first reported),
from the log's snapshot and the events after it, so a restart costs the same for a job of a million steps
as for one of a thousand (bench/scale/job_steps.py).

With an external Ray (--ray-address) supervisors outlive the service and are re-attached; one gone while
its cluster is still the same one (Ray gave up restarting it) fails the job as it always did
(`RayRuntime.poll`). An external cluster that was itself restarted counts as a new cluster: its jobs are
relaunched too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from trainctl.parallelism.checkpoint.layout import latest_checkpoint
from trainctl.parallelism.run_directory import RunDirectory
from trainctl.service.store import JobRecord, JobStore
from trainctl.spec.files import FileRuleError
from trainctl.workers.events import ACTIVE_STATES, EventLog, JobState
from trainctl.workers.relaunch import Relaunch, is_relaunch

log = logging.getLogger(__name__)

RELAUNCHES = "relaunches"
"""The name the job's supervisor tallies its relaunches under in its event log (`LOG_TALLIES` of
trainctl.workers.supervisor, not imported here: it brings Ray), so the log's snapshot answers for them."""
RELAUNCHES_WITHOUT_PROGRESS = 3
"""Relaunches in a row, with no new step reported between them, after which the next one fails the job."""
NAMED_JOBS = 10
"""Most job ids the stop notice names."""


@dataclass(frozen=True)
class Ending:
    """The job ends now, without a relaunch."""

    state: JobState
    reason: str


def after_cluster_loss(record: JobRecord, run: RunDirectory) -> Relaunch | Ending | None:
    """What to do with an active job whose supervisor ended with the Ray cluster it ran on (its event log
    and checkpoints are in `run`): relaunch it, end it, or None when its log ended first (following it
    records that)."""
    try:
        log = EventLog.read(run.events, tallies={RELAUNCHES: is_relaunch})
    except (OSError, ValueError) as exc:  # one job's damaged log must not keep the service from starting
        return Ending(JobState.FAILED, f"its supervisor ended with the Ray cluster it ran on, and its event log cannot be read: {exc}")
    logged = log.status(log.last_seq, 1)
    if logged.state.ends_run:
        return None
    if record.state == JobState.CANCELLING:
        return Ending(JobState.CANCELLED, record.reason)
    if logged.state == JobState.CANCELLING:
        return Ending(JobState.CANCELLED, logged.reason)
    step = log.newest_step
    stalled = log.tally_since_step(RELAUNCHES)  # the latest relaunches, with no new step reported since
    if stalled >= RELAUNCHES_WITHOUT_PROGRESS:
        since = "its first step" if step is None else f"a step after step {step}"
        return Ending(JobState.FAILED, (
            f"the service restarted on a new Ray cluster {stalled + 1} times in a row without the job reporting "
            f"{since} in between; not relaunched again (at most {RELAUNCHES_WITHOUT_PROGRESS} relaunches without progress)"
        ))
    return Relaunch(resume=resume_point(record, run), count=log.tally(RELAUNCHES) + 1)


def resume_point(record: JobRecord, run: RunDirectory) -> str:
    """Where the relaunched (or preempted) job resumes, in words."""
    if record.job.spec.command is not None:
        return "its program resumes from what it saved in $TRAINCTL_CHECKPOINT_DIR"
    try:
        newest = latest_checkpoint(run.checkpoints)
    except FileRuleError:  # a marker the engine will skip as well: it names the checkpoint it resumes from
        return "resuming from its newest complete checkpoint"
    if newest is None:
        return "no complete checkpoint yet: starting again from the beginning"
    return f"resuming from checkpoint step {newest[0]}"


def stop_notice(jobs: Sequence[JobRecord], ray_address: str | None) -> str | None:
    """What happens to `jobs` (the active ones) when the service stops now, or None when there are none.
    `ray_address` None: the service runs an embedded Ray, which stops with it."""
    if not jobs:
        return None
    ids = sorted(job.id for job in jobs)
    named = ", ".join(ids[:NAMED_JOBS]) + (f" and {len(ids) - NAMED_JOBS} more" if len(ids) > NAMED_JOBS else "")
    if ray_address is None:
        return (
            f"stopping with {len(ids)} active job(s) ({named}): they stop with the service's embedded Ray and resume "
            "from their newest complete checkpoint when `trainctl serve` starts again on the same --data-dir"
        )
    return (
        f"stopping with {len(ids)} active job(s) ({named}): they keep running on the Ray cluster at {ray_address} "
        "and are re-attached when `trainctl serve` starts again on the same store"
    )


def log_stop_notice(store: JobStore, ray_address: str | None) -> None:
    """Log `stop_notice` for the store's active jobs; a store that cannot answer is logged, not raised (the
    stop goes on)."""
    try:
        notice = stop_notice(store.list_jobs(states=ACTIVE_STATES), ray_address)
    except Exception as exc:  # the notice must never keep the service from stopping
        log.warning("stopping; the store could not list the active jobs: %s", exc)
        return
    if notice is not None:
        log.warning("%s", notice)
