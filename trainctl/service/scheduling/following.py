"""Following running jobs: poll each job's supervisor from its cursor, append what happened to the store
(state changes, step metrics, log lines), record its end once its log is drained, send the cancels the
API asked for and the preemptions admission decided (queueing a preempted job again once its run has
ended), and hand a job whose supervisor lost a node to re-placement.

Each job is followed on its own: an unexpected error is logged and retried next tick without stopping
the others; one that lasts FOLLOW_GRACE_SECONDS stops the job and fails it. A supervisor unreachable for
POLL_GRACE_SECONDS fails its job. A cancel runs on a thread of its own (it waits until the job's actors
and placement group are gone, and must not stall the loop), and so does the call that sends a preemption.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainctl.planning.pool import PlannedPlacement
from trainctl.service import store as st
from trainctl.service.scheduling.replacement import Replacement
from trainctl.service.scheduling.state import ActiveJob, SchedulerState
from trainctl.service.store import JobRecord, LeaseLost, StoreUnavailable
from trainctl.workers.events import Event as RuntimeEvent
from trainctl.workers.events import EventKind, JobState
from trainctl.workers.relaunch import is_resize

log = logging.getLogger(__name__)

POLL_GRACE_SECONDS = 30.0
"""How long a job's supervisor may be unreachable (just created, or busy) before the job fails."""
FOLLOW_GRACE_SECONDS = 30.0
"""How long following a job may keep failing with an unexpected error (typically a poison event: the
store refuses the same event on every tick) before the job is stopped and fails."""


