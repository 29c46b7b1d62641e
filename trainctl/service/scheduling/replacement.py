"""Re-placement after a node loss: a running job whose supervisor lost a node (its status names the lost
nodes) is placed again on the free GPUs plus its own, off the nodes Ray does not have alive; the new
plan goes to the supervisor and replaces the job's reservation, or the job waits (reason and event say
so) until GPUs free up or a node returns. The supervisor's PLAN event is the truth: following it makes
the reservation and the stored placement match it (`adopt_plan`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trainctl.planning.pool import PlannedPlacement
from trainctl.service import store as st
from trainctl.service.scheduling.state import SchedulerState
from trainctl.service.store import JobRecord
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
        running = [JobState.SCHEDULED, JobState.RUNNING, JobState.RESTARTING]
        if placement is None:
            free = len(state.pool.free_slots(holder=record.id, down=down))
            reason = (
                f"node(s) {', '.join(lost)} lost; waiting for {record.job.spec.resources.gpus} GPUs to re-place "
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
        state.hold(
            record.id, placement, expect=running,
            reason=f"node(s) {', '.join(lost)} lost; re-placed {len(placement.assignments)} ranks on {', '.join(nodes)}",
        )

    def adopt_plan(self, record: JobRecord, plan: PlannedPlacement) -> None:
        """Make the job's reservation and stored placement the plan its supervisor adopted (a PLAN event:
        the supervisor's log is the truth, so a re-placement whose store write never committed, say the
        lease was lost or the service died right after the hand-over, is repaired here); idempotent."""
        if set(PlannedPlacement.from_records(record.placement).assignments) == set(plan.assignments):
            self.state.pool.reserve(record.id, plan)
            return
        log.warning("job %s: its supervisor runs a plan the store did not have; recording it", record.id)
        self.state.hold(record.id, plan)
