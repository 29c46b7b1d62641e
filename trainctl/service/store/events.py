"""A job's append-only event log (table `events`; its global `sequence` is the cursor WatchJob resumes
from) and its step metrics (table `step_metrics`, one row per job and step: a step re-run after a restart
replaces its row; a metric other than the loss may be absent, NULL: the eval loss is only on the steps
that evaluated)."""

from __future__ import annotations

import json
import time
from typing import Any

from trainctl.service.store.core import StoreCore
from trainctl.service.store.db import Database, json_text
from trainctl.service.store.records import EVENT_STEP, Event

METRIC_COLUMNS = (
    "loss", "grad_norm", "lr", "tokens", "tokens_per_second", "mfu", "step_time_seconds", "peak_memory_bytes",
    "eval_loss", "mfu_full_attention",
)


class EventLog:
    """Appending and reading events and step metrics."""

    def __init__(self, core: StoreCore):
        self._core = core

    def append(self, db: Database, job_id: str, type_: str, payload: dict[str, Any], now: float) -> int:
        """Append one event in the open write transaction `db`; its sequence."""
        self._core.appended(job_id)
        row = db.execute(
            "INSERT INTO events (job_id, time, type, payload) VALUES (?, ?, ?, ?) RETURNING sequence",
            (job_id, now, type_, json_text(payload)),
        ).fetchone()
        return int(row["sequence"])

    def append_event(self, job_id: str, type_: str, payload: dict[str, Any], now: float | None) -> int:
        with self._core.tx() as db:
            return self.append(db, job_id, type_, payload, time.time() if now is None else now)

    def record_step(self, job_id: str, metrics: dict[str, Any], now: float | None) -> int:
        now = time.time() if now is None else now
        step = int(metrics["step"])
        with self._core.tx() as db:
            current = self._core.cache.get(db, job_id)
            values = [metrics.get(c) for c in METRIC_COLUMNS]
            db.execute(
                "INSERT INTO step_metrics (job_id, step, time, breakdown, " + ", ".join(METRIC_COLUMNS)
                + ") VALUES (?, ?, ?, ?, " + ", ".join("?" * len(METRIC_COLUMNS)) + ")"
                " ON CONFLICT (job_id, step) DO UPDATE SET "
                + ", ".join(f"{c} = excluded.{c}" for c in ("time", "breakdown", *METRIC_COLUMNS)),
                (job_id, step, metrics.get("time", now), json_text(metrics.get("breakdown") or {}), *values),
            )
            first = current.first_loss if current.first_loss is not None else metrics["loss"]
            # The job's tokens/s and eval loss are the newest step's that has one (a command job's first
            # report has no rate; only the steps that evaluated have an eval loss).
            db.execute(
                "UPDATE jobs SET steps_done = CASE WHEN steps_done > ? THEN steps_done ELSE ? END, first_loss = ?,"
                " last_loss = ?, tokens_per_second = COALESCE(?, tokens_per_second), mfu = ?,"
                " mfu_full_attention = ?, last_eval_loss = COALESCE(?, last_eval_loss), update_time = ?, version = version + 1 WHERE id = ?",
                (step, step, first, metrics["loss"], metrics.get("tokens_per_second"), metrics.get("mfu"),
                 metrics.get("mfu_full_attention"), metrics.get("eval_loss"), now, job_id),
            )
            return self.append(db, job_id, EVENT_STEP, {**metrics, "time": metrics.get("time", now)}, now)

    def step_metrics(self, job_id: str, after_step: int) -> list[dict[str, Any]]:
        with self._core.reading() as db:
            self._core.cache.get(db, job_id)
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

    def events(self, job_id: str, after_sequence: int, limit: int) -> list[Event]:
        with self._core.reading() as db:
            rows = db.execute(
                "SELECT * FROM events WHERE job_id = ? AND sequence > ? ORDER BY sequence LIMIT ?",
                (job_id, after_sequence, limit),
            ).fetchall()
        return [Event(r["sequence"], r["job_id"], r["time"], r["type"], json.loads(r["payload"])) for r in rows]
