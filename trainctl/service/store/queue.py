"""The queue: QUEUED jobs in admission order (priority descending, then submission order, off the
`jobs_queue` index), the reason they wait, and the count of jobs by state."""

from __future__ import annotations

import time

from trainctl.service.store.core import StoreCore
from trainctl.service.store.records import QueuedJob
from trainctl.workers.events import JobState


class Queue:
    """The admission pass's reads and writes of the queue."""

    def __init__(self, core: StoreCore):
        self._core = core

    def queue(self, after: QueuedJob | None, limit: int) -> list[QueuedJob]:
        where, args = ["state = ?"], [JobState.QUEUED]
        if after is not None:
            where.append("(priority < ? OR (priority = ? AND seq > ?))")
            args.extend((after.priority, after.priority, after.seq))
        with self._core.reading() as db:
            rows = db.execute(
                f"SELECT id, seq, priority, tenant, reason FROM jobs WHERE {' AND '.join(where)}"
                " ORDER BY priority DESC, seq ASC LIMIT ?",
                (*args, limit),
            ).fetchall()
            specs_of = self._core.cache.specs_of(db, [row["id"] for row in rows])
        specs = specs_of()
        return [QueuedJob(job=specs[row["id"]], **row) for row in rows]

    def set_queue_reason(self, reason: str, behind: QueuedJob | None) -> int:
        where, args = ["state = ?", "reason <> ?"], [JobState.QUEUED, reason]
        if behind is not None:
            where.append("(priority < ? OR (priority = ? AND seq > ?))")
            args.extend((behind.priority, behind.priority, behind.seq))
        condition = " AND ".join(where)
        with self._core.reading() as db:  # most passes change nothing: find that out without a write transaction
            if db.execute(f"SELECT 1 FROM jobs WHERE {condition} LIMIT 1", args).fetchone() is None:
                return 0
        with self._core.tx() as db:
            return db.execute(f"UPDATE jobs SET reason = ?, update_time = ?, version = version + 1 WHERE {condition}", (reason, time.time(), *args)).rowcount

    def count_by_state(self, tenant: str | None) -> dict[str, int]:
        sql = "SELECT state, COUNT(*) AS n FROM jobs" + (" WHERE tenant = ?" if tenant is not None else "") + " GROUP BY state"
        with self._core.reading() as db:
            rows = db.execute(sql, (tenant,) if tenant is not None else ()).fetchall()
        return {r["state"]: r["n"] for r in rows}
