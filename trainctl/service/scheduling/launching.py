"""Handing an admitted (or recovered) job to the runtime, with the file rule its ranks open files under."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from trainctl.parallelism.run_directory import RunDirectory
from trainctl.planning.pool import PlannedPlacement
from trainctl.service import store as st
from trainctl.service.scheduling.relaunch import resume_point
from trainctl.service.scheduling.state import SchedulerState
from trainctl.service.store import JobRecord
from trainctl.spec.files import FileRule
from trainctl.workers.events import JobState
from trainctl.workers.relaunch import Relaunch

log = logging.getLogger(__name__)


@dataclass
class Launcher:
    """Starts jobs on the runtime; a job it may not start yet (too little lease) waits in `unlaunched`."""

    state: SchedulerState

    def launch(self, record: JobRecord, placement: PlannedPlacement, relaunch: Relaunch | None = None) -> None:
        """Start the job's supervisor on `placement` (a failed start fails the job); a preempted job's
        resumes it (`Relaunch.after_preemption`)."""
        state = self.state
        if not state.may_launch():
            state.unlaunched.add(record.id)  # too little lease left: the next tick, or the next leader
            return
        run = RunDirectory.at(record.run_dir)
        if relaunch is None and record.preemptions:  # it ran before: its log and checkpoints are in `run`
            relaunch = Relaunch(resume=resume_point(record, run), count=record.preemptions, after_preemption=True)
        try:
            state.runtime.start_job(
                record.id, record.job, placement, run, node_env=state.node_env(),
                file_rule=self.file_rule(record), relaunch=relaunch,
            )
        except Exception as exc:
            log.exception("job %s: start failed", record.id)
            state.finish(state.set_state(record, JobState.FAILED, f"could not start the job: {exc}"))

    def file_rule(self, record: JobRecord) -> FileRule:
        """The rule `record`'s ranks open its files under: the run directories it may read besides its
        own are those of its tenant's jobs that its spec names, and, in turn, those theirs name (a LoRA
        run's checkpoint loads its own `init_from` as its base, `checkpoint.pretrained.load_weights`)."""
        paths, store = self.state.paths, self.state.store
        if paths is None:
            return FileRule()

        def same_tenant(job_id: str) -> bool:
            try:
                return store.get_job(job_id).tenant == record.tenant
            except st.JobNotFound:
                return False

        rule = paths.file_rule(record.job.spec, record.id, same_tenant)
        readable, named = set(rule.readable_runs), set(rule.readable_runs) - {record.id}
        while named:
            earlier = store.get_job(named.pop())
            more = paths.file_rule(earlier.job.spec, earlier.id, same_tenant).readable_runs - readable
            readable |= more
            named |= more
        return replace(rule, readable_runs=frozenset(readable))
