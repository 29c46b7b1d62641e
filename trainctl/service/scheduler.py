"""The scheduler: the queue (priority, then age), gang admission, and the loop that follows running jobs.

One background thread owns every transition after QUEUED except the API's cancel request:

1. follow active jobs: poll the runtime from each job's cursor, append what happened to the store
   (state changes, step metrics, log lines), release the GPUs of jobs that ended, and re-place a job
   whose supervisor lost a node (its status names the lost nodes): on the free GPUs plus its own, off
   the nodes Ray does not have alive; the new plan goes to the supervisor and replaces the job's
   reservation (the supervisor's PLAN event is the truth: following it makes the reservation and the
   stored placement match it), or the job waits (reason and event say so) until GPUs free up or a
   node returns.
   Each job is followed on its own: an unexpected error is logged and retried next tick without
   stopping the others; one that lasts FOLLOW_GRACE_SECONDS stops the job and fails it;
2. hand cancels of jobs the API moved to CANCELLING to a worker thread (a cancel waits until the
   job's actors and placement group are gone, and must not stall the loop);
3. admit queued jobs in order (priority descending, then submission order): a job starts only when
   placement finds a GPU for every rank (gang scheduling). The queue is strict: a job that does not
   fit blocks lower ones, so a large job is never starved by a stream of small ones; a job its tenant's
   quota holds blocks that tenant's lower ones (not other tenants'); a running job waiting to be
   re-placed blocks them all. Nodes Ray does not have alive are left out. A waiting
   job's reason says what it waits for. An admitted job's run directory
   (trainctl.parallelism.run_directory) is named here, once, and recorded with its placement; every
   later start and re-attach hands the runtime that recorded one.

State changes use the store's compare-and-set, so a cancel racing with admission is never lost.
While the store is unavailable (a PostgreSQL store whose database is away) ticks fail and the loop
keeps running; the first tick after it returns re-syncs from the store (`recover()`, which is
idempotent): a job whose admission was written but not seen to commit is started, a reservation
whose write never committed is released, and each job's runtime log is followed from the last event
applied, so nothing is lost or applied twice.

With a `leadership` (replicas sharing a PostgreSQL store, trainctl.service.leadership) the loop works
only while this replica holds the lease: on taking it, it re-syncs from the store (`recover()`,
re-attaching the supervisors the previous leader followed); on losing it, it forgets its jobs. A
standby's pool mirrors the placements in the store, so GetCluster and PlanJob answer alike on every
replica. Every write of the loop is fenced by the lease (`JobStore.fenced`: refused once another
replica holds it, and the loop stands down), and a job is handed to the runtime only with enough lease
left, else it is left SCHEDULED for the next tick or the next leader's re-sync.
The service never runs torch collectives: the runtime (trainctl.workers.runtime) does the Ray work.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from trainctl.parallelism.run_directory import RunDirectory
from trainctl.planning.pool import GpuPool, PlannedPlacement
from trainctl.service import store as st
from trainctl.service.leadership import Leadership
from trainctl.service.metrics import NodeGpus, ServiceMetrics
from trainctl.service.paths import JobPathPolicy
from trainctl.service.relaunch import Ending, after_cluster_loss
from trainctl.service.store import Fence, JobRecord, JobStore, LeaseLost, QueuedJob, StoreUnavailable
from trainctl.service.tenancy import Quota, TenantUsage, start_block_reason
from trainctl.spec.files import FileRule
from trainctl.spec.job import TrainingJob
from trainctl.workers.events import ACTIVE_STATES, EventKind, JobState
from trainctl.workers.events import Event as RuntimeEvent
from trainctl.workers.events import JobStatus as RuntimeStatus
from trainctl.workers.relaunch import Relaunch

log = logging.getLogger(__name__)

QUEUE_PAGE = 64
"""Queued jobs the admission pass reads at a time (it stops at the first job that does not fit)."""
POLL_GRACE_SECONDS = 30.0
"""How long a job's supervisor may be unreachable (just created, or busy) before the job fails."""
FOLLOW_GRACE_SECONDS = 30.0
"""How long following a job may keep failing with an unexpected error (typically a poison event: the
store refuses the same event on every tick) before the job is stopped and fails."""


