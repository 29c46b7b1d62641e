"""The durable job store: jobs + an append-only event log + step metrics, and sweeps with their trials
(a trial and its job are recorded in one transaction), on SQLite in the data directory (WAL) or on
PostgreSQL named by a URL.

Every write is one transaction committed (SQLite: synchronous=FULL) before the method returns, so a job
the API has acknowledged survives a crash of the service. Reads (jobs, listings, the queue, events, step
metrics) run on read connections of their own (SQLite: one per thread; PostgreSQL: a few, lent per read)
and never wait for a write to commit. Writes serialize, across processes too, so
`events.sequence` is the global, strictly increasing cursor WatchJob resumes from. While a PostgreSQL
database is unreachable every operation raises `StoreUnavailable` promptly, and the store reconnects by
itself when it returns. Leases (`acquire_lease`) elect one replica's scheduler; writes made inside
`fenced(...)` commit only while their lease holds. The schema carries a version; `MIGRATIONS[i]`
upgrades a version-i database to i+1, and opening a store applies whatever is missing. Given the service's
metrics, every public operation is timed under its method's name (`trainctl_store_operation_duration_seconds`,
label `op`: a fixed set, the methods marked `@_timed`), lock waits included. Text a write carries (a
reason, a log line, an event's payload) is stored escaped where a database could not hold it
(`db.bound`, `db.json_text`): the same on either backend, and never a failed write.

`JobStore` is the one object callers hold; its methods hand each call to the part that owns its tables,
all of them sharing one `StoreCore` (the database, its transactions, the record cache):

- `records`: the records, states, event types and errors;  `schema`: the migrations;
- `db`: the SQLite and PostgreSQL databases and the SQL that differs between them;
- `core`: transactions, reads, fencing, commit listeners;  `cache`: the records kept built;
- `jobs`: jobs, labels, ids and request keys;  `events`: events and step metrics;  `queue`: the queue;
- `sweeps`: sweeps and trials;  `leases`: leases.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from trainctl.service.metrics import ServiceMetrics
from trainctl.service.store.core import StoreCore
from trainctl.service.store.db import DB_NAME, SqliteDatabase, StoreError, StoreUnavailable
from trainctl.service.store.events import EventLog
from trainctl.service.store.jobs import Jobs, request_key, total_steps, trial_key
from trainctl.service.store.leases import Leases
from trainctl.service.store.queue import Queue
from trainctl.service.store.records import (
    EVENT_LOG,
    EVENT_STATE,
    EVENT_STEP,
    AdmissionRefused,
    Event,
    Fence,
    JobNotFound,
    JobRecord,
    LeaseLost,
    QueuedJob,
    RequestReused,
    SweepNotFound,
    SweepRecord,
    SweepState,
    TrialRecord,
    TrialState,
)
from trainctl.service.store.schema import MIGRATIONS, SCHEMA_VERSION
from trainctl.service.store.sweeps import Sweeps
from trainctl.spec.job import TrainingJob
from trainctl.spec.sweep import Sweep
from trainctl.workers.events import JobState

__all__ = [
    "DB_NAME", "EVENT_LOG", "EVENT_STATE", "EVENT_STEP", "MIGRATIONS", "SCHEMA_VERSION", "AdmissionRefused", "Event",
    "Fence", "JobNotFound", "JobRecord", "JobStore", "LeaseLost", "QueuedJob", "RequestReused", "StoreError",
    "StoreUnavailable", "SweepNotFound", "SweepRecord", "SweepState", "TrialRecord", "TrialState", "request_key",
    "total_steps", "trial_key",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _timed(method: Callable[Concatenate[JobStore, _P], _R]) -> Callable[Concatenate[JobStore, _P], _R]:
    """Observe a store operation's latency under the method's name, when the store has metrics."""
    op = method.__name__

    @functools.wraps(method)
    def timed(self: JobStore, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if self._metrics is None:
            return method(self, *args, **kwargs)
        with self._metrics.time_store(op):
            return method(self, *args, **kwargs)

    return timed


class JobStore:
    """Thread-safe access to one database; every method is one committed transaction.

    `location` is a data directory (SQLite, `DB_NAME` in it) or a `postgresql://` URL. `metrics` (the
    service's) times each public operation; a store without it works the same, untimed.
    """

    def __init__(self, location: str | Path, *, metrics: ServiceMetrics | None = None):
        self._metrics = metrics
        self._core = StoreCore(location)
        self._events = EventLog(self._core)
        self._jobs = Jobs(self._core, self._events)
        self._queue = Queue(self._core)
        self._sweeps = Sweeps(self._core, self._jobs)
        self._leases = Leases(self._core)

    # ---- the database -------------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """"sqlite" or "postgresql"."""
        return self._core.db.backend

    @property
    def reads_are_local(self) -> bool:
        """Whether a read is a file read in this process (SQLite), quick enough for an event loop; on
        PostgreSQL each read is a round trip to the server."""
        return self._core.db.local_reads

    @property
    def location(self) -> str:
        """The SQLite file, or the PostgreSQL URL without credentials."""
        return self._core.db.location

    @property
    def schema_version(self) -> int:
        with self._core.lock:
            return self._core.db.schema_version()

    @property
    def journal_mode(self) -> str:
        """SQLite's journal mode ("wal"); a PostgreSQL store has none."""
        db = self._core.db
        if not isinstance(db, SqliteDatabase):
            raise StoreError(f"a {db.backend} store has no journal mode")
        with self._core.lock:
            return db.journal_mode

    def reachable(self) -> bool:
        """Whether the database answers now (readiness)."""
        try:
            with self._core.lock:
                self._core.db.execute("SELECT 1 AS one").fetchone()
        except StoreUnavailable:
            return False
        return True

    def fenced(self, fence: Fence | None) -> AbstractContextManager[None]:
        """Within this block, every write this thread makes commits only while `fence`'s lease holds,
        checked inside the write's transaction; otherwise it raises `LeaseLost` (None: unfenced)."""
        return self._core.fenced(fence)

    def on_commit(self, callback: Callable[[], None], job_id: str | None = None) -> Callable[[], None]:
        """Call `callback` (quick, never raising) in the committing thread after each write of this
        process commits (with `job_id`: each write that appended an event of that job), until the
        returned function is called. Another process's commits are not seen: poll for those. Never waits
        for a write in progress."""
        return self._core.on_commit(callback, job_id)

    def close(self) -> None:
        with self._core.lock:
            self._core.db.close()

    # ---- jobs ---------------------------------------------------------------------------------------
    @_timed
    def create_job(
        self, job: TrainingJob, *, tenant: str = "default", request_id: str | None = None, now: float | None = None,
        admit: Callable[[Callable[[], int]], str | None] | None = None, digest: str | None = None,
    ) -> tuple[JobRecord, bool]:
        """Insert `job` as QUEUED with its first event; return (record, created).

        With a request_id the tenant already used, returns that job and created=False (idempotent retry);
        `digest` (of the request) is kept with the job, and a retry whose digest differs raises
        RequestReused. Else `admit(queued)`, called in the same write transaction (so concurrent creates
        cannot all pass it), says why the job must be refused, or None; `queued()` counts the tenant's
        queued jobs. A refusal raises AdmissionRefused."""
        return self._jobs.create_job(job, tenant, request_id, now, admit, digest)

    @_timed
    def job_of_request(self, tenant: str, request_id: str, digest: str | None = None) -> JobRecord | None:
        """The job `tenant` created with `request_id`, if any: what a retried CreateJob answers
        (RequestReused when `digest` differs from its request's)."""
        return self._jobs.job_of_request(tenant, request_id, digest)

    @_timed
    def get_job(self, job_id: str) -> JobRecord:
        """The job `job_id`; JobNotFound when there is none (an id holding NUL too: `db.bound`)."""
        return self._jobs.get_job(job_id)

    @_timed
    def list_jobs(
        self,
        *,
        tenant: str | None = None,
        states: Iterable[JobState] = (),
        labels: dict[str, str] | None = None,
        limit: int | None = None,
        before_seq: int | None = None,
        oldest_first: bool = False,
    ) -> list[JobRecord]:
        """Jobs matching every filter, newest first (or oldest first), `seq < before_seq` when given."""
        return self._jobs.list_jobs(tenant, list(states), labels or {}, limit, before_seq, oldest_first)

    @_timed
    def update_status(
        self, job_id: str, *, expect: Iterable[JobState] | None = None, now: float | None = None, **changes: Any
    ) -> JobRecord | None:
        """Set status columns; a changed `state` also appends a state event with `reason`.

        With `expect`, changes only a job whose current state is one of them (compare-and-set) and
        returns None otherwise. Terminal states are final: a later state change is ignored."""
        return self._jobs.update_status(job_id, expect, now, changes)

    # ---- events and metrics -------------------------------------------------------------------------
    @_timed
    def append_event(
        self, job_id: str, type_: str, payload: dict[str, Any], *, now: float | None = None, runtime_cursor: int | None = None
    ) -> int:
        """Append one event; return its sequence. With `runtime_cursor` (the supervisor's sequence of the
        event this records), the job's `runtime_cursor` moves to it in the same transaction, so a service
        that takes over never records the event again."""
        return self._events.append_event(job_id, type_, payload, now, runtime_cursor)

    @_timed
    def record_step(
        self, job_id: str, metrics: dict[str, Any], *, now: float | None = None, runtime_cursor: int | None = None
    ) -> int:
        """Store a step's metrics (a re-run step after a restart replaces the old row), append a step
        event and update the job's progress columns (and `runtime_cursor`, as `append_event`); return the
        event's sequence."""
        return self._events.record_step(job_id, metrics, now, runtime_cursor)

    @_timed
    def step_metrics(self, job_id: str, *, after_step: int = 0) -> list[dict[str, Any]]:
        """Every recorded step of a job (those after `after_step`), in step order."""
        return self._events.step_metrics(job_id, after_step)

    @_timed
    def thinned_step_metrics(self, job_id: str, limit: int) -> list[dict[str, Any]]:
        """At most `limit` (>= 4) of a job's steps, in step order, evenly spread over the run with its eval
        steps kept beside the training curve (what GetJob(JOB_VIEW_FULL) answers); read by index lookups,
        so a million-step job costs what a `limit`-step one does."""
        return self._events.thinned_step_metrics(job_id, limit)

    @_timed
    def events(self, job_id: str, after_sequence: int = 0, limit: int = 1000) -> list[Event]:
        """A job's events with sequence > after_sequence, oldest first."""
        return self._events.events(job_id, after_sequence, limit)

    # ---- the queue ----------------------------------------------------------------------------------
    @_timed
    def count_by_state(self, tenant: str | None = None) -> dict[str, int]:
        """How many jobs are in each state (of one tenant, or of all)."""
        return self._queue.count_by_state(tenant)

    @_timed
    def queue(self, *, after: QueuedJob | None = None, limit: int = 100) -> list[QueuedJob]:
        """QUEUED jobs in admission order (priority descending, then submission order), the first `limit`
        after `after`, with their specs."""
        return self._queue.queue(after, limit)

    @_timed
    def set_queue_reason(self, reason: str, *, behind: QueuedJob | None) -> int:
        """Set `reason` on every QUEUED job after `behind` in admission order (on all of them when None),
        in one write; returns how many changed."""
        return self._queue.set_queue_reason(reason, behind)

    # ---- sweeps -------------------------------------------------------------------------------------
    @_timed
    def create_sweep(
        self, sweep: Sweep, *, tenant: str = "default", request_id: str | None = None, now: float | None = None,
        digest: str | None = None,
    ) -> tuple[SweepRecord, bool]:
        """Insert `sweep` as RUNNING; return (record, created). A request_id the tenant already used
        returns that sweep and created=False (RequestReused when `digest`, of the request, differs)."""
        return self._sweeps.create_sweep(sweep, tenant, request_id, now, digest)

    @_timed
    def get_sweep(self, sweep_id: str) -> SweepRecord:
        """The sweep `sweep_id`; SweepNotFound when there is none (an id holding NUL, as for jobs)."""
        return self._sweeps.get_sweep(sweep_id)

    @_timed
    def sweep_of_request(self, tenant: str, request_id: str, digest: str | None = None) -> SweepRecord | None:
        """The sweep `tenant` created with `request_id`, if any: what a retried CreateSweep answers
        (RequestReused when `digest` differs from its request's)."""
        sweep_id = self._sweeps.sweep_of_request(tenant, request_id, digest)
        return None if sweep_id is None else self.get_sweep(sweep_id)

    @_timed
    def list_sweeps(
        self, *, tenant: str | None = None, states: Iterable[SweepState] = (), limit: int | None = None,
        before_seq: int | None = None,
    ) -> list[SweepRecord]:
        """Sweeps matching the filters, newest first, `seq < before_seq` when given."""
        return self._sweeps.list_sweeps(tenant, list(states), limit, before_seq)

    @_timed
    def create_trial(
        self, sweep_id: str, number: int, params: dict[str, Any], job: TrainingJob | None, *,
        reason: str = "", now: float | None = None,
    ) -> TrialRecord | None:
        """Record trial `number` with its parameters and, in the same transaction, its job (QUEUED, in
        the sweep's tenant); without a job the trial is FAILED with `reason` (its parameters made no valid
        job). Compare-and-set: only while the sweep is RUNNING and `number` is its next trial, else None,
        so no trial is ever recorded twice."""
        return self._sweeps.create_trial(sweep_id, number, params, job, reason, now)

    @_timed
    def finish_trial(
        self, sweep_id: str, number: int, state: TrialState, *, reason: str, objective: float | None = None,
        objective_step: int | None = None, now: float | None = None,
    ) -> TrialRecord | None:
        """Settle a RUNNING trial (compare-and-set: None when it is settled already)."""
        return self._sweeps.finish_trial(sweep_id, number, state, reason, objective, objective_step, now)

    @_timed
    def finish_sweep(
        self, sweep_id: str, state: SweepState, reason: str, *, now: float | None = None
    ) -> SweepRecord | None:
        """End a RUNNING sweep (compare-and-set: None when it has ended already). CANCELLED also settles
        its RUNNING trials as CANCELLED, in the same transaction; their jobs are the caller's to cancel."""
        return self._sweeps.finish_sweep(sweep_id, state, reason, now)

    # ---- leases -------------------------------------------------------------------------------------
    @_timed
    def acquire_lease(self, name: str, holder: str, ttl: float) -> Fence | None:
        """Take or renew lease `name` for `ttl` seconds of the database's clock; None while another holder's
        lease is unexpired. The epoch grows whenever the lease changes hands or had lapsed."""
        return self._leases.acquire_lease(name, holder, ttl)

    @_timed
    def release_lease(self, fence: Fence) -> None:
        """Give the lease up at once (a standby may take it on its next try), if `fence` still holds it."""
        self._leases.release_lease(fence)
