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

    def append_event(
        self, job_id: str, type_: str, payload: dict[str, Any], now: float | None, runtime_cursor: int | None = None
    ) -> int:
        now = time.time() if now is None else now
        with self._core.tx() as db:
            if runtime_cursor is not None:
                db.execute("UPDATE jobs SET runtime_cursor = ?, version = version + 1 WHERE id = ?", (str(runtime_cursor), job_id))
            return self.append(db, job_id, type_, payload, now)

    def record_step(self, job_id: str, metrics: dict[str, Any], now: float | None, runtime_cursor: int | None = None) -> int:
        now = time.time() if now is None else now
        with self._core.tx() as db:
            return self.write_step(db, job_id, metrics, now, runtime_cursor)

    def write_step(
        self, db: Database, job_id: str, metrics: dict[str, Any], now: float, runtime_cursor: int | None = None
    ) -> int:
        """`record_step` in the open write transaction `db` (a bench fills a long run many steps a
        transaction, bench/scale/job_steps.py); the step event's sequence."""
        step = int(metrics["step"])
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
            " mfu_full_attention = ?, last_eval_loss = COALESCE(?, last_eval_loss), runtime_cursor = COALESCE(?, runtime_cursor),"
            " update_time = ?, version = version + 1 WHERE id = ?",
            (step, step, first, metrics["loss"], metrics.get("tokens_per_second"), metrics.get("mfu"),
             metrics.get("mfu_full_attention"), metrics.get("eval_loss"),
             None if runtime_cursor is None else str(runtime_cursor), now, job_id),
        )
        return self.append(db, job_id, EVENT_STEP, {**metrics, "time": metrics.get("time", now)}, now)

    def step_metrics(self, job_id: str, after_step: int) -> list[dict[str, Any]]:
        with self._core.reading() as db:
            self._core.cache.get(db, job_id)
            rows = db.execute(
                "SELECT * FROM step_metrics WHERE job_id = ? AND step > ? ORDER BY step", (job_id, after_step)
            ).fetchall()
        return [_step_row(row) for row in rows]

    def thinned_step_metrics(self, job_id: str, limit: int) -> list[dict[str, Any]]:
        """At most `limit` (at least 4) of the job's step rows, in step order: all of them when there are
        no more, else the steps that evaluated (an eval curve has far fewer points than the training curve)
        evenly spread over their step numbers to half of `limit` at most, and the other steps evenly spread
        to the rest, the first and the last of each kept. Each spread row is looked up by the primary key
        (the evaluated ones by `step_metrics_evaluated`), so the read costs about `limit` index lookups
        however many steps the job has, not a read of every row."""
        if limit < 4:
            raise ValueError(f"limit must be at least 4, got {limit}")
        with self._core.reading(snapshot=True) as db:
            self._core.cache.get(db, job_id)
            counted = db.execute(  # counted on the primary key, up to one more than `limit`
                "SELECT COUNT(*) AS n FROM (SELECT step FROM step_metrics WHERE job_id = ? LIMIT ?) AS head",
                (job_id, limit + 1),
            ).fetchone()
            if int(counted["n"]) <= limit:
                rows = db.execute("SELECT * FROM step_metrics WHERE job_id = ? ORDER BY step", (job_id,)).fetchall()
            else:
                half = limit // 2
                evaluated = db.execute(
                    "SELECT * FROM step_metrics WHERE job_id = ? AND eval_loss IS NOT NULL ORDER BY step LIMIT ?",
                    (job_id, half + 1),
                ).fetchall()
                if len(evaluated) > half:
                    evaluated = _spread(db, job_id, half, "eval_loss IS NOT NULL")
                rows = sorted([*evaluated, *_spread(db, job_id, limit - len(evaluated), "eval_loss IS NULL")],
                              key=lambda row: row["step"])
        return [_step_row(row) for row in rows]

    def events(self, job_id: str, after_sequence: int, limit: int) -> list[Event]:
        with self._core.reading() as db:
            rows = db.execute(
                "SELECT * FROM events WHERE job_id = ? AND sequence > ? ORDER BY sequence LIMIT ?",
                (job_id, after_sequence, limit),
            ).fetchall()
        return [Event(r["sequence"], r["job_id"], r["time"], r["type"], json.loads(r["payload"])) for r in rows]


def _step_row(row: dict[str, Any]) -> dict[str, Any]:
    """A `step_metrics` row as `step_metrics` answers it: without its job id, its breakdown parsed."""
    item = dict(row)
    item.pop("job_id")
    item["breakdown"] = json.loads(item["breakdown"])
    return item


def _spread(db: Database, job_id: str, count: int, matching: str) -> list[dict[str, Any]]:
    """At most `count` (at least 2) of the job's step rows `matching` (an SQL condition), evenly spread
    over their step numbers from the first to the last: for each of `count` evenly spaced step numbers the
    first matching row at or after it, each found by one index lookup (a recursive CTE counts the
    targets, so the statement is one round trip on either backend). Where the steps have no gaps these
    are the rows an even thinning by position keeps."""
    ends = [  # two statements: MIN and MAX together would be a scan of the job's rows on SQLite
        db.execute(f"SELECT step FROM step_metrics WHERE job_id = ? AND {matching} ORDER BY step {order} LIMIT 1",
                   (job_id,)).fetchone()
        for order in ("ASC", "DESC")
    ]
    if ends[0] is None or ends[1] is None:
        return []
    first, span, intervals = int(ends[0]["step"]), int(ends[1]["step"]) - int(ends[0]["step"]), max(count, 2) - 1
    # target i = first + round(i * span / intervals), in integers (halves rounded up)
    return db.execute(
        "WITH RECURSIVE targets(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM targets WHERE i < CAST(? AS BIGINT))"
        " SELECT * FROM step_metrics WHERE job_id = ? AND step IN ("
        f"  SELECT (SELECT s.step FROM step_metrics s WHERE s.job_id = ? AND {matching.replace('eval_loss', 's.eval_loss')}"
        "    AND s.step >= CAST(? AS BIGINT) + (2 * i * CAST(? AS BIGINT) + CAST(? AS BIGINT)) / CAST(? AS BIGINT)"
        "    ORDER BY s.step LIMIT 1) FROM targets)"
        " ORDER BY step",
        (intervals, job_id, job_id, first, span, intervals, 2 * intervals),
    ).fetchall()