class Runtime(Protocol):
    """What the scheduler needs from trainctl.workers.runtime.RayRuntime."""

    def start_job(
        self, job_id: str, job: TrainingJob, placement: Any, run_dir: RunDirectory, *,
        node_env: dict[str, dict[str, str]], file_rule: FileRule, relaunch: Relaunch | None = None,
    ) -> None: ...

    def attach(self, job_id: str, run_dir: RunDirectory) -> None: ...

    def lost_with_cluster(self, job_id: str) -> bool: ...

    def running_jobs(self) -> list[str]: ...

    def poll(self, job_id: str, cursor: int) -> RuntimeStatus: ...

    def cancel(self, job_id: str) -> RuntimeStatus: ...

    def replace_plan(self, job_id: str, job: TrainingJob, placement: Any) -> bool: ...

    def live_nodes(self) -> set[str]: ...


@dataclass
class _Active:
    cursor: int = 0
    """The runtime log's position after the last event applied to the store."""
    stored_cursor: int = 0
    """The position last written to the job's `runtime_cursor` (where a restarted service resumes)."""
    cancel: threading.Thread | None = None
    """The thread sending the job's cancel to the runtime (None: none sent)."""
    failing_since: float | None = None
    """Since when polling the job's supervisor fails (None: the last poll answered)."""
    follow_failing_since: float | None = None
    """Since when following the job fails with an unexpected error (None: the last follow went through)."""
    failure: str | None = None
    """Why the job is being failed because it could not be followed: it is stopped, then recorded FAILED."""
    replan_waiting: tuple[str, ...] = ()
    """The lost nodes while the job waits for GPUs to be re-placed on (empty otherwise)."""


@dataclass
class _CommitCount:
    """How many writes this process has committed to the store (`JobStore.on_commit` calls `add`)."""

    value: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self) -> None:
        with self._lock:
            self.value += 1


