"""Leadership among service replicas sharing one store: a lease in the database (`JobStore.acquire_lease`).

Every replica serves the API; only the holder of the `scheduler` lease runs the scheduler's and the
sweep driver's work (admission, supervision, restarts). A `Leadership` tries to take or renew the lease
every `ttl / 3` seconds in its own thread. The lease's expiry is the database's clock; this replica
counts its own lease as valid only until `ttl` seconds after it *sent* the request that took it
(monotonic clock), which is never later than the database's expiry, so a standby (which takes the lease
only once the database says it expired) never leads while this replica still believes it does.

Work that must happen once is fenced: the scheduler loop's writes carry the lease (`JobStore.fenced`)
and commit only while it holds, and a job is handed to the runtime only while the lease has at least
`LAUNCH_MARGIN_SHARE` of its time left (`may_launch()`), so a deposed leader paused at any point starts
nothing its successor also starts.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from trainctl.service.store import Fence, JobStore, StoreUnavailable

log = logging.getLogger(__name__)

SCHEDULER_LEASE = "scheduler"
LEASE_SECONDS = 6.0
"""How long a lease lasts unrenewed: a standby leads at most this long (plus one try) after the leader died."""
LAUNCH_MARGIN_SHARE = 1 / 3
"""The share of the lease a leader must have left to hand a job to the runtime (covering the start call
itself); renewals every ttl / 3 keep at least 2/3 of it left while the database answers."""


def replica_id() -> str:
    """This process's holder name: host, process id and a random suffix (unique even after a restart)."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class Lease:
    fence: Fence
    valid_until: float
    """time.monotonic() after which this replica no longer counts on the lease."""


class Leadership:
    """Holds (or waits for) one lease of `store`; `current()` is the lease while it is valid, else None."""

    def __init__(self, store: JobStore, *, name: str = SCHEDULER_LEASE, holder: str | None = None,
                 ttl: float = LEASE_SECONDS):
        self.store = store
        self.name = name
        self.holder = holder or replica_id()
        self.ttl = ttl
        self._lease: Lease | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self, margin: float = 0.0) -> Lease | None:
        """The lease, if it stays valid for at least `margin` more seconds."""
        with self._lock:
            lease = self._lease
        return lease if lease is not None and time.monotonic() + margin < lease.valid_until else None

    def may_launch(self) -> bool:
        """Whether enough of the lease is left to hand a job to the runtime now."""
        return self.current(margin=self.ttl * LAUNCH_MARGIN_SHARE) is not None

    def try_acquire(self) -> Lease | None:
        """One attempt to take or renew the lease; the lease held afterwards (None: a standby)."""
        sent = time.monotonic()
        try:
            fence = self.store.acquire_lease(self.name, self.holder, self.ttl)
        except StoreUnavailable as exc:
            log.warning("lease %s not renewed: %s", self.name, exc)
            return self.current()
        lease = Lease(fence, sent + self.ttl) if fence is not None else None
        with self._lock:
            before, self._lease = self._lease, lease
        if (before is None) != (lease is None) or (before and lease and before.fence != lease.fence):
            log.info("lease %s: %s", self.name, f"held by {self.holder} (epoch {fence.epoch})" if fence else "standby")
        return lease

    def start(self) -> None:
        """Try now, then keep trying every ttl / 3 in a daemon thread."""
        self.try_acquire()
        self._thread = threading.Thread(target=self._run, name=f"trainctl-lease-{self.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            self.try_acquire()

    def stop(self) -> None:
        """Stop renewing and give the lease up, so a standby takes over on its next try."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.ttl)
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            try:
                self.store.release_lease(lease.fence)
            except StoreUnavailable as exc:
                log.warning("lease %s not released (it lapses by itself): %s", self.name, exc)
