"""Leases (table `leases`, schema 3): one replica's scheduler leads while it holds lease `name`, timed by
the database's clock (`NOW_SQL`), so replicas' clocks need not agree. A write made inside
`StoreCore.fenced(fence)` commits only while `holds(db, fence)`, checked in its own transaction."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainctl.service.store.db import NOW_SQL, Database
from trainctl.service.store.records import Fence

if TYPE_CHECKING:
    from trainctl.service.store.core import StoreCore


def holds(db: Database, fence: Fence) -> bool:
    """Whether `fence`'s holder holds its lease at its epoch, unexpired, as `db` reads it now."""
    return db.execute(
        f"SELECT 1 AS held FROM leases WHERE name = ? AND holder = ? AND epoch = ? AND expires > {NOW_SQL[db.backend]}",
        (fence.name, fence.holder, fence.epoch),
    ).fetchone() is not None


class Leases:
    """Taking, renewing and giving up leases."""

    def __init__(self, core: StoreCore):
        self._core = core

    def acquire_lease(self, name: str, holder: str, ttl: float) -> Fence | None:
        """Take or renew lease `name` for `ttl` seconds; None while another holder's is unexpired."""
        now = NOW_SQL[self._core.db.backend]
        with self._core.tx() as db:
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

    def release_lease(self, fence: Fence) -> None:
        """Expire the lease at once, if `fence` still holds it."""
        with self._core.tx() as db:
            db.execute(
                f"UPDATE leases SET expires = {NOW_SQL[self._core.db.backend]} - 1 WHERE name = ? AND holder = ? AND epoch = ?",
                (fence.name, fence.holder, fence.epoch),
            )