@dataclass
class Scheduler:
    """Owns the queue and follows running jobs; `start()` runs the loop in a daemon thread."""

    store: JobStore
    pool: GpuPool
    runtime: Runtime
    runs_dir: Path
    metrics: ServiceMetrics | None = None
    quota_of: Callable[[str], Quota] = lambda _tenant: Quota()
    interval: float = 0.2
    min_tick_gap: float = 0.1
    """Least time between the starts of two ticks: wakes that come sooner (a burst of creates and
    cancels) are served by one tick, so the loop's cost does not grow with the API's call rate."""
    leadership: Leadership | None = None
    """None: this scheduler is the only one (SQLite, or tests); else it works only while leading."""
    admission_refresh: float = 5.0
    """Longest time between two admission passes of the loop while nothing a pass reads has changed (a
    write to the store, a node gone or back, GPUs freed): a reloaded access file's quotas are seen by then."""
    paths: JobPathPolicy | None = None
    """The service's path rule: each launched job's ranks open its files under `paths.file_rule` (its
    data roots, and the run directories of its tenant's jobs its spec names). None: the default
    `FileRule`, which confines nothing (a scheduler without a served API, in tests and benchmarks)."""
    _active: dict[str, _Active] = field(default_factory=dict)
    _wake: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _store_lost: bool = False
    _epoch: int | None = None
    """The lease epoch this scheduler re-synced under (None: not leading)."""
    _fence: Fence | None = None
    """The lease the loop's writes carry (None without a leadership)."""
    _unlaunched: set[str] = field(default_factory=set)
    """Jobs admitted or recovered but not handed to the runtime yet (too little lease left)."""
    _commits: _CommitCount = field(default_factory=_CommitCount)
    """Counts every write this process commits to the store."""
    _last_admission: tuple[float, int, frozenset[str], int] | None = None
    """When the loop's last admission pass started (monotonic), and the commits counted, the nodes down
    and the GPUs free then."""
    _unsubscribe: Callable[[], None] | None = None
    _cancels: set[threading.Thread] = field(default_factory=set)
    """Threads sending a cancel to the runtime (`_cancel`), until each ends; `stop` waits for them."""
    _cancels_lock: threading.Lock = field(default_factory=threading.Lock)

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Re-attach to jobs the store says are active (when leading: taking the lease does), then start
        the loop."""
        self._unsubscribe = self.store.on_commit(self._commits.add)
        if self.leadership is None:
            self.recover()
        else:
            self._in_charge()
        self._thread = threading.Thread(target=self._run, name="trainctl-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and wait (within `timeout` in all) for the cancels in flight, so none outlives
        the store and the runtime it uses."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cancels_lock:
            cancels = list(self._cancels)
        for thread in cancels:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self._unsubscribe is not None:
            self._unsubscribe()

    def wake(self) -> None:
        """Run the next tick now (a job was created or cancelled)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if not self._in_charge():
                    self._mirror()
                else:
                    with self.store.fenced(self._fence):
                        if self._store_lost:
                            self.recover()
                            self._store_lost = False
                            log.warning("the store is back; the scheduler re-synced from it")
                        else:
                            self.tick(skip_idle_admission=True)
            except LeaseLost as exc:
                log.warning("scheduler standing by: %s", exc)
                self._stand_down()
            except StoreUnavailable as exc:
                if not self._store_lost:
                    log.warning("scheduler paused: %s", exc)
                self._store_lost = True
            except Exception:  # the loop must survive anything one job does
                log.exception("scheduler tick failed")
            self._wake.wait(self.interval)
            self._stop.wait(started + self.min_tick_gap - time.monotonic())
            self._wake.clear()

    @property
    def leading(self) -> bool:
        """Whether this scheduler does the work that must happen once (always, without a leadership)."""
        return self.leadership is None or self._epoch is not None

    def _in_charge(self) -> bool:
        """Whether this scheduler should work now; re-syncs on taking the lease, forgets on losing it."""
        if self.leadership is None:
            return True
        lease = self.leadership.current()
        if lease is None:
            if self._epoch is not None:
                log.warning("scheduler lease lost; standing by")
                self._stand_down()
            return False
        if lease.fence.epoch != self._epoch:
            self._stand_down()
            with self.store.fenced(lease.fence):
                self.recover()
            self._epoch, self._fence = lease.fence.epoch, lease.fence
            log.info("scheduler leading (lease epoch %d)", lease.fence.epoch)
        return True

    def _mirror(self) -> None:
        """A standby's pool holds what the store says the leader's jobs hold."""
        stored = {r.id: r.placement for r in self.store.list_jobs(states=ACTIVE_STATES) if r.placement}
        with self._lock:
            for holder in set(self.pool.holders().values()) - set(stored):
                self.pool.release(holder)
            for job_id, records in stored.items():
                self.pool.reserve(job_id, PlannedPlacement.from_records(records))

    def _stand_down(self) -> None:
        """Forget jobs, reservations and the gauges this scheduler exported (the leader exports them)."""
        with self._lock:
            for job_id in set(self._active) | set(self.pool.holders().values()):
                self.pool.release(job_id)
                if self.metrics is not None:
                    self.metrics.forget_job(job_id)
            if self.metrics is not None:
                self.metrics.set_queue(0, None)
                self.metrics.set_jobs_by_state({})
                self.metrics.set_gpu_inventory([])
            self._active.clear()
            self._unlaunched.clear()
            self._epoch = self._fence = None

    def recover(self) -> None:
        """Rebuild reservations and cursors from the store after a (re)start or a store outage: forget
        jobs the store does not have active and reservations it does not know, re-attach the supervisors
        of active jobs not followed yet, relaunch (or end) those whose supervisor ended with the Ray
        cluster it ran on (trainctl.service.relaunch), and start those whose admission a crash interrupted
        before their supervisor existed. Jobs already followed keep their cursors."""
        with self._lock:
            running = set(self.runtime.running_jobs())
            stored = self.store.list_jobs(states=ACTIVE_STATES, oldest_first=True)
            active_ids = {record.id for record in stored}
            for job_id in set(self._active) - active_ids:
                del self._active[job_id]
                self._unlaunched.discard(job_id)
            for holder in set(self.pool.holders().values()) - active_ids:
                self.pool.release(holder)
            for record in stored:
                if record.id not in self._active:
                    self._recover_job(record, running)

    def _recover_job(self, record: JobRecord, running: set[str]) -> None:
        placement = PlannedPlacement.from_records(record.placement)
        self.pool.reserve(record.id, placement)
        cursor = int(record.runtime_cursor or 0)
        self._active[record.id] = _Active(cursor=cursor, stored_cursor=cursor)
        run = RunDirectory.at(record.run_dir)
        self.runtime.attach(record.id, run)
        if record.id in running:
            return
        if not run.events.exists():
            if record.state == JobState.CANCELLING:
                self._finish(self._set_state(record, JobState.CANCELLED, record.reason))
                return
            log.info("job %s: admission was interrupted by a service restart; starting it", record.id)
            self._launch(record, placement)
        elif self.runtime.lost_with_cluster(record.id):  # else Ray gave up on it: following it fails the job
            outcome = after_cluster_loss(record, run)
            if isinstance(outcome, Ending):
                self._finish(self._set_state(record, outcome.state, outcome.reason))
            elif outcome is not None:
                log.warning("job %s: relaunching it: %s", record.id, outcome.reason)
                self._launch(record, placement, outcome)

    # ---- one tick -------------------------------------------------------------------------------------
    def tick(self, *, skip_idle_admission: bool = False) -> None:
        """Follow active jobs, send cancels, admit what fits, refresh the gauges. With
        `skip_idle_admission` (the loop's ticks) the last two only when `_admission_due()`."""
        with self._lock:
            self._launch_pending()
            for job_id in list(self._active):
                if job_id not in self._unlaunched:
                    self._follow_isolated(job_id)
            if not skip_idle_admission or self._admission_due():
                self._admit()
                self._export()

    def _admission_due(self) -> bool:
        """Whether this tick (its jobs followed) runs an admission pass: not when nothing the last one
        read has changed since it started (no write to the store, this tick's included; the same nodes
        down and GPUs free) and it is less than `admission_refresh` old, so an idle service with a long
        queue does not re-decide the same thing every tick. Replicas sharing a store always pass:
        another one's writes are not seen."""
        now, commits = time.monotonic(), self._commits.value  # a commit after this read: the next tick passes
        seen = (commits, frozenset(self._down_nodes()), self.pool.free_count)
        last = self._last_admission
        due = self.leadership is not None or last is None or seen != last[1:] or now - last[0] >= self.admission_refresh
        if due:
            self._last_admission = (now, *seen)
        return due

    def _follow_isolated(self, job_id: str) -> None:
        """Follow one job; an unexpected error is that job's alone (`_follow_failed`), so the other jobs
        and the admission pass go on. The store being away or the lease lost still ends the tick."""
        try:
            self._follow(job_id)
        except (StoreUnavailable, LeaseLost):
            raise
        except Exception as exc:
            self._follow_failed(job_id, exc)
            return
        if job_id in self._active:
            self._active[job_id].follow_failing_since = None

    def _follow_failed(self, job_id: str, exc: Exception) -> None:
        """Log a job's failed follow (the next tick retries from the last event applied); one failing for
        FOLLOW_GRACE_SECONDS marks the job to be stopped and failed with a reason naming the error."""
        active = self._active.get(job_id)
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

    def _fail_unfollowed(self, job_id: str, active: _Active, failure: str) -> None:
        """Stop a job that could not be followed; once the runtime's cancel is done, record it FAILED
        with `failure` and free its GPUs."""
        if active.cancel is None:
            active.cancel = self._send_cancel(job_id)
        if not active.cancel.is_alive():
            self._finish(self._set_state(self.store.get_job(job_id), JobState.FAILED, failure))

    def _send_cancel(self, job_id: str) -> threading.Thread:
        """Start the thread that stops the job's supervisor and ranks (`_cancel`)."""
        thread = threading.Thread(target=self._cancel, args=(job_id,), name=f"cancel-{job_id}", daemon=True)
        with self._cancels_lock:
            self._cancels.add(thread)
        thread.start()
        return thread

    def _follow(self, job_id: str) -> None:
        active = self._active[job_id]
        if active.failure is not None:
            self._fail_unfollowed(job_id, active, active.failure)
            return
        record = self.store.get_job(job_id)
        if record.state == JobState.CANCELLING and active.cancel is None:
            active.cancel = self._send_cancel(job_id)
        try:
            status = self.runtime.poll(job_id, active.cursor)
        except Exception as exc:
            now = time.monotonic()
            active.failing_since = active.failing_since or now
            if now - active.failing_since < POLL_GRACE_SECONDS:
                log.debug("job %s: poll failed (%s); retrying", job_id, exc)
                return
            log.exception("job %s: poll failed for %.0f s", job_id, POLL_GRACE_SECONDS)
            self._finish(self._set_state(record, JobState.FAILED, f"lost contact with the job's supervisor: {exc}"))
            return
        active.failing_since = None
        for event in status.events:
            record = self._apply(record, event)
            active.cursor = event.seq  # a store failure mid-page resumes after the last event applied
        active.cursor = status.cursor
        if status.cursor != active.stored_cursor:
            self.store.update_status(job_id, runtime_cursor=str(status.cursor), restarts=status.restarts)
            active.stored_cursor = status.cursor
        if status.replan and not status.state.terminal and record.state != JobState.CANCELLING:
            self._replace(record, status.replan)
        else:  # the supervisor waits for no plan (it went on without one, or the job is ending)
            active.replan_waiting = ()
        if status.drained and status.state.terminal:
            record = self.store.get_job(job_id)
            reason = record.reason if record.state == JobState.CANCELLING and status.state.value == JobState.CANCELLED else status.reason
            self._finish(self._set_state(record, status.state.value, reason))

    def _cancel(self, job_id: str) -> None:
        """Stop the job's supervisor and ranks (blocks until none is left); the loop records the end."""
        try:
            self.runtime.cancel(job_id)
        except Exception as exc:
            log.exception("job %s: cancel failed", job_id)
            self.store.append_event(job_id, st.EVENT_LOG, {"level": "ERROR", "message": f"cancel failed: {exc}"})
        finally:
            with self._cancels_lock:
                self._cancels.discard(threading.current_thread())
            self.wake()

    def _apply(self, record: JobRecord, event: RuntimeEvent) -> JobRecord:
        if event.kind is EventKind.STEP and event.step is not None:
            self.store.record_step(record.id, {**event.step, "time": event.time}, now=event.time)
            if self.metrics is not None:
                report = event.step_report()
                self.metrics.record_step(record.id, record.tenant, report)
                straggler = event.straggler()
                if straggler is not None and straggler.ratio is not None and straggler.ratio >= 1.0:
                    self.metrics.set_straggler_ratio(record.id, record.tenant, straggler.ratio)
                if report.checkpoint_bytes is not None:  # the step saved a checkpoint
                    self.metrics.record_checkpoint_size(record.id, record.tenant, report.checkpoint_bytes)
            return self.store.get_job(record.id)
        if event.kind in (EventKind.LOG, EventKind.REPLAN, EventKind.PLAN):
            level = "WARNING" if event.kind is EventKind.REPLAN else "INFO"
            payload: dict[str, Any] = {"message": event.message, "level": level}
            if event.rank is not None:
                payload["rank"] = event.rank
            self.store.append_event(record.id, st.EVENT_LOG, payload, now=event.time)
            if event.kind is EventKind.PLAN and event.placement:
                self._adopt_plan(record, PlannedPlacement.from_plan(event.placement, record.job))
        elif event.kind is EventKind.PLACEMENT and event.placement is not None:
            where = ", ".join(f"{p.get('rank')}->{p.get('node')}:{p.get('gpu')}" for p in event.placement)
            self.store.append_event(record.id, st.EVENT_LOG, {"level": "INFO", "message": f"ranks placed: {where}"}, now=event.time)
        elif event.kind is EventKind.STATE and event.state is not None:
            if event.state.terminal:
                return record  # recorded once the whole log is drained (see _follow), after the last step
            if record.state == JobState.CANCELLING:
                return record  # a job being cancelled does not go back to running
            extra = {"start_time": event.time} if event.state is JobState.RUNNING and record.start_time is None else {}
            record = self._set_state(record, event.state, event.reason, **extra)
            if event.state is JobState.RESTARTING and self.metrics is not None:
                self.metrics.record_restart(record.id, record.tenant)
        return record

    def _replace(self, record: JobRecord, lost: tuple[str, ...]) -> None:
        """Re-place a job whose supervisor lost `lost`: a plan on the free GPUs plus the job's own, off
        every node that is not alive, handed to the supervisor; or a reason saying what it waits for."""
        active = self._active[record.id]
        down = set(lost) | self._down_nodes()
        placement = self.pool.place(record.job, holder=record.id, down=down)
        running = [JobState.SCHEDULED, JobState.RUNNING, JobState.RESTARTING]
        if placement is None:
            free = len(self.pool.free_slots(holder=record.id, down=down))
            reason = (
                f"node(s) {', '.join(lost)} lost; waiting for {record.job.spec.resources.gpus} GPUs to re-place "
                f"the job: {free} of {self.pool.total} free"
            )
            if active.replan_waiting != lost:
                active.replan_waiting = lost
                self.store.append_event(record.id, st.EVENT_LOG, {"level": "WARNING", "message": reason})
            if record.reason != reason:
                self.store.update_status(record.id, expect=running, reason=reason)
            return
        if not self._may_launch():
            return  # too little lease left to hand a plan over: the next tick, or the next leader
        try:
            adopted = self.runtime.replace_plan(record.id, record.job, placement)
        except Exception:
            log.exception("job %s: handing over the new plan failed; retrying", record.id)
            return
        active.replan_waiting = ()
        if not adopted:  # the supervisor no longer waits (cancelled, failed or restarted meanwhile)
            return
        nodes = sorted({a.node for a in placement.assignments})
        self._hold(
            record.id, placement, expect=running,
            reason=f"node(s) {', '.join(lost)} lost; re-placed {len(placement.assignments)} ranks on {', '.join(nodes)}",
        )

    def _adopt_plan(self, record: JobRecord, plan: PlannedPlacement) -> None:
        """Make the job's reservation and stored placement the plan its supervisor adopted (a PLAN event:
        the supervisor's log is the truth, so a re-placement whose store write never committed, say the
        lease was lost or the service died right after the hand-over, is repaired here); idempotent."""
        if set(PlannedPlacement.from_records(record.placement).assignments) == set(plan.assignments):
            self.pool.reserve(record.id, plan)
            return
        log.warning("job %s: its supervisor runs a plan the store did not have; recording it", record.id)
        self._hold(record.id, plan)

    def _hold(self, job_id: str, placement: PlannedPlacement, **changes: Any) -> None:
        """Reserve `placement`'s GPUs for the job and store it as the job's placement, with `changes`."""
        self.pool.reserve(job_id, placement)
        updated = self.store.update_status(job_id, placement=placement.records(), **changes)
        if updated is not None and self.metrics is not None:
            self.metrics.set_job_placement(updated.id, updated.tenant, self._by_domain(placement))

    def _may_launch(self) -> bool:
        """Whether enough lease is left to hand the runtime a job or a plan (always, without a leadership)."""
        return self.leadership is None or self.leadership.may_launch()

    def _down_nodes(self) -> set[str]:
        """Nodes of the pool that Ray does not have alive."""
        return {name for name, _ in self.pool.nodes()} - self.runtime.live_nodes()

    def _set_state(self, record: JobRecord, state: JobState, reason: str, **extra: Any) -> JobRecord:
        """Record the job's new state; a job the API moved to CANCELLING meanwhile leaves it only for an
        end, so a supervisor's late RUNNING or RESTARTING never undoes a cancel."""
        if record.state == state:
            return record
        expect = None if JobState(state).terminal else [s for s in JobState if not s.terminal and s != JobState.CANCELLING]
        updated = self.store.update_status(record.id, expect=expect, state=state, reason=reason, **extra)
        if updated is None:
            return self.store.get_job(record.id)
        if self.metrics is not None:
            self.metrics.set_job_state(updated.id, updated.tenant, updated.state)
        return updated

    def _finish(self, record: JobRecord) -> None:
        if record.terminal:
            self.pool.release(record.id)
            self._active.pop(record.id, None)
            self.wake()

    def _admit(self) -> None:
        """One pass over the queue: start jobs in order until one does not fit; that one and every job
        behind it get their waiting reason in one write, so a pass reads and writes the same few rows
        however long the queue is."""
        queue = self._queue()
        first = next(queue, None)
        if first is None:
            return
        replacing = next((job_id for job_id, active in self._active.items() if active.replan_waiting), None)
        if replacing is not None:
            reason = f"waiting behind {replacing}, which waits for GPUs to re-place it after a node loss"
            self.store.set_queue_reason(reason, behind=None)
            return
        down = self._down_nodes()
        usage: dict[str, TenantUsage] = {}
        held: dict[str, str] = {}
        for entry in itertools.chain([first], queue):
            gpus = entry.job.spec.resources.gpus
            quota_reason = self._quota_reason(entry, usage, held)
            if quota_reason is not None:
                self._wait(entry, quota_reason)
                self._decision("quota")
                continue  # a tenant held by its quota does not block other tenants
            started = time.perf_counter()
            placement = self.pool.place(entry.job, down=down)
            solver_seconds = time.perf_counter() - started
            if placement is None:
                free = len(self.pool.free_slots(down=down))
                self._wait(entry, f"waiting for {gpus} GPUs: {free} of {self.pool.total} free")
                self._decision("no_capacity", solver_seconds)
                behind = f"waiting behind {entry.id} (priority {entry.priority}), first in the queue"
                self.store.set_queue_reason(behind, behind=entry)
                return
            self.pool.reserve(entry.id, placement)
            nodes = sorted({a.node for a in placement.assignments})
            updated = self.store.update_status(
                entry.id, expect=[JobState.QUEUED], state=JobState.SCHEDULED,
                reason=f"placed {len(placement.assignments)} ranks on {', '.join(nodes)}", schedule_time=time.time(),
                placement=placement.records(), run_dir=str(RunDirectory.of_job(self.runs_dir, entry.id).root),
            )
            if updated is None:  # cancelled meanwhile
                self.pool.release(entry.id)
                continue
            usage.pop(entry.tenant)  # it runs more now
            self._decision("started", solver_seconds)
            if self.metrics is not None:
                self.metrics.set_job_state(updated.id, updated.tenant, updated.state)
                self.metrics.set_job_placement(updated.id, updated.tenant, self._by_domain(placement))
            self._active[entry.id] = _Active()
            self._launch(updated, placement)

    def _quota_reason(self, entry: QueuedJob, usage: dict[str, TenantUsage], held: dict[str, str]) -> str | None:
        """Why `entry` waits for its tenant's quota in this pass, or None: the first of a tenant's jobs
        that the quota holds (recorded in `held`, tenant -> job id) holds the tenant's later ones too, so
        its smaller jobs never overtake it. `usage` caches each tenant's usage for the pass."""
        tenant = entry.tenant
        if tenant in held:
            return f"waiting behind {held[tenant]}, held by tenant {tenant!r}'s quota"
        if tenant not in usage:
            usage[tenant] = self._usage(tenant)
        reason = start_block_reason(tenant, self.quota_of(tenant), usage[tenant], entry.job.spec.resources.gpus)
        if reason is not None:
            held[tenant] = entry.id
        return reason

    def _queue(self) -> Iterator[QueuedJob]:
        """The queue in admission order, read a page at a time as the pass walks it."""
        after = None
        while True:
            page = self.store.queue(after=after, limit=QUEUE_PAGE)
            yield from page
            if len(page) < QUEUE_PAGE:
                return
            after = page[-1]

    def _launch_pending(self) -> None:
        """Hand the runtime the jobs a short lease held back, when the lease allows it now."""
        for job_id in sorted(self._unlaunched):
            if not self._may_launch():
                return
            record = self.store.get_job(job_id)
            self._unlaunched.discard(job_id)
            if not record.terminal:  # started, relaunched or cancelled as a re-sync would
                self._recover_job(record, running=set())

    def _usage(self, tenant: str) -> TenantUsage:
        active = self.store.list_jobs(tenant=tenant, states=ACTIVE_STATES)
        queued = self.store.count_by_state(tenant).get(JobState.QUEUED, 0)
        return TenantUsage(queued_jobs=queued, running_gpus=sum(r.job.spec.resources.gpus for r in active))

    def _decision(self, decision: str, solver_seconds: float | None = None) -> None:
        if self.metrics is not None:
            self.metrics.observe_scheduling(decision, solver_seconds)

    def _by_domain(self, placement: PlannedPlacement) -> dict[tuple[str, str], int]:
        domains = self.pool.domains()
        out: dict[tuple[str, str], int] = {}
        for a in placement.assignments:
            key = (a.node, domains.get(a.node, a.node))
            out[key] = out.get(key, 0) + 1
        return out

    def _export(self) -> None:
        if self.metrics is None:
            return
        queued = self.store.list_jobs(states=[JobState.QUEUED], oldest_first=True, limit=1)
        counts = self.store.count_by_state()
        self.metrics.set_queue(counts.get(JobState.QUEUED, 0), queued[0].create_time if queued else None)
        self.metrics.set_jobs_by_state(counts)
        used: dict[str, int] = {}
        for node, _gpu in self.pool.holders():
            used[node] = used.get(node, 0) + 1
        domains = self.pool.domains()
        self.metrics.set_gpu_inventory(
            NodeGpus(node=name, nvlink_domain=domains.get(name, name), total=len(gpus), used=used.get(name, 0))
            for name, gpus in self.pool.nodes()
        )

    def _wait(self, entry: QueuedJob, reason: str) -> None:
        if entry.reason != reason:
            self.store.update_status(entry.id, expect=[JobState.QUEUED], reason=reason)

    def _launch(self, record: JobRecord, placement: PlannedPlacement, relaunch: Relaunch | None = None) -> None:
        if not self._may_launch():
            self._unlaunched.add(record.id)  # too little lease left: the next tick, or the next leader
            return
        try:
            self.runtime.start_job(
                record.id, record.job, placement, RunDirectory.at(record.run_dir), node_env=self.pool.nccl_env(),
                file_rule=self._file_rule(record), relaunch=relaunch,
            )
        except Exception as exc:
            log.exception("job %s: start failed", record.id)
            self._finish(self._set_state(record, JobState.FAILED, f"could not start the job: {exc}"))

    def _file_rule(self, record: JobRecord) -> FileRule:
        """The rule `record`'s ranks open its files under: the run directories it may read besides its
        own are those of its tenant's jobs that its spec names, and, in turn, those theirs name (a LoRA
        run's checkpoint loads its own `init_from` as its base, `checkpoint.pretrained.load_weights`)."""
        if self.paths is None:
            return FileRule()

        def same_tenant(job_id: str) -> bool:
            try:
                return self.store.get_job(job_id).tenant == record.tenant
            except st.JobNotFound:
                return False

        rule = self.paths.file_rule(record.job.spec, record.id, same_tenant)
        readable, named = set(rule.readable_runs), set(rule.readable_runs) - {record.id}
        while named:
            earlier = self.store.get_job(named.pop())
            more = self.paths.file_rule(earlier.job.spec, earlier.id, same_tenant).readable_runs - readable
            readable |= more
            named |= more
        return replace(rule, readable_runs=frozenset(readable))

    # ---- API side -----------------------------------------------------------------------------------
    def request_cancel(self, job_id: str, reason: str) -> JobRecord:
        """QUEUED -> CANCELLED at once; active -> CANCELLING (the loop sends the cancel); else as is."""
        record = self.store.update_status(job_id, expect=[JobState.QUEUED], state=JobState.CANCELLED, reason=reason)
        if record is None:
            record = self.store.update_status(
                job_id, expect=[JobState.SCHEDULED, JobState.RUNNING, JobState.RESTARTING], state=JobState.CANCELLING, reason=reason
            )
        if record is None:
            return self.store.get_job(job_id)
        if self.metrics is not None:
            self.metrics.set_job_state(record.id, record.tenant, record.state)
        self.wake()
        return record
