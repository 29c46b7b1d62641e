"""The job store on both backends (SQLite in a data directory, a real PostgreSQL: the `store_location`
fixture, tests/service/conftest.py): schema version and migrations, durability across reopen and a
crash, idempotency, compare-and-set, sweeps and trials; SQLite's WAL."""

from __future__ import annotations

import gc
import math
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import psycopg
import pytest

from tests.service.store.old_stores import downgrade
from trainctl.service.store import (
    MIGRATIONS,
    SCHEMA_VERSION,
    JobNotFound,
    JobStore,
    LeaseLost,
    RequestReused,
    StoreError,
    SweepNotFound,
    SweepState,
    TrialState,
)
from trainctl.service.store.db import (
    READ_CONNECTIONS,
    PostgresDatabase,
    StoreUnavailable,
    open_database,
    run_script,
)
from trainctl.spec.job import TrainingJob
from trainctl.spec.sweep import Sweep
from trainctl.workers.events import JobState


def job(name: str = "j", priority: int = 0, labels: dict[str, str] | None = None) -> TrainingJob:
    return TrainingJob.model_validate(
        {"metadata": {"name": name, "labels": labels or {}}, "spec": {"scheduling": {"priority": priority}}}
    )


def test_new_store_is_at_the_current_schema(store_location: str) -> None:
    store = JobStore(store_location)
    assert store.schema_version == SCHEMA_VERSION >= 1
    assert store.backend == ("postgresql" if store_location.startswith("postgresql://") else "sqlite")
    store.close()


