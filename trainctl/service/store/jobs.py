"""Jobs (table `jobs`, with `job_labels`): creating one (its row, labels, first event and request key in
one transaction), reading and listing them through the record cache, and their status writes
(compare-and-set; terminal states are final). Also the ids and request keys of jobs and sweeps: a request
id sent again answers what it first created (`RequestReused` when the request differs)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from trainctl.service.store.cache import RECORD_COLUMNS
from trainctl.service.store.core import StoreCore
from trainctl.service.store.db import Database, StoreError, json_text
from trainctl.service.store.events import EventLog
from trainctl.service.store.records import EVENT_STATE, AdmissionRefused, JobRecord, RequestReused
from trainctl.spec.job import TrainingJob
from trainctl.workers.events import JobState

ID_ATTEMPTS = 8
"""Fresh ids an insert tries before it fails. A job's or sweep's id is its name, '-' and 8 random hex
digits (32 bits; at most 72 characters, short enough for run directories and Ray actor names): among
100,000 jobs of one name a new one's first id is taken with a chance of 2e-5, eight in a row never are."""

STATUS_COLUMNS = frozenset({
    "state", "reason", "schedule_time", "start_time", "end_time", "steps_done", "first_loss", "last_loss",
    "restarts", "tokens_per_second", "mfu", "mfu_full_attention", "placement", "run_dir", "runtime_cursor",
    "preemptions", "preempt_time",
})
"""The `jobs` columns `update_status` may set."""


def request_key(tenant: str, request_id: str) -> str:
    """The idempotency key of a tenant's request id (CreateJob, CreateSweep): unique across tenants, as a
    tenant name is never empty and holds no '/'."""
    return f"{tenant}/{request_id}"


def trial_key(sweep_id: str, number: int) -> str:
    """The idempotency key of a sweep trial's job: it starts with '/', so no `request_key` equals it."""
    return f"/sweep/{sweep_id}/{number}"


def total_steps(job: TrainingJob) -> int:
    """The steps a job will run: `training.steps`, or 0 (unknown) for a command job, whose program decides."""
    return 0 if job.spec.command is not None else job.spec.training.steps


def retried(row: dict[str, Any], digest: str | None) -> str:
    """The id of the job or sweep a request id created (`row`: its id and request_digest), for a retry
    whose request has `digest`; RequestReused when both digests are known and differ."""
    if digest is not None and row["request_digest"] is not None and row["request_digest"] != digest:
        raise RequestReused(row["id"])
    return row["id"]


def inserted(name: str, insert: Callable[[str], dict[str, Any] | None]) -> dict[str, Any]:
    """The row `insert(id)` returned for the first fresh id of `name` not taken yet: `insert` inserts
    `ON CONFLICT (id) DO NOTHING` and returns None when the id is another's. Any other conflict (a
    request id) raises as before."""
    for _ in range(ID_ATTEMPTS):
        row = insert(f"{name}-{uuid.uuid4().hex[:8]}")
        if row is not None:
            return row
    raise StoreError(f"{ID_ATTEMPTS} fresh ids for {name!r} were all taken")


def tenant_and_states(tenant: str | None, states: Sequence[str]) -> tuple[list[str], list[Any]]:
    """The WHERE terms and their arguments of a listing's tenant and state filters (jobs' or sweeps')."""
    where: list[str] = []
    args: list[Any] = []
    if tenant is not None:
        where.append("tenant = ?")
        args.append(tenant)
    if states:
        where.append(f"state IN ({','.join('?' * len(states))})")
        args.extend(states)
    return where, args


