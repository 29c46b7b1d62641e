"""Re-syncing from the store after a (re)start, a store outage or a new lease: reservations and cursors
rebuilt, supervisors re-attached, jobs whose supervisor ended with the Ray cluster relaunched or ended
(trainctl.service.scheduling.relaunch), jobs whose admission a crash interrupted started; and the jobs a short
lease held back handed to the runtime once it allows."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trainctl.parallelism.run_directory import RunDirectory
from trainctl.planning.pool import PlannedPlacement
from trainctl.service.scheduling.launching import Launcher
from trainctl.service.scheduling.relaunch import Ending, after_cluster_loss
from trainctl.service.scheduling.state import ActiveJob, SchedulerState
from trainctl.service.store import JobRecord
from trainctl.workers.events import ACTIVE_STATES, JobState

log = logging.getLogger(__name__)


@dataclass
class Recovery:
    """Brings the scheduler's state in line with the store (idempotent)."""

    state: SchedulerState
    launcher: Launcher

    def recover(self) -> None:
        """Rebuild reservations and cursors from the store: forget jobs the store does not have active and
        reservations it does not know, re-attach the supervisors of active jobs not followed yet, relaunch
        (or end) those whose supervisor ended with the Ray cluster it ran on, and start those whose
        admission a crash interrupted before their supervisor existed. Jobs already followed keep their
        cursors."""
        state = self.state
        with state.lock:
            running = set(state.runtime.running_jobs())
            stored = state.store.list_jobs(states=ACTIVE_STATES, oldest_first=True)
            active_ids = {record.id for record in stored}
            for job_id in set(state.active) - active_ids:
                del state.active[job_id]
                state.unlaunched.discard(job_id)
            for holder in set(state.pool.holders().values()) - active_ids:
                state.pool.release(holder)
            for record in stored:
                if record.id not in state.active:
                    self._recover_job(record, running)

    def launch_pending(self) -> None:
        """Hand the runtime the jobs a short lease held back, when the lease allows it now."""
        state = self.state
        for job_id in sorted(state.unlaunched):
            if not state.may_launch():
                return
            record = state.store.get_job(job_id)
            state.unlaunched.discard(job_id)
            if not record.terminal:  # started, relaunched or cancelled as a re-sync would
                self._recover_job(record, running=set())

    def _recover_job(self, record: JobRecord, running: set[str]) -> None:
        state = self.state
        placement = PlannedPlacement.from_records(record.placement)
        state.pool.reserve(record.id, placement)
        if record.job.spec.scheduling.elastic is not None:
            state.resolved_job(record.id, record.job)  # what `Replacement.grow_back` looks for a shrunk job in
        cursor = int(record.runtime_cursor or 0)
        state.active[record.id] = ActiveJob(cursor=cursor, stored_cursor=cursor)
        run = RunDirectory.at(record.run_dir)
        state.runtime.attach(record.id, run)
        if record.id in running:
            return
        if record.state == JobState.SCHEDULED and record.preemptions:
            log.info("job %s: admitted again after a preemption, not started yet; starting it", record.id)
            self.launcher.launch(record, placement)  # resumes it (`Launcher.launch`)
        elif not run.events.exists():
            if record.state == JobState.CANCELLING:
                state.finish(state.set_state(record, JobState.CANCELLED, record.reason))
                return
            log.info("job %s: admission was interrupted by a service restart; starting it", record.id)
            self.launcher.launch(record, placement)
        elif state.runtime.lost_with_cluster(record.id):  # else Ray gave up on it: following it fails the job
            if record.state == JobState.PREEMPTED:  # its preemption is complete: nothing of it runs anymore
                state.requeue(record, "its supervisor ended with the Ray cluster it ran on")
                return
            outcome = after_cluster_loss(record, run)
            if isinstance(outcome, Ending):
                state.finish(state.set_state(record, outcome.state, outcome.reason))
            elif outcome is not None:
                log.warning("job %s: relaunching it: %s", record.id, outcome.reason)
                self.launcher.launch(record, placement, outcome)
