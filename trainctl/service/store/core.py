"""The store's core, shared by its parts: one database (`db`), the transaction every write runs in
(`tx`: one write at a time, committed before it returns, fenced by a lease where the thread asked for it,
its commit listeners called after), the read connections (`reading`), and the record cache. Each part
(jobs, events, queue, sweeps, leases) runs its SQL in the core's transactions, so an operation that
writes several tables (a job with its labels, first event and request key; a trial with its job) still
commits once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainctl.service.store.cache import RecordCache, job_record
from trainctl.service.store.db import Database, open_database
from trainctl.service.store.leases import holds
from trainctl.service.store.records import Fence, JobRecord, LeaseLost
from trainctl.service.store.schema import migrate
from trainctl.spec.job import TrainingJob


class StoreCore:
    """One database, its transactions and commit listeners, and the records kept built; thread-safe."""

    def __init__(self, location: str | Path):
        self.lock = threading.RLock()
        """Held by a write from its BEGIN to its commit (and by whatever else uses the write connection)."""
        self.cache = RecordCache()
        self._commit_listeners: dict[str | None, set[Callable[[], None]]] = {}
        """Job id (None: any commit) -> what to call after a commit that appended that job's events."""
        self._listeners_lock = threading.Lock()
        """Guards `_commit_listeners` (not `lock`, which a write holds until it commits)."""
        self._appended: set[str] = set()
        """Jobs whose events the open write transaction appended (under the lock)."""
        self._written: list[JobRecord] = []
        """Records of the rows the open write transaction wrote, kept once it commits (under the lock)."""
        self._fencing = threading.local()  # .fence: the Fence this thread's writes carry (see fenced)
        self.db: Database = open_database(location)
        try:
            with self.tx() as db:
                migrate(db)
        except BaseException:
            self.db.close()
            raise

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
    def tx(self) -> Iterator[Database]:
        """The write transaction of the block, on the write connection, committed when the block ends
        (rolled back when it raises)."""
        with self.lock:
            self.db.begin_write()
            try:
                fence = getattr(self._fencing, "fence", None)
                if fence is not None and not holds(self.db, fence):
                    raise LeaseLost(f"lease {fence.name} (epoch {fence.epoch}) is no longer held by {fence.holder}")
                yield self.db
            except BaseException:
                self._appended.clear()
                self._written.clear()
                self.db.rollback()
                raise
            written, self._written = self._written, []
            try:
                self.db.commit()
            except BaseException:
                self._appended.clear()
                raise
            for record in written:  # only now: a record of a change that did not commit must never be kept
                self.cache.records.add(record.id, record)
            self._notify()

    def appended(self, job_id: str) -> None:
        """The open write transaction appended an event of `job_id`: its listeners hear the commit."""
        self._appended.add(job_id)

    def wrote(self, row: dict[str, Any], spec: TrainingJob, labels: dict[str, str]) -> JobRecord:
        """The record of `row` as the open write transaction wrote it (RETURNING), kept once it commits."""
        record = job_record(row, spec, labels)
        self._written.append(record)
        return record

    def _notify(self) -> None:
        """Call the listeners of the transaction just committed (under the lock)."""
        appended, self._appended = self._appended, set()
        for key in (None, *appended):
            with self._listeners_lock:
                listeners = list(self._commit_listeners.get(key, ()))
            for listener in listeners:
                listener()

    def on_commit(self, callback: Callable[[], None], job_id: str | None = None) -> Callable[[], None]:
        """Call `callback` after each commit (with `job_id`: each that appended an event of that job),
        until the returned function is called (`JobStore.on_commit`)."""
        with self._listeners_lock:
            self._commit_listeners.setdefault(job_id, set()).add(callback)

        def unsubscribe() -> None:
            with self._listeners_lock:
                listeners = self._commit_listeners.get(job_id, set())
                listeners.discard(callback)
                if not listeners:
                    self._commit_listeners.pop(job_id, None)

        return unsubscribe

    @contextmanager
    def reading(self, *, snapshot: bool = False) -> Iterator[Database]:
        """A read connection for the block (`Database.reading`: a read never waits for a write to
        commit). With `snapshot`, every read of the block sees the same commit (one read-only
        transaction)."""
        with self.db.reading() as db:
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