class Jobs:
    """The jobs' rows and labels."""

    def __init__(self, core: StoreCore, events: EventLog):
        self._core = core
        self._events = events

    def create_job(
        self, job: TrainingJob, tenant: str, request_id: str | None, now: float | None,
        admit: Callable[[Callable[[], int]], str | None] | None, digest: str | None,
    ) -> tuple[JobRecord, bool]:
        now = time.time() if now is None else now
        key = request_key(tenant, request_id) if request_id else None
        with self._core.tx() as db:
            if key:
                row = db.execute("SELECT id, request_digest FROM jobs WHERE request_id = ?", (key,)).fetchone()
                if row is not None:
                    return self._core.cache.get(db, retried(row, digest)), False
            if admit is not None and (refusal := admit(lambda: self._queued_count(db, tenant))) is not None:
                raise AdmissionRefused(refusal)
            return self.insert_job(db, job, tenant, key, now, digest), True

    def job_of_request(self, tenant: str, request_id: str, digest: str | None) -> JobRecord | None:
        with self._core.reading() as db:
            row = db.execute(
                f"SELECT {RECORD_COLUMNS}, request_digest FROM jobs WHERE request_id = ?", (request_key(tenant, request_id),)
            ).fetchone()
            if row is None:
                return None
            retried(row, digest)
            return self._core.cache.records_of(db, [row])()[0]

    @staticmethod
    def _queued_count(db: Database, tenant: str) -> int:
        row = db.execute("SELECT COUNT(*) AS n FROM jobs WHERE tenant = ? AND state = ?", (tenant, JobState.QUEUED)).fetchone()
        return int(row["n"])

    def insert_job(
        self, db: Database, job: TrainingJob, tenant: str, key: str | None, now: float, digest: str | None = None,
    ) -> JobRecord:
        """The job inserted in the open write transaction `db`, with its labels and first event; its
        record (kept once the write commits)."""
        spec = job.model_dump_json()
        row = inserted(job.metadata.name, lambda job_id: db.execute(
            "INSERT INTO jobs (id, seq, request_id, request_digest, tenant, name, spec, priority, state, reason,"
            " create_time, update_time, total_steps)"
            " VALUES (?, (SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs), ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            f" ON CONFLICT (id) DO NOTHING RETURNING {RECORD_COLUMNS}",
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
        self._events.append(db, job_id, EVENT_STATE, {"from": "", "to": JobState.QUEUED, "reason": "accepted"}, now)
        # the spec as read back (a copy the caller cannot change), parsed once here rather than at the first read
        spec_read_back = self._core.cache.specs.add(job_id, TrainingJob.model_validate_json(spec))
        return self._core.wrote(row, spec_read_back, dict(labels))

    def get_job(self, job_id: str) -> JobRecord:
        with self._core.reading() as db:
            return self._core.cache.get(db, job_id)

    def list_jobs(
        self, tenant: str | None, states: list[JobState], labels: dict[str, str], limit: int | None,
        before_seq: int | None, oldest_first: bool,
    ) -> list[JobRecord]:
        where, args = tenant_and_states(tenant, states)
        for key, value in labels.items():
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
        with self._core.reading(snapshot=snapshot) as db:
            heads = db.execute(sql, args).fetchall()
            if sort:  # everything that matches: sorted here, so the planner may take the most
                # selective index (a tenant's active jobs: (tenant, state)) instead of the seq order
                heads.sort(key=lambda head: head["seq"], reverse=not oldest_first)
            build = self._core.cache.records_of(db, heads)
        records = build()
        if any(record.version != head["version"] for record, head in zip(records, heads, strict=True)):
            return None
        return records

    def update_status(
        self, job_id: str, expect: Iterable[JobState] | None, now: float | None, changes: dict[str, Any],
    ) -> JobRecord | None:
        unknown = set(changes) - STATUS_COLUMNS
        if unknown:
            raise ValueError(f"not status columns: {sorted(unknown)}")
        now = time.time() if now is None else now
        with self._core.tx() as db:
            current = self._core.cache.get(db, job_id)
            if expect is not None and current.state not in set(expect):
                return None
            new_state = changes.get("state", current.state)
            if new_state != current.state:
                if current.terminal:
                    return None
                self._events.append(
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
                f"UPDATE jobs SET {sets}, version = version + 1 WHERE id = ? RETURNING {RECORD_COLUMNS}",
                (*changes.values(), job_id),
            ).fetchone()
            return self._core.wrote(row, current.job, current.labels)  # the spec and labels never change
