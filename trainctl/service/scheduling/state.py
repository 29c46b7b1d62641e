"""What the scheduler's parts share: the store, the pool, the runtime, the jobs followed and the lock one
tick holds, with the few writes every part makes (a job's state, its end, its held placement)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.parallelism.run_directory import RunDirectory
from trainctl.planning.pool import GpuPool, PlannedPlacement
from trainctl.service.metrics import ServiceMetrics
from trainctl.service.scheduling.leadership import Leadership
from trainctl.service.security.paths import JobPathPolicy
from trainctl.service.security.tenancy import Quota
from trainctl.service.store import JobRecord, JobStore
from trainctl.service.tracking.tracker import GridOf, JobTracker
from trainctl.spec.files import FileRule
from trainctl.spec.job import TrainingJob
from trainctl.spec.validate import layout_on
from trainctl.workers.events import ACTIVE_STATES, JobState
from trainctl.workers.events import JobStatus as RuntimeStatus
from trainctl.workers.relaunch import Relaunch


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

    def preempt(self, job_id: str, reason: str, grace: float) -> RuntimeStatus: ...

    def replace_plan(self, job_id: str, job: TrainingJob, placement: Any) -> bool: ...

    def resize(self, job_id: str, job: TrainingJob, placement: Any) -> bool: ...

    def live_nodes(self) -> set[str]: ...


@dataclass
class ActiveJob:
    """What the scheduler keeps about a job it follows."""

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
    preempt: threading.Thread | None = None
    """The thread sending the job's preemption to the runtime (None: none sent)."""
    checkpoint_time: float | None = None
    """When the job's newest checkpoint was saved, as its step reports say (None: none seen yet)."""


@dataclass(frozen=True)
class PreemptionPolicy:
    """When and how the scheduler preempts running jobs for a queued job of higher priority
    (trainctl.service.capacity.preemption)."""

    enabled: bool = True
    grace_seconds: float = 120.0
    """How long a preempted job has to checkpoint at its next step boundary and stop; its ranks are torn
    down after it (it then resumes from its newest complete checkpoint, losing the steps since)."""
    cooldown_seconds: float = 600.0
    """A job preempted less than this long ago is not chosen again, so preemptions never cascade back and
    forth between jobs."""


def _no_quota(_tenant: str) -> Quota:
    return Quota()