@dataclass
class Following:
    """Follows the jobs in `state.active`, one `follow(job_id)` per job and tick."""

    state: SchedulerState
    replacement: Replacement
    _sends: set[threading.Thread] = field(default_factory=set)
    """Threads sending a cancel or a preemption to the runtime (`_send`), until each ends; `join_sends`
    waits for them."""
    _sends_lock: threading.Lock = field(default_factory=threading.Lock)

    def follow(self, job_id: str) -> None:
        """Follow one job; an unexpected error is that job's alone (`_follow_failed`), so the other jobs
        and the admission pass go on. The store being away or the lease lost still ends the tick."""
        try:
            self._follow(job_id)
        except (StoreUnavailable, LeaseLost):
            raise
        except Exception as exc:
            self._follow_failed(job_id, exc)
            return
        if job_id in self.state.active:
            self.state.active[job_id].follow_failing_since = None

    def join_sends(self, deadline: float) -> None:
        """Wait until `deadline` (monotonic) for the cancels and preemptions in flight."""
        with self._sends_lock:
            sending = list(self._sends)
        for thread in sending:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _follow_failed(self, job_id: str, exc: Exception) -> None:
        """Log a job's failed follow (the next tick retries from the last event applied); one failing for
        FOLLOW_GRACE_SECONDS marks the job to be stopped and failed with a reason naming the error."""
        active = self.state.active.get(job_id)
        if active is None or active.failure is not None:
            log.debug("job %s: failing it failed (%r); retrying", job_id, exc)
            return
        now = time.monotonic()
        if active.follow_failing_since is None:
            active.follow_failing_since = now
            log.exception("job %s: following it failed after event %d; retrying", job_id, active.cursor)
        elif now - active.follow_failing_since >= FOLLOW_GRACE_SECONDS:
            active.failure = (
                f"the service could not follow the job for {FOLLOW_GRACE_SECONDS:.0f} s "
                f"(after event {active.cursor}): {type(exc).__name__}: {exc}"
            )
            log.error("job %s: %s; stopping it", job_id, active.failure)
        else:
            log.debug("job %s: following it failed again (%r); retrying", job_id, exc)

    def _fail_unfollowed(self, job_id: str, active: ActiveJob, failure: str) -> None:
        """Stop a job that could not be followed; once the runtime's cancel is done, record it FAILED
        with `failure` and free its GPUs."""
        if active.cancel is None:
            active.cancel = self._send_cancel(job_id)
        if not active.cancel.is_alive():
            state = self.state
            state.finish(state.set_state(state.store.get_job(job_id), JobState.FAILED, failure))

    def _send_cancel(self, job_id: str) -> threading.Thread:
        """Start the thread that stops the job's supervisor and ranks (`Runtime.cancel`: it blocks until
        none is left); the loop records the end."""
        return self._send(job_id, "cancel", lambda: self.state.runtime.cancel(job_id))

    def _send_preemption(self, job_id: str, reason: str) -> threading.Thread:
        """Start the thread that asks the job's supervisor to checkpoint and stop (`Runtime.preempt`); the
        loop queues the job again once its run has ended."""
        grace = self.state.preemption.grace_seconds
        return self._send(job_id, "preemption", lambda: self.state.runtime.preempt(job_id, reason, grace))

    def _send(self, job_id: str, what: str, call: Callable[[], Any]) -> threading.Thread:
        """Run `call` against the runtime on a thread of its own (`join_sends` waits for it)."""
        thread = threading.Thread(target=self._call, args=(job_id, what, call), name=f"{what}-{job_id}", daemon=True)
        with self._sends_lock:
            self._sends.add(thread)
        thread.start()
        return thread

    def _call(self, job_id: str, what: str, call: Callable[[], Any]) -> None:
        """`call()`; a failure is logged and recorded as one of the job's events; then the next tick runs."""
        try:
            call()
        except Exception as exc:
            log.exception("job %s: %s failed", job_id, what)
            self.state.store.append_event(job_id, st.EVENT_LOG, {"level": "ERROR", "message": f"{what} failed: {exc}"})
        finally:
            with self._sends_lock:
                self._sends.discard(threading.current_thread())
            self.state.wake()

    def _preempted(self, record: JobRecord, why: str) -> None:
        """The job's supervisor ended PREEMPTED: queue the job again once its supervisor is gone (so that
        its next start can create one), or end it CANCELLED when a cancel came meanwhile."""
        state = self.state
        if record.state == JobState.CANCELLING:
            state.finish(state.set_state(record, JobState.CANCELLED, record.reason))
        elif record.id not in state.runtime.running_jobs():  # else `poll` is releasing it: the next tick
            state.requeue(record, why)

    def _follow(self, job_id: str) -> None:
        state = self.state
        active = state.active[job_id]
        if active.failure is not None:
            self._fail_unfollowed(job_id, active, active.failure)
            return
        record = state.store.get_job(job_id)
        if record.state == JobState.CANCELLING and active.cancel is None:
            active.cancel = self._send_cancel(job_id)
        elif record.state == JobState.PREEMPTED and active.preempt is None:
            active.preempt = self._send_preemption(job_id, record.reason)
        try:
            status = state.runtime.poll(job_id, active.cursor)
        except Exception as exc:
            now = time.monotonic()
            active.failing_since = active.failing_since or now
            if now - active.failing_since < POLL_GRACE_SECONDS:
                log.debug("job %s: poll failed (%s); retrying", job_id, exc)
                return
            log.exception("job %s: poll failed for %.0f s", job_id, POLL_GRACE_SECONDS)
            state.finish(state.set_state(record, JobState.FAILED, f"lost contact with the job's supervisor: {exc}"))
            return
        active.failing_since = None
        for event in status.events:
            record = self._apply(record, event)
            active.cursor = event.seq  # a store failure mid-page resumes after the last event applied
        active.cursor = status.cursor
        if status.cursor != active.stored_cursor:
            state.store.update_status(job_id, runtime_cursor=str(status.cursor), restarts=status.restarts)
            active.stored_cursor = status.cursor
        if status.replan and not status.state.ends_run and record.state not in (JobState.CANCELLING, JobState.PREEMPTED):
            self.replacement.replace(record, status.replan)
        else:  # the supervisor waits for no plan (it went on without one, or the job is ending)
            active.replan_waiting = ()
        if status.drained and status.state is JobState.PREEMPTED:
            self._preempted(state.store.get_job(job_id), status.reason)
        elif status.drained and status.state.terminal:
            record = state.store.get_job(job_id)
            reason = record.reason if record.state == JobState.CANCELLING and status.state.value == JobState.CANCELLED else status.reason
            state.finish(state.set_state(record, status.state.value, reason))

    def _apply(self, record: JobRecord, event: RuntimeEvent) -> JobRecord:
        """Write one runtime event to the store, the job's runtime cursor moved to it in the same
        transaction (a replica that takes over from one killed mid-page resumes after it: no event is
        recorded twice); the job's record as it is afterwards."""
        store, metrics = self.state.store, self.state.metrics
        if event.kind is EventKind.STEP and event.step is not None:
            store.record_step(record.id, {**event.step, "time": event.time}, now=event.time, runtime_cursor=event.seq)
            if self.state.tracker is not None:
                self.state.tracker.step(record, self.state.grid_of(record), event.step, event.time)
            report = event.step_report()
            if metrics is not None:
                metrics.record_step(record.id, record.tenant, report)
                straggler = event.straggler()
                if straggler is not None and straggler.ratio is not None and straggler.ratio >= 1.0:
                    metrics.set_straggler_ratio(record.id, record.tenant, straggler.ratio)
            if report.checkpoint_bytes is not None:  # the step saved a checkpoint
                if metrics is not None:
                    metrics.record_checkpoint_size(record.id, record.tenant, report.checkpoint_bytes)
                if record.id in self.state.active:  # preemption's lost work counts from here
                    self.state.active[record.id].checkpoint_time = event.time
            return store.get_job(record.id)
        if event.kind in (EventKind.LOG, EventKind.REPLAN, EventKind.PLAN):
            level = "WARNING" if event.kind is EventKind.REPLAN else "INFO"
            payload: dict[str, Any] = {"message": event.message, "level": level}
            if event.rank is not None:
                payload["rank"] = event.rank
            store.append_event(record.id, st.EVENT_LOG, payload, now=event.time, runtime_cursor=event.seq)
            if event.kind is EventKind.PLAN and event.placement:
                grid = self.state.layout_on(record.id, record.job, len(event.placement)).grid
                self.replacement.adopt_plan(record, PlannedPlacement.from_plan(event.placement, grid))
        elif event.kind is EventKind.PLACEMENT and event.placement is not None:
            where = ", ".join(f"{p.get('rank')}->{p.get('node')}:{p.get('gpu')}" for p in event.placement)
            store.append_event(record.id, st.EVENT_LOG, {"level": "INFO", "message": f"ranks placed: {where}"}, now=event.time,
                               runtime_cursor=event.seq)
        elif event.kind is EventKind.STATE and event.state is not None:
            if event.state.terminal:
                return record  # recorded once the whole log is drained (see _follow), after the last step
            if record.state in (JobState.CANCELLING, JobState.PREEMPTED):
                return record  # a job being cancelled or preempted does not go back to running
            extra = {"start_time": event.time} if event.state is JobState.RUNNING and record.start_time is None else {}
            record = self.state.set_state(record, event.state, event.reason, runtime_cursor=str(event.seq), **extra)
            if event.state is JobState.RUNNING and self.state.tracker is not None:
                self.state.tracker.running(record, self.state.grid_of(record))
            if event.state is JobState.RESTARTING and metrics is not None and not is_resize(event):
                metrics.record_restart(record.id, record.tenant)
        return record
