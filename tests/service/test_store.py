"""The SQLite job store: WAL, schema version and migrations, durability across reopen, idempotency."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from trainctl.service.store import DB_NAME, SCHEMA_VERSION, JobNotFound, JobStore, StoreError
from trainctl.spec.job import TrainingJob
from trainctl.workers.events import JobState


def job(name: str = "j", priority: int = 0, labels: dict[str, str] | None = None) -> TrainingJob:
    return TrainingJob.model_validate(
        {"metadata": {"name": name, "labels": labels or {}}, "spec": {"scheduling": {"priority": priority}}}
    )


def test_new_store_is_wal_at_the_current_schema(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    assert store.journal_mode == "wal"
    assert store.schema_version == SCHEMA_VERSION >= 1
    store.close()


def test_a_job_survives_a_crash_right_after_create(tmp_path: Path) -> None:
    """A separate process creates a job and dies with os._exit (no close, no cleanup): the job is there."""
    code = (
        "import os, sys; from trainctl.service.store import JobStore; from trainctl.spec.job import TrainingJob;"
        "s = JobStore(sys.argv[1]); r, _ = s.create_job(TrainingJob.model_validate({'metadata': {'name': 'crash'}}));"
        "print(r.id, flush=True); os._exit(9)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 9, out.stderr
    job_id = out.stdout.strip()
    store = JobStore(tmp_path)
    record = store.get_job(job_id)
    assert record.state == JobState.QUEUED and record.name == "crash"
    assert [e.payload["to"] for e in store.events(job_id)] == [JobState.QUEUED]


def test_reopen_keeps_jobs_events_and_metrics(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    record, created = store.create_job(job("a", labels={"team": "x"}))
    assert created
    store.update_status(record.id, state=JobState.SCHEDULED, reason="placed")
    store.update_status(record.id, state=JobState.RUNNING, reason="ranks up")
    store.record_step(record.id, {"step": 1, "loss": 5.0, "tokens_per_second": 10.0, "breakdown": {"fwd": 0.1}})
    store.record_step(record.id, {"step": 2, "loss": 4.0, "tokens_per_second": 12.0})
    store.close()

    again = JobStore(tmp_path)
    got = again.get_job(record.id)
    assert (got.state, got.steps_done, got.first_loss, got.last_loss) == (JobState.RUNNING, 2, 5.0, 4.0)
    assert got.labels == {"team": "x"} and got.job == record.job
    assert [m["loss"] for m in again.step_metrics(record.id)] == [5.0, 4.0]
    assert again.step_metrics(record.id)[0]["breakdown"] == {"fwd": 0.1}
    events = again.events(record.id)
    assert [e.type for e in events] == ["state", "state", "state", "step", "step"]
    assert [e.sequence for e in events] == sorted(e.sequence for e in events)
    assert [e.sequence for e in again.events(record.id, after_sequence=events[2].sequence)] == [
        events[3].sequence, events[4].sequence,
    ]


def test_request_id_makes_create_idempotent_across_reopen(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    first, created = store.create_job(job("a"), request_id="req-1")
    store.close()
    store = JobStore(tmp_path)
    second, created_again = store.create_job(job("a"), request_id="req-1")
    assert created and not created_again and second.id == first.id
    other, _ = store.create_job(job("a"), tenant="other", request_id="req-1")
    assert other.id != first.id  # keys are per tenant
    assert len(store.list_jobs()) == 2


def test_terminal_states_are_final_and_cas_respects_expectations(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    record, _ = store.create_job(job())
    assert store.update_status(record.id, expect=[JobState.RUNNING], state=JobState.CANCELLED) is None
    done = store.update_status(record.id, expect=[JobState.QUEUED], state=JobState.CANCELLED, reason="user")
    assert done is not None and done.state == JobState.CANCELLED and done.end_time is not None
    assert store.update_status(record.id, state=JobState.RUNNING) is None
    assert store.get_job(record.id).state == JobState.CANCELLED


def test_list_filters_and_pages(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    ids = [store.create_job(job(f"j{i}", labels={"i": str(i % 2)}))[0].id for i in range(5)]
    store.update_status(ids[0], state=JobState.CANCELLED)
    assert [r.id for r in store.list_jobs()] == ids[::-1]
    assert [r.id for r in store.list_jobs(states=[JobState.CANCELLED])] == [ids[0]]
    assert [r.id for r in store.list_jobs(labels={"i": "1"})] == [ids[3], ids[1]]
    page = store.list_jobs(limit=2)
    assert [r.id for r in store.list_jobs(limit=2, before_seq=page[-1].seq)] == [ids[2], ids[1]]
    with pytest.raises(JobNotFound):
        store.get_job("nope")


def test_a_restarted_step_replaces_its_metrics_row(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    record, _ = store.create_job(job())
    for step, loss in [(1, 5.0), (2, 4.0), (2, 3.9), (3, 3.0)]:
        store.record_step(record.id, {"step": step, "loss": loss})
    assert [(m["step"], m["loss"]) for m in store.step_metrics(record.id)] == [(1, 5.0), (2, 3.9), (3, 3.0)]


def test_migrates_an_older_schema_and_refuses_a_newer_one(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute("PRAGMA user_version=0")
    db.close()
    store = JobStore(tmp_path)  # an empty version-0 file is migrated to the current schema
    assert store.schema_version == SCHEMA_VERSION
    store.create_job(job())
    store.close()
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="schema version"):
        JobStore(tmp_path)