@dataclass
class SchedulerState:
    """The scheduler's shared state; every part receives this one object."""

    store: JobStore
    pool: GpuPool
    runtime: Runtime
    runs_dir: Path
    wake: Callable[[], None]
    """Run the next tick now."""
    metrics: ServiceMetrics | None = None
    quota_of: Callable[[str], Quota] = _no_quota
    leadership: Leadership | None = None
    """None: this scheduler is the only one (SQLite, or tests); else it works only while leading."""
    paths: JobPathPolicy | None = None
    """The service's path rule: each launched job's ranks open its files under `paths.file_rule` (its
    data roots, and the run directories of its tenant's jobs its spec names). None: the default
    `FileRule`, which confines nothing (a scheduler without a served API, in tests and benchmarks)."""
    tracker: JobTracker | None = None
    """Experiment tracking of the followed jobs' runs (trainctl.service.tracking); None: none."""
    preemption: PreemptionPolicy = field(default_factory=PreemptionPolicy)
    preempting: dict[str, str] = field(default_factory=dict)
    """Jobs being preempted (PREEMPTED, until they are queued again) -> the queued job they make room for."""
    nominated: set[str] = field(default_factory=set)
    """Queued jobs that running jobs were preempted for: admitted before the queue's order once they fit
    (`Admission`), until they start or leave the queue."""
    active: dict[str, ActiveJob] = field(default_factory=dict)
    """The jobs this scheduler follows, by id."""
    unlaunched: set[str] = field(default_factory=set)
    """Jobs admitted or recovered but not handed to the runtime yet (too little lease left)."""
    resolved: dict[str, ResolvedJob] = field(default_factory=dict)
    """The resolved job (grid and model) of each queued or followed job placed so far, by id: built at its
    first placement (`resolved_job`), so an admission retry or re-placement reads no config.json again;
    dropped when the job ends (`finish`) or leaves the queue unplaced (`Admission.admit`)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held by a tick, a re-sync, and a standby's mirroring or standing down."""
    of_map: dict[str, tuple[GpuPool, Any]] = field(default_factory=dict, repr=False)
    """What `domains` and `node_env` read from the pool's map (each a walk over every node), kept with
    the pool it was read from: a pool's map never changes, a replaced pool is read again."""

    def domains(self) -> dict[str, str]:
        """Each node's NVLink domain (`GpuPool.domains`), read once per pool."""
        return self._read_map("domains", self.pool.domains)

    def node_env(self) -> dict[str, dict[str, str]]:
        """Each node's NCCL settings (`GpuPool.nccl_env`), read once per pool."""
        return self._read_map("node_env", self.pool.nccl_env)

    def _read_map(self, what: str, read: Callable[[], Any]) -> Any:
        kept = self.of_map.get(what)
        if kept is None or kept[0] is not self.pool:
            kept = self.of_map[what] = (self.pool, read())
        return kept[1]

    def may_launch(self) -> bool:
        """Whether enough lease is left to hand the runtime a job or a plan (always, without a leadership)."""
        return self.leadership is None or self.leadership.may_launch()

    def down_nodes(self) -> set[str]:
        """Nodes of the pool that Ray does not have alive."""
        return {name for name, _ in self.pool.nodes()} - self.runtime.live_nodes()

    def set_state(self, record: JobRecord, state: JobState, reason: str, **extra: Any) -> JobRecord:
        """Record the job's new state; a job the API moved to CANCELLING (or the scheduler to PREEMPTED)
        meanwhile leaves it only for an end, so a supervisor's late RUNNING or RESTARTING never undoes a
        cancel or a preemption (a preempted job is queued again by `requeue`)."""
        if record.state == state:
            return record
        held = (JobState.CANCELLING, JobState.PREEMPTED)
        expect = None if JobState(state).terminal else [s for s in JobState if not s.terminal and s not in held]
        updated = self.store.update_status(record.id, expect=expect, state=state, reason=reason, **extra)
        if updated is None:
            return self.store.get_job(record.id)
        if self.metrics is not None:
            self.metrics.set_job_state(updated.id, updated.tenant, updated.state)
        return updated

    def resolved_job(self, job_id: str, job: TrainingJob) -> ResolvedJob:
        """The resolved job of `job_id` (whose spec is `job`'s), built once and kept in `resolved`."""
        if job_id not in self.resolved:
            self.resolved[job_id] = ResolvedJob.resolve(job.spec)
        return self.resolved[job_id]

    def layout_on(self, job_id: str, job: TrainingJob, gpus: int) -> ResolvedJob:
        """The resolved job of `job_id` on a plan of `gpus` GPUs: its own layout, or an elastic one of that size
        (`trainctl.spec.validate.layout_on`); ValueError when it has none."""
        resolved = self.resolved_job(job_id, job)
        body = layout_on(job.spec, gpus)
        if body is None:
            raise ValueError(f"job {job_id} has no layout on {gpus} GPUs")
        return resolved.with_spec(body)

    def grid_of(self, record: JobRecord) -> GridOf:
        """The job's rank grid for the tracker, from its resolved job (resolved only when the tracker asks)."""
        return lambda: self.resolved_job(record.id, record.job).grid

    def finish(self, record: JobRecord) -> None:
        """Once the job ended: end its tracked run, free its GPUs, stop following it, and run the next
        tick now."""
        if record.terminal:
            if self.tracker is not None:
                self.tracker.ended(record, self.grid_of(record))
            self.pool.release(record.id)
            self.active.pop(record.id, None)
            self.resolved.pop(record.id, None)
            self.preempting.pop(record.id, None)
            self.wake()

    def requeue(self, record: JobRecord, why: str) -> None:
        """Queue a preempted job again once its supervisor's run ended: it keeps its place in the queue
        (priority, then submission order) and frees its GPUs; its next start resumes from its checkpoint.
        A job cancelled meanwhile is left for the cancel to end."""
        expect = [s for s in ACTIVE_STATES if s != JobState.CANCELLING]
        updated = self.store.update_status(
            record.id, expect=expect, state=JobState.QUEUED, reason=f"queued again after a preemption: {why}",
            placement=[], preemptions=record.preemptions + 1, preempt_time=time.time(),
        )
        if updated is None:
            return
        self.pool.release(record.id)
        self.active.pop(record.id, None)
        self.preempting.pop(record.id, None)
        if self.metrics is not None:
            self.metrics.set_job_state(updated.id, updated.tenant, updated.state)
            self.metrics.set_job_placement(updated.id, updated.tenant, {})
        self.wake()

    def hold(self, job_id: str, placement: PlannedPlacement, **changes: Any) -> None:
        """Reserve `placement`'s GPUs for the job and store it as the job's placement, with `changes`."""
        self.pool.reserve(job_id, placement)
        updated = self.store.update_status(job_id, placement=placement.records(), **changes)
        if updated is not None and self.metrics is not None:
            self.metrics.set_job_placement(updated.id, updated.tenant, self.by_domain(placement))

    def by_domain(self, placement: PlannedPlacement) -> dict[tuple[str, str], int]:
        """Ranks of `placement` per (node, NVLink domain), as the placement gauge counts them."""
        domains = self.domains()
        out: dict[tuple[str, str], int] = {}
        for a in placement.assignments:
            key = (a.node, domains.get(a.node, a.node))
            out[key] = out.get(key, 0) + 1
        return out
