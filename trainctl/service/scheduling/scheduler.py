"""The scheduler: the loop that follows running jobs and admits queued ones, and its leadership.

One background thread owns every transition after QUEUED except the API's cancel request. Each tick,
under the state's lock, it hands the runtime the jobs a short lease held back
(trainctl.service.scheduling.recovery), follows each active job (scheduling.following: events to the
store, cancels, preemptions, ends; a job whose supervisor lost a node goes to scheduling.replacement),
then runs an admission pass over the queue (scheduling.admission, which launches through
scheduling.launching, preempts through capacity.preemption and, when on, asks Ray's autoscaler for
nodes through capacity.autoscaling) and refreshes the gauges. The parts share one `SchedulerState` (scheduling.state): the store, the pool,
the runtime, the jobs followed and the lock.

State changes use the store's compare-and-set, so a cancel racing with admission is never lost.
While the store is unavailable (a PostgreSQL store whose database is away) ticks fail and the loop
keeps running; the first tick after it returns re-syncs from the store (`recover()`, which is
idempotent): a job whose admission was written but not seen to commit is started, a reservation
whose write never committed is released, and each job's runtime log is followed from the last event
applied, so nothing is lost or applied twice.

With a `leadership` (replicas sharing a PostgreSQL store, trainctl.service.scheduling.leadership) the loop works
only while this replica holds the lease: on taking it, it re-syncs from the store (`recover()`,
re-attaching the supervisors the previous leader followed); on losing it, it forgets its jobs. A
standby's pool mirrors the placements in the store, so GetCluster and PlanJob answer alike on every
replica. Every write of the loop is fenced by the lease (`JobStore.fenced`: refused once another
replica holds it, and the loop stands down), and a job is handed to the runtime only with enough lease
left, else it is left SCHEDULED for the next tick or the next leader's re-sync.
The service never runs torch collectives: the runtime (trainctl.workers.runtime) does the Ray work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainctl.planning.pool import GpuPool, PlannedPlacement
from trainctl.service.capacity.autoscaling import Autoscaling, NodeRequest
from trainctl.service.capacity.preemption import Preemption
from trainctl.service.metrics import NodeGpus, ServiceMetrics
from trainctl.service.scheduling.admission import Admission
from trainctl.service.scheduling.following import Following
from trainctl.service.scheduling.launching import Launcher
from trainctl.service.scheduling.leadership import Leadership
from trainctl.service.scheduling.recovery import Recovery
from trainctl.service.scheduling.replacement import Replacement
from trainctl.service.scheduling.state import PreemptionPolicy, Runtime, SchedulerState
from trainctl.service.security.paths import JobPathPolicy
from trainctl.service.security.tenancy import Quota, tenant_shares
from trainctl.service.store import Fence, JobRecord, JobStore, LeaseLost, StoreUnavailable
from trainctl.service.tracking.tracker import JobTracker
from trainctl.workers.events import ACTIVE_STATES, JobState

log = logging.getLogger(__name__)


@dataclass
class _CommitCount:
    """How many writes this process has committed to the store (`JobStore.on_commit` calls `add`)."""

    value: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self) -> None:
        with self._lock:
            self.value += 1


class _Shared:
    """A Scheduler attribute kept in its `SchedulerState`, so every part sees a replaced one."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, scheduler: Scheduler | None, owner: type | None = None) -> Any:
        return self if scheduler is None else getattr(scheduler.state, self.name)

    def __set__(self, scheduler: Scheduler, value: Any) -> None:
        setattr(scheduler.state, self.name, value)


