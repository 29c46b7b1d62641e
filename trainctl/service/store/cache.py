"""The records a store keeps built: job id -> its `JobRecord`, answered again while the job's row keeps
its version (every write of the row adds one to `jobs.version`, whichever process writes it), and job id
-> its parsed spec (a spec never changes, so each is parsed once while kept). Both hold the most recently
built `RECORDS_KEPT`. A read selects the jobs' ids and versions and builds only the records it has not
kept (`records_of`); a write's record is kept only once its transaction commits (`StoreCore.wrote`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any

from trainctl.service.newest_kept import NewestKept
from trainctl.service.store.db import Database
from trainctl.service.store.records import JobNotFound, JobRecord
from trainctl.spec.job import TrainingJob
from trainctl.workers.events import JobState

RECORDS_KEPT = 10_000
"""Records, and parsed specs, a store keeps: every job of a 10,000-job store stays built, and a store of
any size holds at most about 110 MiB of them (a small job's parsed spec is about 10 KiB, its record 1)."""

RECORD_FIELDS = frozenset(f.name for f in fields(JobRecord) if f.name not in ("job", "labels"))
RECORD_COLUMNS = ", ".join(sorted(RECORD_FIELDS))
"""The `jobs` columns a JobRecord holds: all but the spec text (parsed once per job while kept,
`RecordCache.specs_of`) and the request id."""


def in_chunks(ids: list[str]) -> Iterator[tuple[list[str], str]]:
    """`ids` in chunks that fit SQLite's bound-parameter limit, each with its `?, ?, ...` placeholders."""
    for start in range(0, len(ids), 500):
        chunk = ids[start:start + 500]
        yield chunk, ",".join("?" * len(chunk))


def job_record(row: dict[str, Any], spec: TrainingJob, labels: dict[str, str]) -> JobRecord:
    """The record of a `jobs` row (its `RECORD_COLUMNS`), its parsed spec and its labels."""
    return JobRecord(
        job=spec, labels=labels,
        **{**row, "placement": json.loads(row["placement"]) if row["placement"] != "[]" else [],
           "state": JobState(row["state"])},
    )


class RecordCache:
    """The kept records and parsed specs of one store, safe to use from any thread."""

    def __init__(self) -> None:
        self.specs: NewestKept[TrainingJob] = NewestKept(RECORDS_KEPT)
        """Job id -> its parsed spec, for the most recently parsed (see `specs_of`)."""
        self.records: NewestKept[JobRecord] = NewestKept(RECORDS_KEPT)
        """Job id -> its record, for the most recently built: a job whose row has not changed since (the
        same version) is answered with the same record (see `kept`)."""

    def get(self, db: Database, job_id: str) -> JobRecord:
        """The job `job_id` as `db` reads it now; JobNotFound when there is none."""
        row = db.execute(f"SELECT {RECORD_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        return self.records_of(db, [row])()[0]

    def records_of(self, db: Database, heads: list[dict[str, Any]]) -> Callable[[], list[JobRecord]]:
        """Jobs, given as rows of at least their id and version, as records: the kept record where its
        version is the row's, else a new one. Reads what the new ones need (their rows, unless a head is
        the whole row already; labels; spec texts) on `db` now: in the snapshot `heads` were read in,
        where the caller took one (a listing's filter must hold for what it returns), else as of now. The
        call it returns builds them, parsing the specs, and is made after any lock held to read is let go
        (see `specs_of`)."""
        kept = [self.kept(head["id"], head["version"]) for head in heads]
        new = [head["id"] for head, record in zip(heads, kept, strict=True) if record is None]
        rows = {head["id"]: head for head in heads if head.keys() >= RECORD_FIELDS}
        labels: dict[str, dict[str, str]] = {}
        for chunk, marks in in_chunks([job_id for job_id in new if job_id not in rows]):
            for row in db.execute(f"SELECT {RECORD_COLUMNS} FROM jobs WHERE id IN ({marks})", chunk).fetchall():
                rows[row["id"]] = row
        for chunk, marks in in_chunks(new):
            for label in db.execute(f"SELECT job_id, key, value FROM job_labels WHERE job_id IN ({marks})", chunk).fetchall():
                labels.setdefault(label["job_id"], {})[label["key"]] = label["value"]
        specs_of = self.specs_of(db, new)

        def build() -> list[JobRecord]:
            specs = specs_of()
            return [
                record or self._keep(rows[head["id"]], specs[head["id"]], labels.get(head["id"], {}))
                for head, record in zip(heads, kept, strict=True)
            ]

        return build

    def kept(self, job_id: str, version: int) -> JobRecord | None:
        """The record kept for `job_id` if it is of that version of the job's row. Labels and specs never
        change after CreateJob and records are frozen, so the same version means an equal record."""
        record = self.records.get(job_id)
        return record if record is not None and record.version == version else None

    def _keep(self, row: dict[str, Any], spec: TrainingJob, labels: dict[str, str]) -> JobRecord:
        """A new record of committed `row`, kept in place of any older one. Called from any thread: a lost
        race only builds a record twice."""
        record = job_record(row, spec, labels)
        return self.records.add(record.id, record)

    def specs_of(self, db: Database, job_ids: list[str]) -> Callable[[], dict[str, TrainingJob]]:
        """The parsed specs of `job_ids`. Reads the texts of those not kept parsed on `db` now; the call it
        returns parses them (specs never change, so each is parsed once while kept) and is made after any
        lock held to read is let go, so a first listing of many jobs does not hold up the writers."""
        specs = {job_id: spec for job_id in job_ids if (spec := self.specs.get(job_id)) is not None}
        texts = {}
        for chunk, marks in in_chunks([job_id for job_id in job_ids if job_id not in specs]):
            texts.update((row["id"], row["spec"]) for row in db.execute(f"SELECT id, spec FROM jobs WHERE id IN ({marks})", chunk).fetchall())

        def parse() -> dict[str, TrainingJob]:
            for job_id, text in texts.items():
                specs[job_id] = self.specs.add(job_id, TrainingJob.model_validate_json(text))
            return specs

        return parse
