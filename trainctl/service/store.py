"""The durable job store: jobs + an append-only event log + step metrics, and sweeps with their trials
(a trial and its job are recorded in one transaction), on SQLite in the data directory (WAL) or on
PostgreSQL named by a URL (trainctl.service.store_db holds the two and the SQL that differs).

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
(`store_db.bound`, `store_db.json_text`): the same on either backend, and never a failed write.
"""

from __future__ import annotations

import functools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from trainctl.service.metrics import ServiceMetrics
from trainctl.service.newest_kept import NewestKept
from trainctl.service.store_db import DB_NAME as DB_NAME  # re-exported, as the store's errors are
from trainctl.service.store_db import NOW_SQL, Database, SqliteDatabase, json_text, open_database, run_script
from trainctl.service.store_db import StoreError as StoreError
from trainctl.service.store_db import StoreUnavailable as StoreUnavailable
from trainctl.spec.job import TrainingJob
from trainctl.spec.sweep import Sweep
from trainctl.workers.events import JobState

EVENT_STATE, EVENT_STEP, EVENT_LOG = "state", "step", "log"

MIGRATIONS: tuple[str, ...] = (
    # 0 -> 1: the initial schema.
    """
    CREATE TABLE jobs (
        id TEXT PRIMARY KEY,
        seq $int NOT NULL UNIQUE,
        request_id TEXT UNIQUE,
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        spec TEXT NOT NULL,
        priority $int NOT NULL,
        state TEXT NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        create_time $real NOT NULL,
        schedule_time $real,
        start_time $real,
        end_time $real,
        update_time $real NOT NULL,
        steps_done $int NOT NULL DEFAULT 0,
        total_steps $int NOT NULL,
        first_loss $real,
        last_loss $real,
        restarts $int NOT NULL DEFAULT 0,
        tokens_per_second $real NOT NULL DEFAULT 0,
        mfu $real,
        placement TEXT NOT NULL DEFAULT '[]',
        run_dir TEXT NOT NULL DEFAULT '',
        runtime_cursor TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX jobs_state ON jobs(state);
    CREATE INDEX jobs_tenant ON jobs(tenant, seq);
    CREATE TABLE job_labels (
        job_id TEXT NOT NULL REFERENCES jobs(id),
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        PRIMARY KEY (job_id, key)
    );
    CREATE INDEX job_labels_kv ON job_labels(key, value);
    CREATE TABLE events (
        sequence $serial,
        job_id TEXT NOT NULL REFERENCES jobs(id),
        time $real NOT NULL,
        type TEXT NOT NULL,
        payload TEXT NOT NULL
    );
    CREATE INDEX events_job ON events(job_id, sequence);
    CREATE TABLE step_metrics (
        job_id TEXT NOT NULL REFERENCES jobs(id),
        step $int NOT NULL,
        time $real NOT NULL,
        loss $real NOT NULL,
        grad_norm $real NOT NULL DEFAULT 0,
        lr $real NOT NULL DEFAULT 0,
        tokens $int NOT NULL DEFAULT 0,
        tokens_per_second $real NOT NULL DEFAULT 0,
        mfu $real,
        step_time_seconds $real NOT NULL DEFAULT 0,
        peak_memory_bytes $int NOT NULL DEFAULT 0,
        breakdown TEXT NOT NULL DEFAULT '{}',
        PRIMARY KEY (job_id, step)
    );
    """,
    # 1 -> 2: sweeps and their trials (docs/sweeps.md).
    """
    CREATE TABLE sweeps (
        id TEXT PRIMARY KEY,
        seq $int NOT NULL UNIQUE,
        request_id TEXT UNIQUE,
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        spec TEXT NOT NULL,
        state TEXT NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        create_time $real NOT NULL,
        update_time $real NOT NULL,
        end_time $real
    );
    CREATE INDEX sweeps_state ON sweeps(state);
    CREATE INDEX sweeps_tenant ON sweeps(tenant, seq);
    CREATE TABLE sweep_trials (
        sweep_id TEXT NOT NULL REFERENCES sweeps(id),
        number $int NOT NULL,
        job_id TEXT UNIQUE REFERENCES jobs(id),
        params TEXT NOT NULL,
        state TEXT NOT NULL,
        objective $real,
        objective_step $int,
        reason TEXT NOT NULL DEFAULT '',
        create_time $real NOT NULL,
        end_time $real,
        PRIMARY KEY (sweep_id, number)
    );
    """,
    # 2 -> 3: leases (leadership among service replicas, trainctl.service.leadership).
    """
    CREATE TABLE leases (
        name TEXT PRIMARY KEY,
        holder TEXT NOT NULL,
        epoch $int NOT NULL,
        expires $real NOT NULL
    );
    """,
    # 3 -> 4: indexes that keep reads off a scan of every job at 10,000 jobs (docs/benchmarks.md, store
    # scale): a listing filtered by state reads its page in order, the admission pass reads the queue a
    # page at a time in its order, a tenant's usage counts its own jobs by state.
    """
    CREATE INDEX jobs_state_seq ON jobs(state, seq);
    CREATE INDEX jobs_queue ON jobs(state, priority DESC, seq);
    CREATE INDEX jobs_tenant_state ON jobs(tenant, state);
    """,
    # 4 -> 5: a job row's change count, which every write of the row adds one to: a reader that keeps
    # records built (JobStore._records) reads a listing's ids and versions and builds only what changed.
    """
    ALTER TABLE jobs ADD COLUMN version $int NOT NULL DEFAULT 0;
    """,
    # 5 -> 6: a label filter looks up each walked job's label by the primary key (job_id, key); with the
    # (key, value) index there as well, PostgreSQL without fresh statistics (a young or fast-growing
    # table) chose it for every walked job, reading every job's label each time (a filtered page of
    # 51 among 3,000 jobs: 97 ms instead of 2 ms). Nothing else reads labels by value.
    """
    DROP INDEX job_labels_kv;
    """,
    # 6 -> 7: a trial's job had the idempotency key `sweep/<sweep id>/<number>`, which a tenant named
    # `sweep` could produce with CreateJob (`<tenant>/<request id>`): it got the trial's job back, or took
    # the key first and made the trial's creation fail for good. Trial keys now start with '/' (see
    # `trial_key`), which no tenant's key does (a tenant name is never empty).
    """
    UPDATE jobs SET request_id = '/' || request_id WHERE EXISTS (
        SELECT 1 FROM sweep_trials WHERE sweep_trials.job_id = jobs.id
        AND jobs.request_id = 'sweep/' || sweep_trials.sweep_id || '/' || sweep_trials.number
    );
    """,
    # 7 -> 8: the digest of the request a request id first created a job or sweep with, so that the id
    # sent again with a different request is refused (`RequestReused`) instead of answered the first
    # one as a retry. NULL for rows created before it, whose retries are not compared.
    """
    ALTER TABLE jobs ADD COLUMN request_digest TEXT;
    ALTER TABLE sweeps ADD COLUMN request_digest TEXT;
    """,
    # 8 -> 9: a step's metrics other than its loss may be absent (NULL): a command job's program reports
    # what it chooses (`trainctl.report`), and a metric it never passes is no value, not 0. SQLite cannot
    # drop NOT NULL from a column, so the table is rebuilt (nothing references it); rows keep their values.
    """
    CREATE TABLE step_metrics_nullable (
        job_id TEXT NOT NULL REFERENCES jobs(id),
        step $int NOT NULL,
        time $real NOT NULL,
        loss $real NOT NULL,
        grad_norm $real,
        lr $real,
        tokens $int,
        tokens_per_second $real,
        mfu $real,
        step_time_seconds $real,
        peak_memory_bytes $int,
        breakdown TEXT NOT NULL DEFAULT '{}',
        PRIMARY KEY (job_id, step)
    );
    INSERT INTO step_metrics_nullable SELECT job_id, step, time, loss, grad_norm, lr, tokens, tokens_per_second,
        mfu, step_time_seconds, peak_memory_bytes, breakdown FROM step_metrics;
    DROP TABLE step_metrics;
    ALTER TABLE step_metrics_nullable RENAME TO step_metrics;
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)


def request_key(tenant: str, request_id: str) -> str:
    """The idempotency key of a tenant's request id (CreateJob, CreateSweep): unique across tenants, as a
    tenant name is never empty and holds no '/'."""
    return f"{tenant}/{request_id}"


def trial_key(sweep_id: str, number: int) -> str:
    """The idempotency key of a sweep trial's job: it starts with '/', so no `request_key` equals it."""
    return f"/sweep/{sweep_id}/{number}"


@dataclass(frozen=True)
class Fence:
    """Proof of leadership for writes (`JobStore.fenced`): they commit only while `holder` holds lease
    `name` at `epoch`, unexpired by the database's clock."""

    name: str
    holder: str
    epoch: int


class LeaseLost(StoreError):
    """A fenced write found its lease lapsed or held by another replica; nothing was written."""


class JobNotFound(KeyError):
    """No job with that id."""


class RequestReused(Exception):
    """A request id came again with a request other than the one that first used it; the argument is
    the id of the job or sweep the first request created. Nothing was written."""


class AdmissionRefused(Exception):
    """`create_job`'s admission check refused the job; the message says why. Nothing was written."""


class SweepNotFound(KeyError):
    """No sweep with that id."""


class SweepState(StrEnum):
    """A sweep's life: RUNNING until its last trial is settled (SUCCEEDED when one completed, FAILED when
    none did), or CANCELLED by request."""

    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self is not SweepState.RUNNING


class TrialState(StrEnum):
    """A trial's outcome: RUNNING while its job may still report; COMPLETE with an objective; PRUNED by
    early stopping; FAILED (its job failed, or reported no objective); CANCELLED with its sweep."""

    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    PRUNED = "PRUNED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


@dataclass
class TrialRecord:
    """One row of `sweep_trials`: trial `number` of a sweep, its parameters (path -> value) and outcome."""

    sweep_id: str
    number: int
    job_id: str | None
    params: dict[str, Any]
    state: TrialState
    objective: float | None
    objective_step: int | None
    reason: str
    create_time: float
    end_time: float | None


@dataclass
class SweepRecord:
    """One row of `sweeps`, with its spec parsed and its trials in number order."""

    id: str
    seq: int
    tenant: str
    name: str
    sweep: Sweep
    state: SweepState
    reason: str
    create_time: float
    update_time: float
    end_time: float | None
    trials: list[TrialRecord] = field(default_factory=list)


@dataclass(frozen=True)
class QueuedJob:
    """A QUEUED job as the admission pass walks the queue: its place in it, its tenant and spec, and why it
    waits (the rest of its record is read only for a job that starts)."""

    id: str
    seq: int
    priority: int
    tenant: str
    reason: str
    job: TrainingJob


@dataclass
class JobRecord:
    """One row of `jobs`, with its spec parsed and labels attached."""

    id: str
    seq: int
    tenant: str
    name: str
    job: TrainingJob
    priority: int
    state: JobState
    reason: str
    create_time: float
    update_time: float
    total_steps: int
    schedule_time: float | None = None
    start_time: float | None = None
    end_time: float | None = None
    steps_done: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    restarts: int = 0
    tokens_per_second: float = 0.0
    mfu: float | None = None
    placement: list[dict[str, Any]] = field(default_factory=list)
    run_dir: str = ""
    runtime_cursor: str = ""
    version: int = 0
    """How many times the row was written since CreateJob (every write adds one)."""
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.state.terminal


@dataclass(frozen=True)
class Event:
    """One entry of the append-only event log."""

    sequence: int
    job_id: str
    time: float
    type: str
    payload: dict[str, Any]


_STATUS_COLUMNS = frozenset({
    "state", "reason", "schedule_time", "start_time", "end_time", "steps_done", "first_loss", "last_loss",
    "restarts", "tokens_per_second", "mfu", "placement", "run_dir", "runtime_cursor",
})
_METRIC_COLUMNS = (
    "loss", "grad_norm", "lr", "tokens", "tokens_per_second", "mfu", "step_time_seconds", "peak_memory_bytes",
)


RECORDS_KEPT = 10_000
"""Records, and parsed specs, a store keeps: every job of a 10,000-job store stays built, and a store of
any size holds at most about 110 MiB of them (a small job's parsed spec is about 10 KiB, its record 1)."""


def _in_chunks(ids: list[str]) -> Iterator[tuple[list[str], str]]:
    """`ids` in chunks that fit SQLite's bound-parameter limit, each with its `?, ?, ...` placeholders."""
    for start in range(0, len(ids), 500):
        chunk = ids[start:start + 500]
        yield chunk, ",".join("?" * len(chunk))


_RECORD_FIELDS = frozenset(f.name for f in fields(JobRecord) if f.name not in ("job", "labels"))
_RECORD_COLUMNS = ", ".join(sorted(_RECORD_FIELDS))
"""The `jobs` columns a JobRecord holds: all but the spec text (parsed once per job while kept,
`JobStore._specs_of`) and the request id."""


def _record(row: dict[str, Any], spec: TrainingJob, labels: dict[str, str]) -> JobRecord:
    """The record of a `jobs` row (its `_RECORD_COLUMNS`), its parsed spec and its labels."""
    return JobRecord(
        job=spec, labels=labels,
        **{**row, "placement": json.loads(row["placement"]) if row["placement"] != "[]" else [],
           "state": JobState(row["state"])},
    )


ID_ATTEMPTS = 8
"""Fresh ids an insert tries before it fails. A job's or sweep's id is its name, '-' and 8 random hex
digits (32 bits; at most 72 characters, short enough for run directories and Ray actor names): among
100,000 jobs of one name a new one's first id is taken with a chance of 2e-5, eight in a row never are."""


def _retried(row: dict[str, Any], digest: str | None) -> str:
    """The id of the job or sweep a request id created (`row`: its id and request_digest), for a retry
    whose request has `digest`; RequestReused when both digests are known and differ."""
    if digest is not None and row["request_digest"] is not None and row["request_digest"] != digest:
        raise RequestReused(row["id"])
    return row["id"]


def _inserted(name: str, insert: Callable[[str], dict[str, Any] | None]) -> dict[str, Any]:
    """The row `insert(id)` returned for the first fresh id of `name` not taken yet: `insert` inserts
    `ON CONFLICT (id) DO NOTHING` and returns None when the id is another's. Any other conflict (a
    request id) raises as before."""
    for _ in range(ID_ATTEMPTS):
        row = insert(f"{name}-{uuid.uuid4().hex[:8]}")
        if row is not None:
            return row
    raise StoreError(f"{ID_ATTEMPTS} fresh ids for {name!r} were all taken")


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
        self._lock = threading.RLock()
        self._commit_listeners: dict[str | None, set[Callable[[], None]]] = {}
        """Job id (None: any commit) -> what to call after a commit that appended that job's events."""
        self._listeners_lock = threading.Lock()
        """Guards `_commit_listeners` (not `_lock`, which a write holds until it commits)."""
        self._appended: set[str] = set()
        """Jobs whose events the open write transaction appended (under the lock)."""
        self._written: list[JobRecord] = []
        """Records of the rows the open write transaction wrote, kept once it commits (under the lock)."""
        self._specs: NewestKept[TrainingJob] = NewestKept(RECORDS_KEPT)
        """Job id -> its parsed spec, for the most recently parsed (see `_specs_of`)."""
        self._records: NewestKept[JobRecord] = NewestKept(RECORDS_KEPT)
        """Job id -> its record, for the most recently built: a job whose row has not changed since (the
        same version) is answered with the same record (see `_kept`)."""
        self._fencing = threading.local()  # .fence: the Fence this thread's writes carry (see fenced)
        self._db: Database = open_database(location)
        try:
            self._migrate()
        except BaseException:
            self._db.close()
            raise

    # ---- schema -------------------------------------------------------------------------------------
    def _migrate(self) -> None:
        with self._tx() as db:
            version = db.schema_version()
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{db.location} has schema version {version}; this trainctl knows up to {SCHEMA_VERSION}"
                )
            for target in range(version, SCHEMA_VERSION):
                run_script(db, MIGRATIONS[target])
                db.set_schema_version(target + 1)

    @property
    def backend(self) -> str:
        """"sqlite" or "postgresql"."""
        return self._db.backend

    @property
    def reads_are_local(self) -> bool:
        """Whether a read is a file read in this process (SQLite), quick enough for an event loop; on
        PostgreSQL each read is a round trip to the server."""
        return self._db.local_reads

    @property
    def location(self) -> str:
        """The SQLite file, or the PostgreSQL URL without credentials."""
        return self._db.location

    @property
    def schema_version(self) -> int:
        with self._lock:
            return self._db.schema_version()

    @property
    def journal_mode(self) -> str:
        """SQLite's journal mode ("wal"); a PostgreSQL store has none."""
        if not isinstance(self._db, SqliteDatabase):
            raise StoreError(f"a {self._db.backend} store has no journal mode")
        with self._lock:
            return self._db.journal_mode

    @contextmanager
    def fenced(self, fence: Fence | None) -> Iterator[None]:
        """Within this block, every write this thread makes commits only while `fence`'s lease holds,
        checked inside the write's transaction; otherwise it raises `LeaseLost` (None: unfenced)."""
        before = getattr(self._fencing, "fence", None)
        self._fencing.fence = fence
        try:
            yield
        finally:
            self._fencing.fence = before

    @contextmanager
    def _tx(self) -> Iterator[Database]:
        with self._lock:
            self._db.begin_write()
            try:
                fence = getattr(self._fencing, "fence", None)
                if fence is not None and not self._holds(self._db, fence):
                    raise LeaseLost(f"lease {fence.name} (epoch {fence.epoch}) is no longer held by {fence.holder}")
                yield self._db
            except BaseException:
                self._appended.clear()
                self._written.clear()
                self._db.rollback()
                raise
            written, self._written = self._written, []
            try:
                self._db.commit()
            except BaseException:
                self._appended.clear()
                raise
            for record in written:  # only now: a record of a change that did not commit must never be kept
                self._records.add(record.id, record)
            self._notify()

    def _notify(self) -> None:
        """Call the listeners of the transaction just committed (under the lock)."""
        appended, self._appended = self._appended, set()
        for key in (None, *appended):
            with self._listeners_lock:
                listeners = list(self._commit_listeners.get(key, ()))
            for listener in listeners:
                listener()

    @contextmanager
    def _reading(self, *, snapshot: bool = False) -> Iterator[Database]:
        """A read connection for the block (`Database.reading`: a read never waits for a write to
        commit). With `snapshot`, every read of the block sees the same commit (one read-only
        transaction)."""
        with self._db.reading() as db:
            if not snapshot:
                yield db
                return
            db.begin_read()
            try:
                yield db
            except BaseException:
                db.rollback()
                raise
            db.commit()

    def close(self) -> None:
        with self._lock:
            self._db.close()

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
        now = time.time() if now is None else now
        key = request_key(tenant, request_id) if request_id else None
        with self._tx() as db:
            if key:
                row = db.execute("SELECT id, request_digest FROM jobs WHERE request_id = ?", (key,)).fetchone()
                if row is not None:
                    return self._get(_retried(row, digest)), False
            if admit is not None and (refusal := admit(lambda: self._queued_count(db, tenant))) is not None:
                raise AdmissionRefused(refusal)
            return self._insert_job(db, job, tenant, key, now, digest), True

    @_timed
    def job_of_request(self, tenant: str, request_id: str, digest: str | None = None) -> JobRecord | None:
        """The job `tenant` created with `request_id`, if any: what a retried CreateJob answers
        (RequestReused when `digest` differs from its request's)."""
        with self._reading() as db:
            row = db.execute(
                f"SELECT {_RECORD_COLUMNS}, request_digest FROM jobs WHERE request_id = ?", (request_key(tenant, request_id),)
            ).fetchone()
            if row is None:
                return None
            _retried(row, digest)
            return self._records_of(db, [row])()[0]

    @staticmethod
    def _queued_count(db: Database, tenant: str) -> int:
        row = db.execute("SELECT COUNT(*) AS n FROM jobs WHERE tenant = ? AND state = ?", (tenant, JobState.QUEUED)).fetchone()
        return int(row["n"])

    def _insert_job(
        self, db: Database, job: TrainingJob, tenant: str, key: str | None, now: float, digest: str | None = None,
    ) -> JobRecord:
        """The job inserted, with its labels and first event; its record (kept once the write commits)."""
        spec = job.model_dump_json()
        row = _inserted(job.metadata.name, lambda job_id: db.execute(
            "INSERT INTO jobs (id, seq, request_id, request_digest, tenant, name, spec, priority, state, reason,"
            " create_time, update_time, total_steps)"
            " VALUES (?, (SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs), ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            f" ON CONFLICT (id) DO NOTHING RETURNING {_RECORD_COLUMNS}",
            (
                job_id, key, digest, tenant, job.metadata.name, spec,
                job.spec.scheduling.priority, JobState.QUEUED, "accepted", now, now, total_steps(job),
            ),
        ).fetchone())
        job_id = row["id"]
        labels = job.metadata.labels
        if labels:  # one statement: on PostgreSQL each is a round trip made holding the write lock
            db.execute(
                "INSERT INTO job_labels (job_id, key, value) VALUES " + ", ".join(["(?, ?, ?)"] * len(labels)),
                [part for key_, value in labels.items() for part in (job_id, key_, value)],
            )
        self._append(db, job_id, EVENT_STATE, {"from": "", "to": JobState.QUEUED, "reason": "accepted"}, now)
        # the spec as read back (a copy the caller cannot change), parsed once here rather than at the first read
        return self._wrote(row, self._specs.add(job_id, TrainingJob.model_validate_json(spec)), dict(labels))

    @_timed
    def get_job(self, job_id: str) -> JobRecord:
        """The job `job_id`; JobNotFound when there is none (an id holding NUL too: `store_db.bound`)."""
        with self._reading() as db:
            return self._get(job_id, db)

    def _get(self, job_id: str, db: Database | None = None) -> JobRecord:
        db = db or self._db
        row = db.execute(f"SELECT {_RECORD_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        return self._records_of(db, [row])()[0]

    def _records_of(self, db: Database, heads: list[dict[str, Any]]) -> Callable[[], list[JobRecord]]:
        """Jobs, given as rows of at least their id and version, as records: the kept record where its
        version is the row's, else a new one. Reads what the new ones need (their rows, unless a head is
        the whole row already; labels; spec texts) on `db` now: in the snapshot `heads` were read in,
        where the caller took one (a listing's filter must hold for what it returns), else as of now. The
        call it returns builds them, parsing the specs, and is made after any lock held to read is let go
        (see `_specs_of`)."""
        kept = [self._kept(head["id"], head["version"]) for head in heads]
        new = [head["id"] for head, record in zip(heads, kept, strict=True) if record is None]
        rows = {head["id"]: head for head in heads if head.keys() >= _RECORD_FIELDS}
        labels: dict[str, dict[str, str]] = {}
        for chunk, marks in _in_chunks([job_id for job_id in new if job_id not in rows]):
            for row in db.execute(f"SELECT {_RECORD_COLUMNS} FROM jobs WHERE id IN ({marks})", chunk).fetchall():
                rows[row["id"]] = row
        for chunk, marks in _in_chunks(new):
            for label in db.execute(f"SELECT job_id, key, value FROM job_labels WHERE job_id IN ({marks})", chunk).fetchall():
                labels.setdefault(label["job_id"], {})[label["key"]] = label["value"]
        specs_of = self._specs_of(db, new)

        def build() -> list[JobRecord]:
            specs = specs_of()
            return [
                record or self._keep(rows[head["id"]], specs[head["id"]], labels.get(head["id"], {}))
                for head, record in zip(heads, kept, strict=True)
            ]

        return build

    def _kept(self, job_id: str, version: int) -> JobRecord | None:
        """The record kept for `job_id` if it is of that version of the job's row. Labels and specs never
        change after CreateJob and records are frozen, so the same version means an equal record."""
        record = self._records.get(job_id)
        return record if record is not None and record.version == version else None

    def _keep(self, row: dict[str, Any], spec: TrainingJob, labels: dict[str, str]) -> JobRecord:
        """A new record of committed `row`, kept in place of any older one. Called from any thread: a lost
        race only builds a record twice."""
        record = _record(row, spec, labels)
        return self._records.add(record.id, record)

    def _wrote(self, row: dict[str, Any], spec: TrainingJob, labels: dict[str, str]) -> JobRecord:
        """The record of `row` as the open write transaction wrote it (RETURNING), kept once it commits."""
        record = _record(row, spec, labels)
        self._written.append(record)
        return record

    def _specs_of(self, db: Database, job_ids: list[str]) -> Callable[[], dict[str, TrainingJob]]:
        """The parsed specs of `job_ids`. Reads the texts of those not kept parsed on `db` now; the call it
        returns parses them (specs never change, so each is parsed once while kept) and is made after any
        lock held to read is let go, so a first listing of many jobs does not hold up the writers."""
        specs = {job_id: spec for job_id in job_ids if (spec := self._specs.get(job_id)) is not None}
        texts = {}
        for chunk, marks in _in_chunks([job_id for job_id in job_ids if job_id not in specs]):
            texts.update((row["id"], row["spec"]) for row in db.execute(f"SELECT id, spec FROM jobs WHERE id IN ({marks})", chunk).fetchall())

        def parse() -> dict[str, TrainingJob]:
            for job_id, text in texts.items():
                specs[job_id] = self._specs.add(job_id, TrainingJob.model_validate_json(text))
            return specs

        return parse

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
        where, args = [], []
        states = list(states)
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})")
            args.extend(states)
        for key, value in (labels or {}).items():
            # a lookup per job walked in seq order: the page ends after `limit` matches, whereas
            # `id IN (...)` would first collect every job carrying the label
            where.append("EXISTS (SELECT 1 FROM job_labels WHERE job_id = jobs.id AND key = ? AND value = ?)")
            args.extend((key, value))
        if before_seq is not None:
            where.append("seq > ?" if oldest_first else "seq < ?")
            args.append(before_seq)
        sql = "SELECT id, version, seq FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        if limit is not None:  # a page: walk the seq order, stopping after `limit` matches
            sql += " ORDER BY seq " + ("ASC" if oldest_first else "DESC") + " LIMIT ?"
            args.append(limit)
        records = self._listed(sql, args, sort=limit is None, oldest_first=oldest_first, snapshot=False)
        if records is None:  # a job changed between the two reads: both again, as of one commit
            records = self._listed(sql, args, sort=limit is None, oldest_first=oldest_first, snapshot=True)
        assert records is not None  # within one snapshot no row changes
        return records

    def _listed(self, sql: str, args: list[Any], *, sort: bool, oldest_first: bool, snapshot: bool) -> list[JobRecord] | None:
        """The records of the jobs `sql` selects (their ids, versions and seqs), each as it was when the
        filters matched it; None when a job's row changed between the query and the read of its row
        (every write moves the version on), which cannot happen in a `snapshot`. Without one a listing
        whose jobs are all kept is a single statement (on PostgreSQL, one round trip instead of three)."""
        with self._reading(snapshot=snapshot) as db:
            heads = db.execute(sql, args).fetchall()
            if sort:  # everything that matches: sorted here, so the planner may take the most
                # selective index (a tenant's active jobs: (tenant, state)) instead of the seq order
                heads.sort(key=lambda head: head["seq"], reverse=not oldest_first)
            build = self._records_of(db, heads)
        records = build()
        if any(record.version != head["version"] for record, head in zip(records, heads, strict=True)):
            return None
        return records

    @_timed
    def update_status(
        self, job_id: str, *, expect: Iterable[JobState] | None = None, now: float | None = None, **changes: Any
    ) -> JobRecord | None:
        """Set status columns; a changed `state` also appends a state event with `reason`.

        With `expect`, changes only a job whose current state is one of them (compare-and-set) and
        returns None otherwise. Terminal states are final: a later state change is ignored."""
        unknown = set(changes) - _STATUS_COLUMNS
        if unknown:
            raise ValueError(f"not status columns: {sorted(unknown)}")
        now = time.time() if now is None else now
        with self._tx() as db:
            current = self._get(job_id)
            if expect is not None and current.state not in set(expect):
                return None
            new_state = changes.get("state", current.state)
            if new_state != current.state:
                if current.terminal:
                    return None
                self._append(
                    db, job_id, EVENT_STATE,
                    {"from": current.state, "to": new_state, "reason": changes.get("reason", "")}, now,
                )
                if JobState(new_state).terminal and "end_time" not in changes:
                    changes["end_time"] = now
            if "placement" in changes:
                changes["placement"] = json_text(changes["placement"])
            changes["update_time"] = now
            sets = ", ".join(f"{k} = ?" for k in changes)
            row = db.execute(
                f"UPDATE jobs SET {sets}, version = version + 1 WHERE id = ? RETURNING {_RECORD_COLUMNS}",
                (*changes.values(), job_id),
            ).fetchone()
            return self._wrote(row, current.job, current.labels)  # the spec and labels never change

    # ---- events and metrics -------------------------------------------------------------------------
    @_timed
    def append_event(self, job_id: str, type_: str, payload: dict[str, Any], *, now: float | None = None) -> int:
        """Append one event; return its sequence."""
        with self._tx() as db:
            return self._append(db, job_id, type_, payload, time.time() if now is None else now)

    @_timed
    def record_step(self, job_id: str, metrics: dict[str, Any], *, now: float | None = None) -> int:
        """Store a step's metrics (a re-run step after a restart replaces the old row), append a step
        event and update the job's progress columns; return the event's sequence."""
        now = time.time() if now is None else now
        step = int(metrics["step"])
        with self._tx() as db:
            current = self._get(job_id)
            values = [metrics.get(c) for c in _METRIC_COLUMNS]
            db.execute(
                "INSERT INTO step_metrics (job_id, step, time, breakdown, " + ", ".join(_METRIC_COLUMNS)
                + ") VALUES (?, ?, ?, ?, " + ", ".join("?" * len(_METRIC_COLUMNS)) + ")"
                " ON CONFLICT (job_id, step) DO UPDATE SET "
                + ", ".join(f"{c} = excluded.{c}" for c in ("time", "breakdown", *_METRIC_COLUMNS)),
                (job_id, step, metrics.get("time", now), json_text(metrics.get("breakdown") or {}), *values),
            )
            first = current.first_loss if current.first_loss is not None else metrics["loss"]
            # The job's tokens/s is the newest step's that has one (a command job's first report has none).
            db.execute(
                "UPDATE jobs SET steps_done = CASE WHEN steps_done > ? THEN steps_done ELSE ? END, first_loss = ?,"
                " last_loss = ?, tokens_per_second = COALESCE(?, tokens_per_second), mfu = ?, update_time = ?,"
                " version = version + 1 WHERE id = ?",
                (step, step, first, metrics["loss"], metrics.get("tokens_per_second"), metrics.get("mfu"), now, job_id),
            )
            return self._append(db, job_id, EVENT_STEP, {**metrics, "time": metrics.get("time", now)}, now)

    @_timed
    def count_by_state(self, tenant: str | None = None) -> dict[str, int]:
        """How many jobs are in each state (of one tenant, or of all)."""
        sql = "SELECT state, COUNT(*) AS n FROM jobs" + (" WHERE tenant = ?" if tenant is not None else "") + " GROUP BY state"
        with self._reading() as db:
            rows = db.execute(sql, (tenant,) if tenant is not None else ()).fetchall()
        return {r["state"]: r["n"] for r in rows}

    @_timed
    def queue(self, *, after: QueuedJob | None = None, limit: int = 100) -> list[QueuedJob]:
        """QUEUED jobs in admission order (priority descending, then submission order), the first `limit`
        after `after`, with their specs (`_specs_of`)."""
        where, args = ["state = ?"], [JobState.QUEUED]
        if after is not None:
            where.append("(priority < ? OR (priority = ? AND seq > ?))")
            args.extend((after.priority, after.priority, after.seq))
        with self._reading() as db:
            rows = db.execute(
                f"SELECT id, seq, priority, tenant, reason FROM jobs WHERE {' AND '.join(where)}"
                " ORDER BY priority DESC, seq ASC LIMIT ?",
                (*args, limit),
            ).fetchall()
            specs_of = self._specs_of(db, [row["id"] for row in rows])
        specs = specs_of()
        return [QueuedJob(job=specs[row["id"]], **row) for row in rows]

    @_timed
    def set_queue_reason(self, reason: str, *, behind: QueuedJob | None) -> int:
        """Set `reason` on every QUEUED job after `behind` in admission order (on all of them when None),
        in one write; returns how many changed."""
        where, args = ["state = ?", "reason <> ?"], [JobState.QUEUED, reason]
        if behind is not None:
            where.append("(priority < ? OR (priority = ? AND seq > ?))")
            args.extend((behind.priority, behind.priority, behind.seq))
        condition = " AND ".join(where)
        with self._reading() as db:  # most passes change nothing: find that out without a write transaction
            if db.execute(f"SELECT 1 FROM jobs WHERE {condition} LIMIT 1", args).fetchone() is None:
                return 0
        with self._tx() as db:
            return db.execute(f"UPDATE jobs SET reason = ?, update_time = ?, version = version + 1 WHERE {condition}", (reason, time.time(), *args)).rowcount

    @_timed
    def step_metrics(self, job_id: str, *, after_step: int = 0) -> list[dict[str, Any]]:
        """Every recorded step of a job (those after `after_step`), in step order."""
        with self._reading() as db:
            self._get(job_id, db)
            rows = db.execute(
                "SELECT * FROM step_metrics WHERE job_id = ? AND step > ? ORDER BY step", (job_id, after_step)
            ).fetchall()
        out = []
        for row in rows:
            item = dict(row)
            item.pop("job_id")
            item["breakdown"] = json.loads(item["breakdown"])
            out.append(item)
        return out

    @_timed
    def events(self, job_id: str, after_sequence: int = 0, limit: int = 1000) -> list[Event]:
        """A job's events with sequence > after_sequence, oldest first."""
        with self._reading() as db:
            rows = db.execute(
                "SELECT * FROM events WHERE job_id = ? AND sequence > ? ORDER BY sequence LIMIT ?",
                (job_id, after_sequence, limit),
            ).fetchall()
        return [Event(r["sequence"], r["job_id"], r["time"], r["type"], json.loads(r["payload"])) for r in rows]

    # ---- sweeps -------------------------------------------------------------------------------------
    @_timed
    def create_sweep(
        self, sweep: Sweep, *, tenant: str = "default", request_id: str | None = None, now: float | None = None,
        digest: str | None = None,
    ) -> tuple[SweepRecord, bool]:
        """Insert `sweep` as RUNNING; return (record, created). A request_id the tenant already used
        returns that sweep and created=False (RequestReused when `digest`, of the request, differs)."""
        now = time.time() if now is None else now
        key = request_key(tenant, request_id) if request_id else None
        with self._tx() as db:
            if key:
                row = db.execute("SELECT id, request_digest FROM sweeps WHERE request_id = ?", (key,)).fetchone()
                if row is not None:
                    return self._get_sweep(db, _retried(row, digest)), False
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 AS seq FROM sweeps").fetchone()["seq"]
            spec = sweep.model_dump_json()
            row = _inserted(sweep.metadata.name, lambda sweep_id: db.execute(
                "INSERT INTO sweeps (id, seq, request_id, request_digest, tenant, name, spec, state, reason, create_time,"
                " update_time) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING RETURNING id",
                (sweep_id, seq, key, digest, tenant, sweep.metadata.name, spec, SweepState.RUNNING, "accepted", now, now),
            ).fetchone())
            return self._get_sweep(db, row["id"]), True

    @_timed
    def get_sweep(self, sweep_id: str) -> SweepRecord:
        """The sweep `sweep_id`; SweepNotFound when there is none (an id holding NUL, as for jobs)."""
        with self._reading(snapshot=True) as db:  # the sweep and its trials as of one commit
            return self._get_sweep(db, sweep_id)

    @_timed
    def sweep_of_request(self, tenant: str, request_id: str, digest: str | None = None) -> SweepRecord | None:
        """The sweep `tenant` created with `request_id`, if any: what a retried CreateSweep answers
        (RequestReused when `digest` differs from its request's)."""
        with self._reading() as db:
            row = db.execute(
                "SELECT id, request_digest FROM sweeps WHERE request_id = ?", (request_key(tenant, request_id),)
            ).fetchone()
        return None if row is None else self.get_sweep(_retried(row, digest))

    def _get_sweep(self, db: Database, sweep_id: str) -> SweepRecord:
        row = db.execute("SELECT * FROM sweeps WHERE id = ?", (sweep_id,)).fetchone()
        if row is None:
            raise SweepNotFound(sweep_id)
        return self._sweep_record(db, row)

    def _sweep_record(self, db: Database, row: dict[str, Any]) -> SweepRecord:
        data = dict(row)
        data.pop("request_id")
        data.pop("request_digest")
        data["sweep"] = Sweep.model_validate_json(data.pop("spec"))
        data["state"] = SweepState(data["state"])
        trials = db.execute("SELECT * FROM sweep_trials WHERE sweep_id = ? ORDER BY number", (row["id"],)).fetchall()
        data["trials"] = [
            TrialRecord(**{**t, "params": json.loads(t["params"]), "state": TrialState(t["state"])}) for t in trials
        ]
        return SweepRecord(**data)

    @_timed
    def list_sweeps(
        self, *, tenant: str | None = None, states: Iterable[SweepState] = (), limit: int | None = None,
        before_seq: int | None = None,
    ) -> list[SweepRecord]:
        """Sweeps matching the filters, newest first, `seq < before_seq` when given."""
        where, args = [], []
        states = list(states)
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})")
            args.extend(states)
        if before_seq is not None:
            where.append("seq < ?")
            args.append(before_seq)
        sql = "SELECT * FROM sweeps" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY seq DESC"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        with self._reading(snapshot=True) as db:  # each sweep with its trials as of the same commit
            return [self._sweep_record(db, row) for row in db.execute(sql, args).fetchall()]

    @_timed
    def create_trial(
        self, sweep_id: str, number: int, params: dict[str, Any], job: TrainingJob | None, *,
        reason: str = "", now: float | None = None,
    ) -> TrialRecord | None:
        """Record trial `number` with its parameters and, in the same transaction, its job (QUEUED, in
        the sweep's tenant); without a job the trial is FAILED with `reason` (its parameters made no valid
        job). Compare-and-set: only while the sweep is RUNNING and `number` is its next trial, else None,
        so no trial is ever recorded twice."""
        now = time.time() if now is None else now
        with self._tx() as db:
            sweep = db.execute("SELECT tenant, state FROM sweeps WHERE id = ?", (sweep_id,)).fetchone()
            if sweep is None:
                raise SweepNotFound(sweep_id)
            count_ = db.execute("SELECT COUNT(*) AS n FROM sweep_trials WHERE sweep_id = ?", (sweep_id,)).fetchone()["n"]
            if sweep["state"] != SweepState.RUNNING or count_ != number:
                return None
            job_id = self._insert_job(db, job, sweep["tenant"], trial_key(sweep_id, number), now).id if job else None
            state, end = (TrialState.RUNNING, None) if job else (TrialState.FAILED, now)
            db.execute(
                "INSERT INTO sweep_trials (sweep_id, number, job_id, params, state, reason, create_time, end_time)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (sweep_id, number, job_id, json_text(params), state, reason, now, end),
            )
            db.execute("UPDATE sweeps SET update_time = ? WHERE id = ?", (now, sweep_id))
            return self._trial(db, sweep_id, number)

    @_timed
    def finish_trial(
        self, sweep_id: str, number: int, state: TrialState, *, reason: str, objective: float | None = None,
        objective_step: int | None = None, now: float | None = None,
    ) -> TrialRecord | None:
        """Settle a RUNNING trial (compare-and-set: None when it is settled already)."""
        now = time.time() if now is None else now
        with self._tx() as db:
            updated = db.execute(
                "UPDATE sweep_trials SET state = ?, reason = ?, objective = ?, objective_step = ?, end_time = ?"
                " WHERE sweep_id = ? AND number = ? AND state = ?",
                (state, reason, objective, objective_step, now, sweep_id, number, TrialState.RUNNING),
            ).rowcount
            if not updated:
                return None
            db.execute("UPDATE sweeps SET update_time = ? WHERE id = ?", (now, sweep_id))
            return self._trial(db, sweep_id, number)

    def _trial(self, db: Database, sweep_id: str, number: int) -> TrialRecord:
        row = db.execute("SELECT * FROM sweep_trials WHERE sweep_id = ? AND number = ?", (sweep_id, number)).fetchone()
        return TrialRecord(**{**row, "params": json.loads(row["params"]), "state": TrialState(row["state"])})

    @_timed
    def finish_sweep(
        self, sweep_id: str, state: SweepState, reason: str, *, now: float | None = None
    ) -> SweepRecord | None:
        """End a RUNNING sweep (compare-and-set: None when it has ended already). CANCELLED also settles
        its RUNNING trials as CANCELLED, in the same transaction; their jobs are the caller's to cancel."""
        now = time.time() if now is None else now
        with self._tx() as db:
            updated = db.execute(
                "UPDATE sweeps SET state = ?, reason = ?, end_time = ?, update_time = ? WHERE id = ? AND state = ?",
                (state, reason, now, now, sweep_id, SweepState.RUNNING),
            ).rowcount
            if not updated:
                return None
            if state == SweepState.CANCELLED:
                db.execute(
                    "UPDATE sweep_trials SET state = ?, reason = ?, end_time = ? WHERE sweep_id = ? AND state = ?",
                    (TrialState.CANCELLED, reason, now, sweep_id, TrialState.RUNNING),
                )
            return self._get_sweep(db, sweep_id)

    # ---- leases -------------------------------------------------------------------------------------
    @_timed
    def acquire_lease(self, name: str, holder: str, ttl: float) -> Fence | None:
        """Take or renew lease `name` for `ttl` seconds of the database's clock; None while another holder's
        lease is unexpired. The epoch grows whenever the lease changes hands or had lapsed."""
        now = NOW_SQL[self._db.backend]
        with self._tx() as db:
            row = db.execute(f"SELECT holder, epoch, expires > {now} AS live FROM leases WHERE name = ?", (name,)).fetchone()
            if row is None:
                epoch = 1
                db.execute(f"INSERT INTO leases (name, holder, epoch, expires) VALUES (?, ?, ?, {now} + ?)", (name, holder, epoch, ttl))
                return Fence(name, holder, epoch)
            if row["live"] and row["holder"] != holder:
                return None
            epoch = row["epoch"] if row["live"] else row["epoch"] + 1
            db.execute(f"UPDATE leases SET holder = ?, epoch = ?, expires = {now} + ? WHERE name = ?", (holder, epoch, ttl, name))
            return Fence(name, holder, epoch)

    @_timed
    def release_lease(self, fence: Fence) -> None:
        """Give the lease up at once (a standby may take it on its next try), if `fence` still holds it."""
        with self._tx() as db:
            db.execute(
                f"UPDATE leases SET expires = {NOW_SQL[self._db.backend]} - 1 WHERE name = ? AND holder = ? AND epoch = ?",
                (fence.name, fence.holder, fence.epoch),
            )

    def _holds(self, db: Database, fence: Fence) -> bool:
        return db.execute(
            f"SELECT 1 AS held FROM leases WHERE name = ? AND holder = ? AND epoch = ? AND expires > {NOW_SQL[db.backend]}",
            (fence.name, fence.holder, fence.epoch),
        ).fetchone() is not None

    def reachable(self) -> bool:
        """Whether the database answers now (readiness)."""
        try:
            with self._lock:
                self._db.execute("SELECT 1 AS one").fetchone()
        except StoreUnavailable:
            return False
        return True

    def on_commit(self, callback: Callable[[], None], job_id: str | None = None) -> Callable[[], None]:
        """Call `callback` (quick, never raising) in the committing thread after each write of this
        process commits (with `job_id`: each write that appended an event of that job), until the
        returned function is called. Another process's commits are not seen: poll for those. Never waits
        for a write in progress."""
        with self._listeners_lock:
            self._commit_listeners.setdefault(job_id, set()).add(callback)

        def unsubscribe() -> None:
            with self._listeners_lock:
                listeners = self._commit_listeners.get(job_id, set())
                listeners.discard(callback)
                if not listeners:
                    self._commit_listeners.pop(job_id, None)

        return unsubscribe

    def _append(self, db: Database, job_id: str, type_: str, payload: dict[str, Any], now: float) -> int:
        self._appended.add(job_id)
        row = db.execute(
            "INSERT INTO events (job_id, time, type, payload) VALUES (?, ?, ?, ?) RETURNING sequence",
            (job_id, now, type_, json_text(payload)),
        ).fetchone()
        return int(row["sequence"])


def total_steps(job: TrainingJob) -> int:
    """The steps a job will run: `training.steps`, or 0 (unknown) for a command job, whose program decides."""
    return 0 if job.spec.command is not None else job.spec.training.steps