class Scheduler:
    """Owns the queue and follows running jobs; `start()` runs the loop in a daemon thread."""

    store: JobStore = _Shared()
    pool: GpuPool = _Shared()
    runtime: Runtime = _Shared()
    runs_dir: Path = _Shared()
    metrics: ServiceMetrics | None = _Shared()
    quota_of: Callable[[str], Quota] = _Shared()
    leadership: Leadership | None = _Shared()
    """None: this scheduler is the only one (SQLite, or tests); else it works only while leading."""
    paths: JobPathPolicy | None = _Shared()
    """The service's path rule for launched jobs' files (`SchedulerState.paths`)."""

    def __init__(
        self, store: JobStore, pool: GpuPool, runtime: Runtime, runs_dir: Path,
        metrics: ServiceMetrics | None = None, quota_of: Callable[[str], Quota] | None = None,
        interval: float = 0.2, min_tick_gap: float = 0.1, leadership: Leadership | None = None,
        admission_refresh: float = 5.0, paths: JobPathPolicy | None = None, tracker: JobTracker | None = None,
        preemption: PreemptionPolicy | None = None, request_nodes: NodeRequest | None = None,
    ) -> None:
        self.state = SchedulerState(store, pool, runtime, runs_dir, wake=self.wake, metrics=metrics,
                                    leadership=leadership, paths=paths, tracker=tracker,
                                    preemption=preemption or PreemptionPolicy())
        if quota_of is not None:
            self.state.quota_of = quota_of
        self.interval = interval
        self.min_tick_gap = min_tick_gap
        """Least time between the starts of two ticks: wakes that come sooner (a burst of creates and
        cancels) are served by one tick, so the loop's cost does not grow with the API's call rate."""
        self.admission_refresh = admission_refresh
        """Longest time between two admission passes of the loop while nothing a pass reads has changed
        (a write to the store, a node gone or back, GPUs freed): a reloaded access file's quotas are seen
        by then."""
        launcher = Launcher(self.state)
        replacement = Replacement(self.state)
        self.autoscaling = None if request_nodes is None else Autoscaling(self.state, request_nodes)
        """Asks Ray's autoscaler for the map nodes a blocked queued job needs (None: autoscaling off)."""
        self._admission = Admission(self.state, launcher, Preemption(self.state), self.autoscaling)
        self._following = Following(self.state, replacement)
        self._replacement = replacement
        self._recovery = Recovery(self.state, launcher)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store_lost = False
        self._epoch: int | None = None
        """The lease epoch this scheduler re-synced under (None: not leading)."""
        self._fence: Fence | None = None
        """The lease the loop's writes carry (None without a leadership)."""
        self._commits = _CommitCount()
        """Counts every write this process commits to the store."""
        self._last_admission: tuple[float, int, frozenset[str], int] | None = None
        """When the loop's last admission pass started (monotonic), and the commits counted, the nodes
        down and the GPUs free then."""
        self._unsubscribe: Callable[[], None] | None = None

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
        """Stop the loop and wait (within `timeout` in all) for the cancels and preemptions in flight, so
        none outlives the store and the runtime it uses."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._following.join_sends(deadline)
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

    # ---- leadership ---------------------------------------------------------------------------------
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
        with self.state.lock:
            for holder in set(self.pool.holders().values()) - set(stored):
                self.pool.release(holder)
            for job_id, records in stored.items():
                self.pool.reserve(job_id, PlannedPlacement.from_records(records))

    def _stand_down(self) -> None:
        """Forget jobs, reservations and the gauges this scheduler exported (the leader exports them)."""
        state = self.state
        with state.lock:
            for job_id in set(state.active) | set(self.pool.holders().values()):
                self.pool.release(job_id)
                if self.metrics is not None:
                    self.metrics.forget_job(job_id)
            if self.metrics is not None:
                self.metrics.set_queue(0, None)
                self.metrics.set_jobs_by_state({})
                self.metrics.set_gpu_inventory([])
                self.metrics.set_tenant_shares([])
            state.active.clear()
            state.unlaunched.clear()
            state.preempting.clear()
            state.nominated.clear()
            if self.autoscaling is not None:
                self.autoscaling.forget()
            self._epoch = self._fence = None

    def recover(self) -> None:
        """Re-sync from the store after a (re)start or a store outage (`Recovery.recover`, idempotent)."""
        self._recovery.recover()

    # ---- one tick -------------------------------------------------------------------------------------
    def tick(self, *, skip_idle_admission: bool = False) -> None:
        """Follow active jobs, send cancels, admit what fits, refresh the gauges. With
        `skip_idle_admission` (the loop's ticks) the last two only when `_admission_due()`."""
        state = self.state
        with state.lock:
            self._recovery.launch_pending()
            for job_id in list(state.active):
                if job_id not in state.unlaunched:
                    self._following.follow(job_id)
            if not skip_idle_admission or self._admission_due():
                self._admission.admit()
                self._replacement.grow_back()
                self._export()

    def _admission_due(self) -> bool:
        """Whether this tick (its jobs followed) runs an admission pass: not when nothing the last one
        read has changed since it started (no write to the store, this tick's included; the same nodes
        down and GPUs free) and it is less than `admission_refresh` old, so an idle service with a long
        queue does not re-decide the same thing every tick. Replicas sharing a store always pass:
        another one's writes are not seen."""
        now, commits = time.monotonic(), self._commits.value  # a commit after this read: the next tick passes
        seen = (commits, frozenset(self.state.down_nodes()), self.pool.free_count)
        last = self._last_admission
        due = self.leadership is not None or last is None or seen != last[1:] or now - last[0] >= self.admission_refresh
        if due:
            self._last_admission = (now, *seen)
        return due

    def _export(self) -> None:
        """Refresh the gauges: the queue, jobs by state, tenants' shares, the GPU inventory."""
        if self.metrics is None:
            return
        queued = self.store.list_jobs(states=[JobState.QUEUED], oldest_first=True, limit=1)
        counts = self.store.count_by_state()
        self.metrics.set_queue(counts.get(JobState.QUEUED, 0), queued[0].create_time if queued else None)
        self.metrics.set_jobs_by_state(counts)
        active = self.store.list_jobs(states=ACTIVE_STATES)
        self.metrics.set_tenant_shares(tenant_shares(((r.tenant, r.job.spec.resources.gpus) for r in active), self.quota_of))
        used: dict[str, int] = {}
        for node, _gpu in self.pool.holders():
            used[node] = used.get(node, 0) + 1
        domains = self.state.domains()
        self.metrics.set_gpu_inventory(
            NodeGpus(node=name, nvlink_domain=domains.get(name, name), total=len(gpus), used=used.get(name, 0))
            for name, gpus in self.pool.nodes()
        )

    # ---- API side -----------------------------------------------------------------------------------
    def request_cancel(self, job_id: str, reason: str) -> JobRecord:
        """QUEUED -> CANCELLED at once (a preempted job queued again too); active, or being preempted ->
        CANCELLING (the loop sends the cancel); else as is."""
        record = self.store.update_status(job_id, expect=[JobState.QUEUED], state=JobState.CANCELLED, reason=reason)
        if record is None:
            record = self.store.update_status(
                job_id, expect=[JobState.SCHEDULED, JobState.RUNNING, JobState.RESTARTING, JobState.PREEMPTED],
                state=JobState.CANCELLING, reason=reason,
            )
        if record is None:
            return self.store.get_job(job_id)
        if self.metrics is not None:
            self.metrics.set_job_state(record.id, record.tenant, record.state)
        self.wake()
        return record
