"""Re-placement after a node loss: a running job whose supervisor lost a node (its status names the lost
nodes) is placed again on the free GPUs plus its own, off the nodes Ray does not have alive; the new
plan goes to the supervisor and replaces the job's reservation, or the job waits (reason and event say
so) until GPUs free up or a node returns. An elastic job (`spec.scheduling.elastic`) that does not fit whole
takes its largest smaller layout that fits instead, and grows back (`grow_back`) once its whole layout does.
The supervisor's PLAN event is the truth: following it makes the reservation and the stored placement match
it (`adopt_plan`)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from trainctl.planning.fit import fit_violations
from trainctl.planning.pool import PlannedPlacement
from trainctl.service import store as st
from trainctl.service.scheduling.state import SchedulerState
from trainctl.service.store import JobRecord
from trainctl.spec.validate import elastic_layouts
from trainctl.workers.events import JobState

log = logging.getLogger(__name__)


@dataclass
class Replacement:
    """Re-places jobs that lost nodes, and holds the plan each supervisor adopted."""

    state: SchedulerState

    def replace(self, record: JobRecord, lost: tuple[str, ...]) -> None:
        """Re-place a job whose supervisor lost `lost`: a plan on the free GPUs plus the job's own, off
        every node that is not alive, handed to the supervisor; or a reason saying what it waits for."""
        state = self.state
        active = state.active[record.id]
        down = set(lost) | state.down_nodes()
        placement = state.pool.place(state.resolved_job(record.id, record.job), holder=record.id, down=down)
        placement = placement or self._shrunk(record, down)
        running = [JobState.SCHEDULED, JobState.RUNNING, JobState.RESTARTING]
        if placement is None:
            free = len(state.pool.free_slots(holder=record.id, down=down))
            elastic = record.job.spec.scheduling.elastic
            at_least = "" if elastic is None else f" (at least {elastic.min_gpus}: scheduling.elastic.min_gpus)"
            reason = (
                f"node(s) {', '.join(lost)} lost; waiting for {record.job.spec.resources.gpus} GPUs{at_least} to re-place "
                f"the job: {free} of {state.pool.total} free"
            )
            if active.replan_waiting != lost:
                active.replan_waiting = lost
                state.store.append_event(record.id, st.EVENT_LOG, {"level": "WARNING", "message": reason})
            if record.reason != reason:
                state.store.update_status(record.id, expect=running, reason=reason)
            return
        if not state.may_launch():
            return  # too little lease left to hand a plan over: the next tick, or the next leader
        try:
            adopted = state.runtime.replace_plan(record.id, record.job, placement)
        except Exception:
            log.exception("job %s: handing over the new plan failed; retrying", record.id)
            return
        active.replan_waiting = ()
        if not adopted:  # the supervisor no longer waits (cancelled, failed or restarted meanwhile)
            return
        nodes = sorted({a.node for a in placement.assignments})
        gpus = len(placement.assignments)
        shrunk = f" (shrunk: {gpus} of its {record.job.spec.resources.gpus} GPUs)" if gpus != len(record.placement) else ""
        state.hold(
            record.id, placement, expect=running,
            reason=f"node(s) {', '.join(lost)} lost; re-placed {gpus} ranks on {', '.join(nodes)}{shrunk}",
        )
        if shrunk and state.metrics is not None:
            state.metrics.record_resize(record.id, record.tenant)

    def _shrunk(self, record: JobRecord, down: set[str]) -> PlannedPlacement | None:
        """For an elastic job, a plan of its largest smaller layout that fits the pool's GPUs (`fit_violations`) and
        its free ones off the `down` nodes; None for another job, or when none fits now."""
        state = self.state
        free = len(state.pool.free_slots(holder=record.id, down=down))
        resolved = state.resolved_job(record.id, record.job)
        for body in elastic_layouts(record.job.spec, free):
            smaller = resolved.with_spec(body)
            if fit_violations(smaller, state.pool):
                continue
            placement = state.pool.place(smaller, holder=record.id, down=down)
            if placement is not None:
                return placement
        return None

    def grow_back(self) -> None:
        """Offer each running elastic job that runs shrunk its whole layout once it fits the free GPUs and its own
        (after the admission pass: queued jobs get free GPUs first); the plan is held at once, and the job's
        ranks stop at their next step boundary with a checkpoint to resume on it."""
        state = self.state
        held = Counter(state.pool.holders().values())
        shrunk = [
            job_id for job_id, active in state.active.items()
            if (resolved := state.resolved.get(job_id)) is not None and resolved.spec.scheduling.elastic is not None
            and 0 < held[job_id] < resolved.spec.resources.gpus and not active.replan_waiting and job_id not in state.preempting
        ]
        down = state.down_nodes() if shrunk else set()
        for job_id in shrunk:
            record = state.store.get_job(job_id)
            if record.state != JobState.RUNNING:
                continue
            placement = state.pool.place(state.resolved_job(job_id, record.job), holder=job_id, down=down)
            if placement is None or not state.may_launch():
                continue
            try:
                taken = state.runtime.resize(job_id, record.job, placement)
            except Exception:
                log.exception("job %s: handing over the grown plan failed; retrying", job_id)
                continue
            if taken:
                gpus = len(placement.assignments)
                state.hold(job_id, placement, expect=[JobState.RUNNING], reason=f"growing back to {gpus} GPUs at the next step boundary")
                if state.metrics is not None:
                    state.metrics.record_resize(job_id, record.tenant)

    def adopt_plan(self, record: JobRecord, plan: PlannedPlacement) -> None:
        """Make the job's reservation and stored placement the plan its supervisor adopted (a PLAN event:
        the supervisor's log is the truth, so a re-placement whose store write never committed, say the
        lease was lost or the service died right after the hand-over, is repaired here); idempotent."""
        if set(PlannedPlacement.from_records(record.placement).assignments) == set(plan.assignments):
            self.state.pool.reserve(record.id, plan)
            return
        log.warning("job %s: its supervisor runs a plan the store did not have; recording it", record.id)
        self.state.hold(record.id, plan)
