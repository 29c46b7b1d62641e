"""Sweeps and their trials (tables `sweeps` and `sweep_trials`, schema 2). A sweep is read with its
trials in one read-only transaction, so as of one commit; a trial is recorded with its job in one write
transaction, compare-and-set on the trial number, so no trial is ever recorded twice."""

from __future__ import annotations

import json
import time
from typing import Any

from trainctl.service.store.core import StoreCore
from trainctl.service.store.db import Database, json_text
from trainctl.service.store.jobs import Jobs, inserted, request_key, retried, tenant_and_states, trial_key
from trainctl.service.store.records import SweepNotFound, SweepRecord, SweepState, TrialRecord, TrialState
from trainctl.spec.job import TrainingJob
from trainctl.spec.sweep import Sweep


def _trial_record(row: dict[str, Any]) -> TrialRecord:
    return TrialRecord(**{**row, "params": json.loads(row["params"]), "state": TrialState(row["state"])})


class Sweeps:
    """The sweeps' and trials' rows; a trial's job through `Jobs`, in the trial's transaction."""

    def __init__(self, core: StoreCore, jobs: Jobs):
        self._core = core
        self._jobs = jobs

    def create_sweep(
        self, sweep: Sweep, tenant: str, request_id: str | None, now: float | None, digest: str | None,
    ) -> tuple[SweepRecord, bool]:
        now = time.time() if now is None else now
        key = request_key(tenant, request_id) if request_id else None
        with self._core.tx() as db:
            if key:
                row = db.execute("SELECT id, request_digest FROM sweeps WHERE request_id = ?", (key,)).fetchone()
                if row is not None:
                    return self._get_sweep(db, retried(row, digest)), False
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 AS seq FROM sweeps").fetchone()["seq"]
            spec = sweep.model_dump_json()
            row = inserted(sweep.metadata.name, lambda sweep_id: db.execute(
                "INSERT INTO sweeps (id, seq, request_id, request_digest, tenant, name, spec, state, reason, create_time,"
                " update_time) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING RETURNING id",
                (sweep_id, seq, key, digest, tenant, sweep.metadata.name, spec, SweepState.RUNNING, "accepted", now, now),
            ).fetchone())
            return self._get_sweep(db, row["id"]), True

    def get_sweep(self, sweep_id: str) -> SweepRecord:
        with self._core.reading(snapshot=True) as db:  # the sweep and its trials as of one commit
            return self._get_sweep(db, sweep_id)

    def sweep_of_request(self, tenant: str, request_id: str, digest: str | None) -> str | None:
        """The id of the sweep `tenant` created with `request_id`, if any."""
        with self._core.reading() as db:
            row = db.execute(
                "SELECT id, request_digest FROM sweeps WHERE request_id = ?", (request_key(tenant, request_id),)
            ).fetchone()
        return None if row is None else retried(row, digest)

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
        data["trials"] = [_trial_record(t) for t in trials]
        return SweepRecord(**data)

    def list_sweeps(
        self, tenant: str | None, states: list[SweepState], limit: int | None, before_seq: int | None,
    ) -> list[SweepRecord]:
        where, args = tenant_and_states(tenant, states)
        if before_seq is not None:
            where.append("seq < ?")
            args.append(before_seq)
        sql = "SELECT * FROM sweeps" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY seq DESC"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        with self._core.reading(snapshot=True) as db:  # each sweep with its trials as of the same commit
            return [self._sweep_record(db, row) for row in db.execute(sql, args).fetchall()]

    def create_trial(
        self, sweep_id: str, number: int, params: dict[str, Any], job: TrainingJob | None, reason: str,
        now: float | None,
    ) -> TrialRecord | None:
        now = time.time() if now is None else now
        with self._core.tx() as db:
            sweep = db.execute("SELECT tenant, state FROM sweeps WHERE id = ?", (sweep_id,)).fetchone()
            if sweep is None:
                raise SweepNotFound(sweep_id)
            count_ = db.execute("SELECT COUNT(*) AS n FROM sweep_trials WHERE sweep_id = ?", (sweep_id,)).fetchone()["n"]
            if sweep["state"] != SweepState.RUNNING or count_ != number:
                return None
            job_id = self._jobs.insert_job(db, job, sweep["tenant"], trial_key(sweep_id, number), now).id if job else None
            state, end = (TrialState.RUNNING, None) if job else (TrialState.FAILED, now)
            db.execute(
                "INSERT INTO sweep_trials (sweep_id, number, job_id, params, state, reason, create_time, end_time)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (sweep_id, number, job_id, json_text(params), state, reason, now, end),
            )
            db.execute("UPDATE sweeps SET update_time = ? WHERE id = ?", (now, sweep_id))
            return self._trial(db, sweep_id, number)

    def finish_trial(
        self, sweep_id: str, number: int, state: TrialState, reason: str, objective: float | None,
        objective_step: int | None, now: float | None,
    ) -> TrialRecord | None:
        now = time.time() if now is None else now
        with self._core.tx() as db:
            updated = db.execute(
                "UPDATE sweep_trials SET state = ?, reason = ?, objective = ?, objective_step = ?, end_time = ?"
                " WHERE sweep_id = ? AND number = ? AND state = ?",
                (state, reason, objective, objective_step, now, sweep_id, number, TrialState.RUNNING),
            ).rowcount
            if not updated:
                return None
            db.execute("UPDATE sweeps SET update_time = ? WHERE id = ?", (now, sweep_id))
            return self._trial(db, sweep_id, number)

    @staticmethod
    def _trial(db: Database, sweep_id: str, number: int) -> TrialRecord:
        return _trial_record(
            db.execute("SELECT * FROM sweep_trials WHERE sweep_id = ? AND number = ?", (sweep_id, number)).fetchone()
        )

    def finish_sweep(self, sweep_id: str, state: SweepState, reason: str, now: float | None) -> SweepRecord | None:
        now = time.time() if now is None else now
        with self._core.tx() as db:
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