def test_a_sqlite_store_is_wal(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    assert store.journal_mode == "wal"
    store.close()


def test_a_job_survives_a_crash_right_after_create(store_location: str) -> None:
    """A separate process creates a job and dies with os._exit (no close, no cleanup): the job is there."""
    code = (
        "import os, sys; from trainctl.service.store import JobStore; from trainctl.spec.job import TrainingJob;"
        "s = JobStore(sys.argv[1]); r, _ = s.create_job(TrainingJob.model_validate({'metadata': {'name': 'crash'}}));"
        "print(r.id, flush=True); os._exit(9)"
    )
    out = subprocess.run([sys.executable, "-c", code, store_location], capture_output=True, text=True, timeout=60)
    assert out.returncode == 9, out.stderr
    job_id = out.stdout.strip()
    store = JobStore(store_location)
    record = store.get_job(job_id)
    assert record.state == JobState.QUEUED and record.name == "crash"
    assert [e.payload["to"] for e in store.events(job_id)] == [JobState.QUEUED]


def test_reopen_keeps_jobs_events_and_metrics(store_location: str) -> None:
    store = JobStore(store_location)
    record, created = store.create_job(job("a", labels={"team": "x"}))
    assert created
    store.update_status(record.id, state=JobState.SCHEDULED, reason="placed")
    store.update_status(record.id, state=JobState.RUNNING, reason="ranks up")
    store.record_step(record.id, {"step": 1, "loss": 5.0, "tokens_per_second": 10.0, "breakdown": {"fwd": 0.1}})
    store.record_step(record.id, {"step": 2, "loss": 4.0, "tokens_per_second": 12.0})
    store.close()

    again = JobStore(store_location)
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


def test_request_id_makes_create_idempotent_across_reopen(store_location: str) -> None:
    store = JobStore(store_location)
    first, created = store.create_job(job("a"), request_id="req-1")
    store.close()
    store = JobStore(store_location)
    second, created_again = store.create_job(job("a"), request_id="req-1")
    assert created and not created_again and second.id == first.id
    other, _ = store.create_job(job("a"), tenant="other", request_id="req-1")
    assert other.id != first.id  # keys are per tenant
    assert len(store.list_jobs()) == 2


def test_terminal_states_are_final_and_cas_respects_expectations(store_location: str) -> None:
    store = JobStore(store_location)
    record, _ = store.create_job(job())
    assert store.update_status(record.id, expect=[JobState.RUNNING], state=JobState.CANCELLED) is None
    done = store.update_status(record.id, expect=[JobState.QUEUED], state=JobState.CANCELLED, reason="user")
    assert done is not None and done.state == JobState.CANCELLED and done.end_time is not None
    assert store.update_status(record.id, state=JobState.RUNNING) is None
    assert store.get_job(record.id).state == JobState.CANCELLED


def test_list_filters_and_pages(store_location: str) -> None:
    store = JobStore(store_location)
    ids = [store.create_job(job(f"j{i}", labels={"i": str(i % 2)}))[0].id for i in range(5)]
    store.update_status(ids[0], state=JobState.CANCELLED)
    assert [r.id for r in store.list_jobs()] == ids[::-1]
    assert [r.id for r in store.list_jobs(states=[JobState.CANCELLED])] == [ids[0]]
    assert [r.id for r in store.list_jobs(labels={"i": "1"})] == [ids[3], ids[1]]
    page = store.list_jobs(limit=2)
    assert [r.id for r in store.list_jobs(limit=2, before_seq=page[-1].seq)] == [ids[2], ids[1]]
    queued = [JobState.QUEUED]  # without a limit the rows are sorted after the query: the same order
    assert [r.id for r in store.list_jobs(states=queued, oldest_first=True)] == ids[1:]
    assert [r.id for r in store.list_jobs(states=queued, labels={"i": "0"})] == [ids[4], ids[2]]
    with pytest.raises(JobNotFound):
        store.get_job("nope")


def _rows_read(plan: dict[str, object]) -> int:
    """Rows an EXPLAIN ANALYZE plan node and those below it produced or threw away, over all its loops."""
    loops = int(plan.get("Actual Loops", 1))  # type: ignore[arg-type]
    here = sum(int(plan.get(key, 0)) for key in ("Actual Rows", "Rows Removed by Filter", "Rows Removed by Join Filter"))  # type: ignore[arg-type]
    return here * loops + sum(_rows_read(child) for child in plan.get("Plans", []))  # type: ignore[union-attr]


def test_a_label_filtered_page_on_postgresql_reads_rows_of_the_jobs_it_walks_only(
    postgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A young table has no statistics: the page's plan must still look each walked job's label up by its
    key, not read every job's label once per job walked (what a (key, value) index invited)."""
    url = postgres.create_database()
    store = JobStore(url)
    for i in range(600):
        created = store.create_job(job(f"l{i}", labels={"team": "ab"[i % 2]}), tenant="t")[0]
        if i % 3 == 0:
            store.update_status(created.id, state=JobState.CANCELLED)
    statements: list[tuple[str, tuple[object, ...]]] = []
    execute = PostgresDatabase.execute
    monkeypatch.setattr(PostgresDatabase, "execute", lambda db, sql, params=(): (
        statements.append((sql, tuple(params))), execute(db, sql, params))[1])
    page = store.list_jobs(tenant="t", states=[JobState.QUEUED], labels={"team": "a"}, limit=51)
    monkeypatch.undo()
    assert len(page) == 51 and all(r.labels == {"team": "a"} and r.state == JobState.QUEUED for r in page)
    sql, params = next((sql, params) for sql, params in statements if "FROM job_labels WHERE job_id = jobs.id" in sql)
    with psycopg.connect(url, autocommit=True) as conn:
        plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql.replace("?", "%s"), [str(p) for p in params]).fetchone()[0]
    assert _rows_read(plan[0]["Plan"]) < 2_000  # about 700 here; the (key, value) index invited 180,000
    store.close()
    postgres.drop_database(url)


def test_an_unchanged_job_is_the_same_record_and_any_change_is_seen(
    store_location: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records are kept by their row's version, which every write adds one to, so a change written by
    another store on the same database is seen as surely as one of this store's own (writes of every
    kind: a status, a step, the queue's reasons); the kept records and specs are bounded."""
    monkeypatch.setattr("trainctl.service.store.cache.RECORDS_KEPT", 3)
    store, other = JobStore(store_location), JobStore(store_location)
    ids = [store.create_job(job(f"k{i}", labels={"team": "a"}))[0].id for i in range(3)]
    first = store.get_job(ids[0])
    assert store.get_job(ids[0]) is first and store.list_jobs()[-1] is first
    other.update_status(ids[0], reason="moved by the other store")
    changed = store.get_job(ids[0])
    assert changed is not first and changed.reason == "moved by the other store"
    assert changed == other.get_job(ids[0]) and changed.labels == {"team": "a"}
    assert [r.id for r in store.list_jobs(labels={"team": "a"})] == ids[::-1]
    other.record_step(ids[1], {"step": 1, "loss": 2.5})
    assert store.get_job(ids[1]).steps_done == 1
    other.set_queue_reason("behind the first", behind=None)
    assert {r.reason for r in store.list_jobs()} == {"behind the first"}
    store.create_job(job("k3"))
    assert (len(store._core.cache.records), len(store._core.cache.specs)) == (3, 3)  # noqa: SLF001  # the bound: the oldest went


def test_a_change_whose_commit_failed_is_never_answered(store_location: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write builds its record from the row it wrote; when the commit fails (rolled back, such as a
    PostgreSQL connection lost at COMMIT) that record must not be kept: the next write gives the row the
    same version with other values, and a kept record of that version would be answered instead."""
    store = JobStore(store_location)
    job_id = store.create_job(job("c"))[0].id
    commit = store._core.db.commit

    def lost() -> None:
        store._core.db.rollback()
        raise StoreUnavailable("the commit's answer was lost")

    monkeypatch.setattr(store._core.db, "commit", lost)
    with pytest.raises(StoreUnavailable):
        store.update_status(job_id, state=JobState.CANCELLED, reason="never committed")
    with pytest.raises(StoreUnavailable):
        store.create_job(job("never"))
    monkeypatch.setattr(store._core.db, "commit", commit)
    store.set_queue_reason("waiting for GPUs", behind=None)  # the row's next version, with other values
    record = store.get_job(job_id)
    assert (record.state, record.reason) == (JobState.QUEUED, "waiting for GPUs")
    assert JobStore(store_location).get_job(job_id) == record
    assert [r.id for r in store.list_jobs()] == [job_id]
    store.close()


def test_a_filtered_listing_returns_its_jobs_as_they_matched_even_when_one_changes_meanwhile(
    store_location: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing reads the matching jobs' ids, then the rows of those it has no record of: a write that
    commits in between (here, another store cancelling one) must not show, or the QUEUED listing would
    return a CANCELLED job. The listing is as of before the cancel or after it, never a mix."""
    store, other = JobStore(store_location), JobStore(store_location)
    ids = [store.create_job(job(f"f{i}"))[0].id for i in range(3)]
    reader = JobStore(store_location)  # a store that has kept no record: every row is read after the ids
    read_rows = reader._core.cache.records_of  # noqa: SLF001

    def cancelled_in_between(db: object, heads: list[dict[str, object]]) -> object:
        other.update_status(ids[1], state=JobState.CANCELLED, reason="in between")
        return read_rows(db, heads)  # type: ignore[arg-type]

    monkeypatch.setattr(reader._core.cache, "records_of", cancelled_in_between)
    listed = reader.list_jobs(states=[JobState.QUEUED])
    monkeypatch.undo()
    assert [(r.id, r.state) for r in listed] in (
        [(i, JobState.QUEUED) for i in ids[::-1]],  # as of before the cancel
        [(ids[2], JobState.QUEUED), (ids[0], JobState.QUEUED)],  # as of after it
    )
    assert [r.id for r in store.list_jobs(states=[JobState.QUEUED])] == [ids[2], ids[0]]
    assert store.get_job(ids[1]).state == JobState.CANCELLED


def test_commit_listeners_hear_every_commit_or_only_their_jobs_events(store_location: str) -> None:
    store = JobStore(store_location)
    first, second = (store.create_job(job(name))[0].id for name in ("a", "b"))
    heard: dict[str, int] = {"any": 0, first: 0}
    stop_any = store.on_commit(lambda: heard.__setitem__("any", heard["any"] + 1))
    stop_first = store.on_commit(lambda: heard.__setitem__(first, heard[first] + 1), first)
    store.append_event(second, "log", {"message": "not the first job's"})
    assert heard == {"any": 1, first: 0}
    store.append_event(first, "log", {"message": "the first job's"})
    assert heard == {"any": 2, first: 1}
    with pytest.raises(TypeError):  # appends the first job's state event, then fails: rolled back, nobody called
        store.update_status(first, state=JobState.RUNNING, placement=[{"rank": object()}])
    store.create_job(job("c"))  # and the rolled-back append is not heard with the next commit
    assert heard == {"any": 3, first: 1}
    store.update_status(first, state=JobState.CANCELLED, reason="stop")  # its state event
    assert heard == {"any": 4, first: 2}
    stop_any()
    stop_first()
    store.append_event(first, "log", {"message": "nobody listens"})
    assert heard == {"any": 4, first: 2}
    store.close()


def test_the_queue_reads_in_admission_order_a_page_at_a_time(store_location: str) -> None:
    store = JobStore(store_location)
    ids = [store.create_job(job(f"q{i}", priority=i % 3), tenant=f"t{i % 2}")[0].id for i in range(7)]
    store.update_status(ids[4], state=JobState.SCHEDULED)  # no longer queued
    order = [ids[i] for i in (2, 5, 1, 0, 3, 6)]  # priority 2, then 1, then 0; submission order within
    first = store.queue(limit=4)
    assert [q.id for q in first] == order[:4] and [q.id for q in store.queue(after=first[-1], limit=4)] == order[4:]
    assert [(q.priority, q.tenant, q.reason, q.job.metadata.name) for q in first[:1]] == [(2, "t0", "accepted", "q2")]

    assert store.set_queue_reason("waiting behind q1", behind=first[2]) == 3  # q0, q3 and q6 follow q1
    assert {q.id: q.reason for q in store.queue()} == {
        **{i: "accepted" for i in order[:3]}, **{i: "waiting behind q1" for i in order[3:]},
    }
    assert store.set_queue_reason("waiting behind q1", behind=first[2]) == 0  # nothing left to change
    assert store.set_queue_reason("a node is being replaced", behind=None) == 6
    assert store.get_job(ids[4]).reason != "a node is being replaced"
    store.close()


def test_a_restarted_step_replaces_its_metrics_row(store_location: str) -> None:
    store = JobStore(store_location)
    record, _ = store.create_job(job())
    for step, loss in [(1, 5.0), (2, 4.0), (2, 3.9), (3, 3.0)]:
        store.record_step(record.id, {"step": step, "loss": loss})
    assert [(m["step"], m["loss"]) for m in store.step_metrics(record.id)] == [(1, 5.0), (2, 3.9), (3, 3.0)]


def set_schema_version(location: str, version: int) -> None:
    db = open_database(location)
    db.begin_write()
    db.set_schema_version(version)
    db.commit()
    db.close()


def test_migrates_an_older_schema_and_refuses_a_newer_one(store_location: str) -> None:
    set_schema_version(store_location, 0)
    store = JobStore(store_location)  # an empty version-0 database is migrated to the current schema
    assert store.schema_version == SCHEMA_VERSION
    store.create_job(job())
    store.close()
    set_schema_version(store_location, SCHEMA_VERSION + 1)
    with pytest.raises(StoreError, match="schema version"):
        JobStore(store_location)


def test_each_migration_applies_on_the_schema_before_it(store_location: str) -> None:
    """A database at version 1 (jobs, no sweeps) with a job in it is upgraded in place, the job kept."""
    db = open_database(store_location)
    db.begin_write()
    run_script(db, MIGRATIONS[0])
    db.set_schema_version(1)
    db.commit()
    db.close()
    store = JobStore(store_location)
    assert store.schema_version == SCHEMA_VERSION
    record, _ = store.create_job(job("kept"))
    store.close()
    store = JobStore(store_location)
    assert store.get_job(record.id).name == "kept" and store.list_sweeps() == []


def sweep(name: str = "s") -> Sweep:
    return Sweep.model_validate({
        "metadata": {"name": name},
        "spec": {
            "template": {},
            "parameters": [{"path": "spec.training.lr", "type": "float", "low": 1e-4, "high": 1e-2}],
            "trials": 3,
        },
    })


def test_sweeps_and_trials_are_compare_and_set(store_location: str) -> None:
    store = JobStore(store_location)
    record, created = store.create_sweep(sweep(), request_id="r")
    assert created and store.create_sweep(sweep(), request_id="r") == (record, False)
    assert store.create_trial(record.id, 1, {}, None) is None  # not the next number
    trial = store.create_trial(record.id, 0, {"spec.training.lr": 1e-3}, job("t0"))
    assert trial is not None and trial.state == TrialState.RUNNING and trial.job_id is not None
    assert store.get_job(trial.job_id).state == JobState.QUEUED  # the trial's job, in the same transaction
    assert store.create_trial(record.id, 0, {}, job("again")) is None  # never recorded twice
    failed = store.create_trial(record.id, 1, {"x": 1}, None, reason="bad parameters")
    assert failed is not None and failed.state == TrialState.FAILED and failed.job_id is None
    done = store.finish_trial(record.id, 0, TrialState.COMPLETE, reason="ok", objective=1.25, objective_step=3)
    assert done is not None and (done.objective, done.objective_step) == (1.25, 3)
    assert store.finish_trial(record.id, 0, TrialState.PRUNED, reason="late") is None
    store.create_trial(record.id, 2, {}, job("t2"))
    ended = store.finish_sweep(record.id, SweepState.CANCELLED, "enough")
    assert ended is not None and [t.state for t in ended.trials] == [
        TrialState.COMPLETE, TrialState.FAILED, TrialState.CANCELLED,
    ]
    assert store.finish_sweep(record.id, SweepState.FAILED, "twice") is None
    assert [s.id for s in store.list_sweeps(states=[SweepState.CANCELLED])] == [record.id]
    assert store.list_sweeps(states=[SweepState.RUNNING]) == []
    with pytest.raises(SweepNotFound):
        store.get_sweep("nope")


def test_a_tenant_named_sweep_shares_no_idempotency_key_with_trials(store_location: str) -> None:
    """CreateJob's key is `<tenant>/<request id>`; a trial job's once was `sweep/<sweep id>/<number>`."""
    store = JobStore(store_location)
    record, _ = store.create_sweep(sweep(), tenant="alice")
    trial = store.create_trial(record.id, 0, {}, job("t0"))
    assert trial is not None
    mine, created = store.create_job(job("mine"), tenant="sweep", request_id=f"{record.id}/0")
    assert created and mine.id != trial.job_id and mine.tenant == "sweep"
    store.create_job(job("taken"), tenant="sweep", request_id=f"{record.id}/1")
    second = store.create_trial(record.id, 1, {}, job("t1"))
    assert second is not None and store.get_job(second.job_id).tenant == "alice"


def test_migration_moves_trial_jobs_keys_out_of_the_tenants_namespace(store_location: str) -> None:
    """A version-6 store whose trial job has the old key `sweep/<sweep id>/0`, beside a tenant `sweep`
    job whose own key looks alike: only the trial's key moves, and a retried CreateJob of tenant `sweep`
    still finds its job."""
    store = JobStore(store_location)
    record, _ = store.create_sweep(sweep(), tenant="alice")
    trial = store.create_trial(record.id, 0, {}, job("t0"))
    assert trial is not None
    own, _ = store.create_job(job("own"), tenant="sweep", request_id=f"{record.id}/1")
    store._core.db.execute("UPDATE jobs SET request_id = ? WHERE id = ?", (f"sweep/{record.id}/0", trial.job_id))
    store.close()
    downgrade(store_location, 6)  # without the columns schema 8 and later add (7 adds none)
    store = JobStore(store_location)
    assert store.schema_version == SCHEMA_VERSION
    mine, created = store.create_job(job("mine"), tenant="sweep", request_id=f"{record.id}/0")
    assert created and mine.id != trial.job_id
    assert store.create_job(job("own"), tenant="sweep", request_id=f"{record.id}/1") == (store.get_job(own.id), False)
    assert store.create_trial(record.id, 1, {}, job("t1")) is not None


def test_a_request_id_reused_with_another_request_is_refused_and_older_jobs_keep_their_retries(store_location: str) -> None:
    store = JobStore(store_location)
    old, _ = store.create_job(job("old"), tenant="t", request_id="before-8")
    store.close()
    downgrade(store_location, 7)  # `old` was created before requests had digests
    store = JobStore(store_location)
    assert store.schema_version == SCHEMA_VERSION
    assert store.create_job(job("old"), tenant="t", request_id="before-8", digest="d1") == (store.get_job(old.id), False)
    first, created = store.create_job(job("new"), tenant="t", request_id="after-8", digest="d1")
    assert created
    assert store.create_job(job("new"), tenant="t", request_id="after-8", digest="d1") == (store.get_job(first.id), False)
    assert store.job_of_request("t", "after-8", "d1") == store.get_job(first.id)
    with pytest.raises(RequestReused, match=first.id):
        store.create_job(job("other"), tenant="t", request_id="after-8", digest="d2")
    with pytest.raises(RequestReused, match=first.id):
        store.job_of_request("t", "after-8", "d2")
    sweep_record, _ = store.create_sweep(sweep(), tenant="t", request_id="s", digest="d1")
    with pytest.raises(RequestReused, match=sweep_record.id):
        store.sweep_of_request("t", "s", "d2")
    assert [j.id for j in store.list_jobs()] == [first.id, old.id]


def test_an_id_holding_nul_is_not_found_on_both_backends(store_location: str) -> None:
    """PostgreSQL refuses NUL even in a lookup (DataError); no id holds one, so it is simply unknown."""
    store = JobStore(store_location)
    with pytest.raises(JobNotFound):
        store.get_job("x\x00y")
    with pytest.raises(SweepNotFound):
        store.get_sweep("x\x00y")


def test_a_sweep_is_read_with_its_trials_as_of_one_commit(store_location: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another replica cancels the sweep between the read of its row and the read of its trials: a reader
    sees it RUNNING with a RUNNING trial or CANCELLED with a CANCELLED one, never RUNNING with CANCELLED."""
    mine, other = JobStore(store_location), JobStore(store_location)
    database = type(mine._core.db)
    execute = database.execute
    cancelled = threading.Event()

    def cancel_in_between(db: object, sql: str, params: object = ()) -> object:
        if sql.startswith("SELECT * FROM sweep_trials") and not cancelled.is_set():
            cancelled.set()
            other.finish_sweep(newest, SweepState.CANCELLED, "replica B cancelled it")
        return execute(db, sql, params)

    for read in (mine.get_sweep, lambda _: mine.list_sweeps()[0]):
        newest = mine.create_sweep(sweep())[0].id
        mine.create_trial(newest, 0, {}, job("t0"))
        cancelled.clear()
        monkeypatch.setattr(database, "execute", cancel_in_between)
        got = read(newest)
        monkeypatch.undo()
        assert cancelled.is_set() and (got.state, got.trials[0].state) == (SweepState.RUNNING, TrialState.RUNNING)
        assert mine.get_sweep(newest).trials[0].state == TrialState.CANCELLED


def test_an_id_already_taken_is_drawn_again(store_location: str) -> None:
    """Ids carry 32 random bits: a new job or sweep whose id is taken gets another (it was an
    IntegrityError, answered INTERNAL), while a request id used twice still returns the first."""
    store = JobStore(store_location)
    taken, fresh = uuid.UUID("deadbeef" + "0" * 24), uuid.UUID("cafef00d" + "0" * 24)
    with mock.patch("trainctl.service.store.jobs.uuid.uuid4", side_effect=[taken, taken, fresh, taken, taken, taken, fresh]):
        first, _ = store.create_job(job("train"), request_id="r")
        second, created = store.create_job(job("train"))
        first_sweep, _ = store.create_sweep(sweep())
        second_sweep, _ = store.create_sweep(sweep())
    assert (first.id, second.id, created) == ("train-deadbeef", "train-cafef00d", True)
    assert (first_sweep.id, second_sweep.id) == ("s-deadbeef", "s-cafef00d")
    assert store.create_job(job("train"), request_id="r") == (store.get_job(first.id), False)
    assert [j.id for j in store.list_jobs()] == [second.id, first.id]


def test_values_keep_their_range_and_precision(store_location: str) -> None:
    """Timestamps to the microsecond, byte counts past 32 bits, an absent MFU stays absent."""
    store = JobStore(store_location)
    now = 1_790_000_000.123456
    record, _ = store.create_job(job(), now=now)
    store.record_step(record.id, {"step": 1, "loss": 2.5, "peak_memory_bytes": 80 * 2**30, "lr": 3e-4}, now=now)
    row = store.step_metrics(record.id)[0]
    assert (row["peak_memory_bytes"], row["lr"], row["mfu"], row["time"]) == (80 * 2**30, 3e-4, None, now)
    assert store.get_job(record.id).create_time == now


def test_mfu_in_both_conventions_round_trips_and_an_old_store_reads_none(store_location: str) -> None:
    """`mfu` (Megatron's convention, causal attention halved) and `mfu_full_attention` (torchtitan's) are
    kept per step and as the job's newest; a store from before schema 11 gains the column, rows read None."""
    store = JobStore(store_location)
    old, _ = store.create_job(job("old"))
    store.record_step(old.id, {"step": 1, "loss": 2.0, "mfu": 0.4})
    store.close()
    downgrade(store_location, 10)
    store = JobStore(store_location)
    assert store.schema_version == SCHEMA_VERSION
    row = store.step_metrics(old.id)[0]
    assert (row["mfu"], row["mfu_full_attention"]) == (0.4, None)
    got = store.get_job(old.id)
    assert (got.mfu, got.mfu_full_attention) == (0.4, None)
    store.record_step(old.id, {"step": 2, "loss": 1.5, "mfu": 0.41, "mfu_full_attention": 0.43})
    row = store.step_metrics(old.id)[1]
    assert (row["mfu"], row["mfu_full_attention"]) == (0.41, 0.43)
    got = JobStore(store_location).get_job(old.id)
    assert (got.mfu, got.mfu_full_attention) == (0.41, 0.43)
    store.record_step(old.id, {"step": 3, "loss": 1.4})  # a step without MFU: the job's newest has none
    assert store.get_job(old.id).mfu_full_attention is None


def test_non_finite_metrics_read_back_as_written_and_null_stays_no_value(store_location: str) -> None:
    """A diverged step's NaN (SQLite would bind it as NULL, failing NOT NULL) and ±inf are stored on both
    backends; the first step's NaN loss stays the job's first loss; an absent MFU stays absent."""
    store = JobStore(store_location)
    record, _ = store.create_job(job())
    assert store.get_job(record.id).first_loss is None  # no step yet
    store.record_step(record.id, {"step": 1, "loss": math.nan, "grad_norm": math.inf, "mfu": math.nan})
    store.record_step(record.id, {"step": 2, "loss": -math.inf, "grad_norm": math.nan, "lr": math.nan})
    store.record_step(record.id, {"step": 3, "loss": 2.5})
    rows = store.step_metrics(record.id)
    assert math.isnan(rows[0]["loss"]) and rows[0]["grad_norm"] == math.inf and math.isnan(rows[0]["mfu"])
    assert rows[1]["loss"] == -math.inf and math.isnan(rows[1]["grad_norm"]) and math.isnan(rows[1]["lr"])
    assert rows[1]["mfu"] is None and rows[2]["mfu"] is None
    got = JobStore(store_location).get_job(record.id)
    assert math.isnan(got.first_loss) and got.last_loss == 2.5 and got.mfu is None


def test_two_stores_on_one_database_never_share_a_sequence(store_location: str) -> None:
    """Writers in two connections (two service processes) serialize: job seqs and event sequences stay unique."""
    stores = [JobStore(store_location), JobStore(store_location)]

    def submit(store: JobStore) -> list[str]:
        return [store.create_job(job(f"c{i}"))[0].id for i in range(15)]

    with ThreadPoolExecutor(2) as pool:
        ids = [job_id for batch in pool.map(submit, stores) for job_id in batch]
    records = stores[0].list_jobs()
    assert sorted(r.id for r in records) == sorted(ids)
    assert len({r.seq for r in records}) == 30
    sequences = [e.sequence for job_id in ids for e in stores[1].events(job_id)]
    assert len(set(sequences)) == 30


def test_a_lease_has_one_holder_and_fenced_writes_need_it_held(store_location: str) -> None:
    store = JobStore(store_location)
    job_id = store.create_job(job())[0].id
    a = store.acquire_lease("scheduler", "a", ttl=0.3)
    assert a is not None and store.acquire_lease("scheduler", "b", ttl=0.3) is None  # a's is live
    assert store.acquire_lease("scheduler", "a", ttl=0.3) == a  # a renewal keeps the epoch
    time.sleep(0.4)
    b = store.acquire_lease("scheduler", "b", ttl=30)
    assert b is not None and b.epoch == a.epoch + 1
    with store.fenced(a), pytest.raises(LeaseLost):
        store.update_status(job_id, reason="from the old leader")  # refused, nothing written
    with store.fenced(a), pytest.raises(LeaseLost):
        store.record_step(job_id, {"step": 1, "loss": 1.0})
    assert store.get_job(job_id).reason == "accepted" and store.events(job_id)[-1].type == "state"
    with store.fenced(b):
        updated = store.update_status(job_id, reason="from the leader")
    assert updated is not None and updated.reason == "from the leader"
    assert store.update_status(job_id, reason="unfenced (an API call)") is not None
    store.release_lease(a)  # not a's any more: nothing happens
    assert store.acquire_lease("scheduler", "a", ttl=30) is None
    store.release_lease(b)
    again = store.acquire_lease("scheduler", "a", ttl=30)
    assert again is not None and again.epoch == b.epoch + 1
    with store.fenced(b), pytest.raises(LeaseLost):
        store.append_event(job_id, "log", {"message": "late"})


@pytest.mark.parametrize("url, secret", [
    ("postgresql://user:s3cret@[::1/db", "s3cret"),
    ("postgresql://trainctl:p%ssw0rd@db.internal:5432/trainctl", "p%ssw0rd"),  # psycopg quotes the bad token
    ("postgresql://trainctl@db.internal/trainctl?password=p%zz", "p%zz"),
])
def test_a_malformed_postgresql_url_is_a_store_error_that_does_not_echo_it(url: str, secret: str) -> None:
    with pytest.raises(StoreError, match="not a valid PostgreSQL URL") as info:
        JobStore(url)
    assert secret not in str(info.value) and "trainctl@" not in str(info.value) and info.value.__cause__ is None


def test_reads_do_not_wait_for_a_write_to_commit(store_location: str) -> None:
    """While a write transaction is open (a CreateJob waiting on its fsync, or on PostgreSQL's round
    trips), reads answer from their own connection with what was committed before it."""
    store = JobStore(store_location)
    job_id = store.create_job(job("r"))[0].id
    inside, release = threading.Event(), threading.Event()

    def open_write() -> None:
        with store._core.tx() as db:  # the transaction every write method runs in
            db.execute("UPDATE jobs SET reason = 'uncommitted', version = version + 1 WHERE id = ?", (job_id,))
            inside.set()
            release.wait(30)

    writer = threading.Thread(target=open_write)
    writer.start()
    try:
        assert inside.wait(10)
        answers: list[object] = []
        reader = threading.Thread(target=lambda: answers.extend(
            [store.get_job(job_id).reason, len(store.list_jobs()), len(store.events(job_id)), store.count_by_state()]
        ))
        reader.start()
        reader.join(timeout=10)
        assert not reader.is_alive(), "a read waited for the open write transaction"
        assert answers == ["accepted", 1, 1, {JobState.QUEUED: 1}]
    finally:
        release.set()
        writer.join()
    assert store.get_job(job_id).reason == "uncommitted"
    store.close()


def test_postgresql_reads_share_a_few_read_only_connections_closed_with_the_store(postgres) -> None:
    """However many threads read at once, a store opens at most READ_CONNECTIONS read connections
    besides its write connection; they refuse writes, and closing the store closes them all."""
    url = postgres.create_database()
    store = JobStore(url)
    job_id = store.create_job(job("p"))[0].id
    database = url.rsplit("/", 1)[1]
    watcher = psycopg.connect(postgres.url(), autocommit=True)

    def connections() -> int:
        return watcher.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = 'trainctl'", (database,)
        ).fetchone()[0]

    with ThreadPoolExecutor(4 * READ_CONNECTIONS) as pool:
        reads = list(pool.map(lambda _: (store.get_job(job_id).name, len(store.list_jobs())), range(400)))
    assert reads == [("p", 1)] * 400
    assert 1 < connections() <= READ_CONNECTIONS + 1
    with store._core.db.reading() as db, pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        db.execute("UPDATE jobs SET reason = 'written through a read connection'")
    store.close()
    deadline = time.monotonic() + 10  # a backend leaves pg_stat_activity once it has exited
    while connections() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert connections() == 0
    watcher.close()
    postgres.drop_database(url)


def test_a_reading_thread_takes_its_sqlite_connection_with_it(tmp_path: Path) -> None:
    """Threads that come and go (a watch reader per followed job) do not accumulate open connections."""
    store = JobStore(tmp_path)
    store.count_by_state()

    def open_files() -> int:
        return len(list(Path("/proc/self/fd").iterdir()))

    before = open_files()
    for _ in range(200):
        reader = threading.Thread(target=store.count_by_state)
        reader.start()
        reader.join()
    time.sleep(0.5)  # a finished thread's locals go once the interpreter has let go of the thread
    gc.collect()  # sqlite3 connections are freed by the cycle collector
    assert open_files() - before < 100  # 2 files per connection, 400 if each thread kept its own
    store.close()


def test_closing_a_sqlite_store_while_threads_read_it_waits_for_their_reads(tmp_path: Path) -> None:
    """A watch hub's reader was mid-query when the store closed under it: SQLite connections closed while
    another thread executes on them crashed the process (SIGSEGV, seen in make test). Run in a subprocess so
    a crash is a failure with its exit status, not the end of the test run."""
    code = f"""
import sys, threading
sys.path[:0] = {sys.path!r}
from small_jobs import small_job
from trainctl.service.store import JobStore
for attempt in range(20):
    store = JobStore({str(tmp_path)!r} + f"/data-{{attempt}}")
    record, _ = store.create_job(small_job("reader"))
    for _ in range(50):
        store.append_event(record.id, "log", {{"message": "x" * 200}})
    started = threading.Barrier(5)
    def read() -> None:
        started.wait()
        try:
            while True:
                store.events(record.id)
        except Exception:  # the store closed under it: an error, never a crash
            return
    readers = [threading.Thread(target=read) for _ in range(4)]
    for thread in readers:
        thread.start()
    started.wait()
    store.close()
    for thread in readers:
        thread.join(10)
        assert not thread.is_alive()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])
